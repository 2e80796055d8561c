"""``select``: apply a policy to logits, return kept keys and a Certificate.

THEORY 6.1 and 6.5. Every policy reports its certificate (a FixedK user
learns what FixedK cost). Fixed-count policies carry their count
(``FixedCount.row_num_kept``); ``Certified`` keeps the fewest keys meeting
eps. Given logits, every key is already scored, so the Delta- and MC-Search
strategies (which exist to skip scoring) are honoured by the exact search:
its certificate is deterministic (failure_prob 0, stronger than MC's) and
``keys_scored`` counts every real key; use ``certified_search`` with queries
and keys to skip blocks. The certificate comes from ``core``.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxtopk import _deprecation
from jaxtopk.selection import _policies
from jaxtopk.selection import core
from jaxtopk.selection import threshold
from jaxtopk.selection._certificate import Certificate

# ``select`` honours every field of every policy (see the module docstring).
SUPPORTS = _policies.FEATURES


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Selection:
  """Kept keys of each row and what dropping the others cost.

  Attributes:
    keep: ``[..., n_keys]`` bool, True for a kept (attended) key; never True
      for a masked key or a key of logit -inf; all False on an invalid row.
    k_kept: ``[...]`` int32 number of kept keys.
    certificate: Certificate with arrays shaped ``[...]``.
  """

  keep: jax.Array
  k_kept: jax.Array
  certificate: Certificate


def keep_mask(
  s,
  policy,
  real,
  *,
  logit_error=0.0,
  n_keys=None,
  log_extra=None,
  coarse: bool = False,
) -> jax.Array:
  """The policy's kept set among the scored keys of each row.

  Args:
    s: ``[..., n]`` logits in the compute dtype (no gradient needed).
    policy: a selection policy.
    real: ``[..., n]`` bool keys that may be kept (real, logit not -inf).
    logit_error: ``[...]`` delta of the logits (``core.logit_error_bound``);
      Certified aims below eps by ``core.search_log_margin``.
    n_keys: static key count of the whole row when ``s`` holds only the
      scored part of it (counts and margins are of the whole row); default
      ``n``.
    log_extra: optional ``[...]`` log U, a bound on the mass of the row's
      unscored keys: Certified's budget is then eps (Z_S + U) and U counts
      as dropped (THEORY 6.2).
    coarse: Certified's threshold in one histogram pass
      (``threshold.budget_mask``): for a caller that multiplies every
      scored key's value whatever is kept, the kept set minimal up to one
      coarse bin instead of one fine bin.

  Returns:
    ``[..., n]`` bool, a subset of ``real``.
  """
  n = s.shape[-1]
  n_keys = n if n_keys is None else n_keys
  if isinstance(policy, _policies.Dense):
    return real
  if isinstance(policy, _policies.FixedCount):
    n_real = jnp.sum(real, axis=-1, dtype=jnp.int32)
    return threshold.topk_mask(s, policy.row_num_kept(n_real, n_keys), real)
  if not isinstance(policy, _policies.Certified):
    raise TypeError(f"{policy=} is not a selection policy")
  margin = core.search_log_margin(n_keys, logit_error, s.dtype)
  # A budget relative to the row's mass (Z_S + U): the threshold's first
  # histogram pass gives Z_S, no separate log-sum-exp pass.
  log_frac = jnp.log(jnp.asarray(policy.eps, s.dtype)) - margin
  keep = threshold.budget_mask(
    s,
    log_frac,
    real,
    log_extra,
    relative=True,
    dense_above=policy.dense_above,
    coarse=coarse,
  )
  if policy.max_topk is not None and policy.max_topk < n:
    capped = threshold.topk_mask(s, policy.max_topk, real)
    over = jnp.sum(keep, -1) > policy.max_topk
    keep = jnp.where(over[..., None], capped, keep)
  return keep & real


def select_rows(
  logits, policy, *, valid, norms=None, logit_error=0.0, keys_scored=None
) -> Selection:
  """``select`` on validated arrays (the internal entry point).

  Args:
    logits: ``[..., n]`` float logits (any float dtype; math in float32, or
      float64 for float64 input).
    policy: a selection policy.
    valid: ``[..., n]`` bool real keys.
    norms: optional ``[..., n]`` (broadcastable) ``core.value_norms``.
    logit_error: ``[...]`` or scalar delta of the logits (0 when exact).
    keys_scored: optional ``[...]`` int; default every real key.

  Returns:
    A Selection.
  """
  dt = core.compute_dtype(logits.dtype)
  s = jax.lax.stop_gradient(logits).astype(dt)
  delta = jax.lax.stop_gradient(jnp.asarray(logit_error, dt))
  valid = jnp.broadcast_to(valid, s.shape)
  real = valid & (s > -jnp.inf)  # -inf: a key of zero mass, never kept
  keep = keep_mask(s, policy, real, logit_error=delta)
  if norms is not None:
    norms = jax.lax.stop_gradient(norms)
  cert = core.certificate_from_logits(
    s,
    keep,
    valid,
    logit_error=delta,
    value_norms=norms,
    keys_scored=keys_scored,
  )
  keep = keep & cert.valid[..., None]
  return Selection(keep=keep, k_kept=cert.k_kept, certificate=cert)


def _empty(logits, values) -> Selection:
  """The result for rows with no key (n_keys = 0): invalid, nothing kept."""
  lead = logits.shape[:-1]
  dt = core.compute_dtype(logits.dtype)
  cert = core.finish_certificate(
    jnp.zeros(lead, dt),
    jnp.zeros(lead, bool),
    k_kept=0,
    keys_scored=0,
    head_norm=None if values is None else jnp.zeros(lead, dt),
    tail_norm=None if values is None else jnp.zeros(lead, dt),
  )
  keep = jnp.zeros(logits.shape, bool)
  return Selection(keep=keep, k_kept=cert.k_kept, certificate=cert)


def check_logits(logits, name="logits") -> jax.Array:
  """``logits`` as a real floating array with a key axis, or a clear error."""
  logits = jnp.asarray(logits)
  if logits.ndim == 0:
    raise ValueError(f"{name} must have a key axis; got {logits.shape=}")
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise TypeError(
      f"{name} must be a real floating array; got {name}.dtype={logits.dtype}"
    )
  return logits


def check_mask(mask, shape, name="mask") -> jax.Array:
  """A boolean mask broadcast to ``shape``, or a clear error."""
  mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_:
    raise TypeError(
      f"{name} must be boolean (True = real key); got {name}.dtype="
      f"{mask.dtype} (an additive mask goes in bias=)"
    )
  try:
    return jnp.broadcast_to(mask, shape)
  except ValueError:
    raise ValueError(
      f"{name} shape {mask.shape} does not broadcast to {shape}"
    ) from None


def rng_argument(rng, key, where: str):
  """``rng``, or its deprecated name ``key=`` (warns; removed in 0.3).

  ``key`` names the attention keys everywhere else; a PRNG key is ``rng``.
  """
  if key is None:
    return rng
  if rng is not None:
    raise ValueError(
      f"{where} got rng= and its deprecated name key=: pass rng= only"
    )
  _deprecation.warn(f"{where}(key=...)", "rng= for the PRNG key", stacklevel=3)
  return key


def check_policy(policy, backend: str | None = None, supports=None):
  """``policy`` if it is a selection policy (else TypeError) that
  ``backend`` honours (``policy.require(backend, supports)``, when given).
  """
  if not isinstance(policy, _policies.Policy):
    raise TypeError(
      f"{policy=} is not a selection policy; expected Dense, FixedK, Ratio,"
      " PowerLaw or Certified"
    )
  if backend is not None:
    policy.require(backend, supports)
  return policy


def select(
  logits, policy, *, mask=None, values=None, rng=None, key=None
) -> Selection:
  """Chooses the kept keys of every row and certifies what was dropped.

  THEORY 6.1 (exact certified search by threshold, no sort), 6.5 (every
  call carries a certificate), 8.1 (Top-k). Fixed-count policies keep the
  ``topk`` largest logits (ties at the threshold broken by increasing key
  index); ``Certified(eps)`` keeps the fewest keys whose dropped mass is
  certified <= eps, up to the keys inside one finest histogram bin of
  ``threshold.budget_threshold`` (~4e-5 wide in logit at eps = 0.05; all
  keys tied at the threshold are kept). The certificate's tv_bound is the
  exact tail mass of the kept set, rounded up (never below the float64
  truth); the logits are taken as exact. A -inf logit is a key of zero mass
  (like a masked key): never kept, never counted (``n`` of Ratio / PowerLaw
  counts the others).

  Args:
    logits: ``[..., n_keys]`` logits, any real float dtype.
    policy: ``Dense``, ``FixedK``, ``Ratio``, ``PowerLaw`` or ``Certified``.
      ``Certified`` with a Delta- or MC-Search strategy runs the exact
      search here (every logit is given; see the module docstring).
    mask: optional bool broadcastable to ``logits``, True for a real key.
    values: optional ``[..., n_keys, d_v]``; when given, the certificate
      carries an output-error bound (THEORY 4.2/4.4).
    rng: unused (accepted for a uniform signature with random policies);
      ``key=`` is its deprecated name (warns).

  Returns:
    Selection with ``keep`` ``[..., n_keys]``, ``k_kept`` ``[...]`` and a
    Certificate of shape ``[...]``. A row with no real key, a NaN or +inf
    real logit, or a non-finite real value keeps nothing and has
    ``certificate.valid = False``; so do all rows when ``n_keys = 0``.

  Raises:
    TypeError: if ``policy`` is not a policy, ``logits`` not real floating
      or ``mask`` not boolean.
    ValueError: if ``mask`` or ``values`` does not fit ``logits``.

  Example:
    >>> import jax.numpy as jnp, jaxtopk
    >>> sel = jaxtopk.select(jnp.array([3.0, 0.0, 2.0]), jaxtopk.FixedK(2))
    >>> sel.keep.tolist(), int(sel.k_kept)
    ([True, False, True], 2)
  """
  rng_argument(rng, key, "select")  # unused: no policy here draws
  logits = check_logits(logits)
  check_policy(policy, "select", SUPPORTS)
  if mask is None:
    # The barrier keeps XLA from constant-folding reductions over an
    # all-True mask (seconds of compile time at n = 262,144).
    valid = jax.lax.optimization_barrier(jnp.ones(logits.shape, bool))
  else:
    valid = check_mask(mask, logits.shape)
  if values is not None:
    values = jnp.asarray(values)
    if values.shape[:-1] != logits.shape:
      raise ValueError(
        f"values must be [..., n_keys, d_v] matching {logits.shape=}; got"
        f" {values.shape=}"
      )
    if not jnp.issubdtype(values.dtype, jnp.floating):
      raise TypeError(f"values must be real floating; got {values.dtype=}")
  if logits.shape[-1] == 0:
    return _empty(logits, values)
  return _select_jit(logits, policy, valid, values)


@functools.partial(jax.jit, static_argnames="policy")
def _select_jit(logits, policy, valid, values):
  norms = None if values is None else core.value_norms(values)
  return select_rows(logits, policy, valid=valid, norms=norms)
