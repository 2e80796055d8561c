"""``select``: apply a policy to logits, return kept keys and a Certificate.

THEORY 6.1 and 6.5. Every policy reports its certificate (a FixedK user
learns what FixedK cost). Policies are dispatched through ``_SELECTORS``, a
table from policy type to a function, so a new policy joins by adding one
entry. Delta- and MC-Search need the queries and keys (they score only part
of the row): use ``certified_search`` for those; ``select`` with them on
given logits falls back to 'exact' search over the (already computed) logits
and says so in ``keys_scored`` (= every real key).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.scipy.special import logsumexp

from jaxtopk.selection import _certify
from jaxtopk.selection import _policies
from jaxtopk.selection import _threshold
from jaxtopk.selection._certificate import Certificate
from jaxtopk.theory import _tail


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Selection:
  """Kept keys of each row and what dropping the others cost.

  Attributes:
    keep: ``[..., n_keys]`` bool, True for a kept (attended) key; never True
      for a masked key; all False on an invalid row.
    k_kept: ``[...]`` int32 number of kept keys.
    certificate: Certificate with arrays shaped ``[...]``.
  """

  keep: jax.Array
  k_kept: jax.Array
  certificate: Certificate


def count_kept(policy, n_valid, n_static) -> jax.Array:
  """Per-row kept count of a fixed-count policy for rows of ``n_valid`` keys.

  Uses the policy's own ``num_kept`` when every row has all ``n_static``
  keys (no mask), so counts match ``policy.num_kept(n)`` exactly; otherwise
  evaluates the same formula in floats with a relative guard of 1e-6.
  """
  if isinstance(policy, _policies.Dense):
    return n_valid
  if isinstance(policy, _policies.FixedK):
    return jnp.minimum(n_valid, policy.topk)
  static = policy.num_kept(n_static)
  nf = n_valid.astype(jnp.float32)
  if isinstance(policy, _policies.Ratio):
    k = jnp.ceil(policy.rho * nf * (1 - 1e-6))
  elif isinstance(policy, _policies.PowerLaw):
    k = jnp.ceil(policy.alpha * nf**policy.c * (1 - 1e-6))
  else:
    raise TypeError(f"{policy=} has no fixed count")
  k = jnp.clip(k.astype(jnp.int32), jnp.minimum(n_valid, 1), n_valid)
  return jnp.where(n_valid == n_static, static, k)


def certified_log_budget(eps, logits, valid, log_extra_slack):
  """log of the dropped mass allowed so that the rounded-up bound <= eps.

  The certificate adds ``log_slack`` and ``log_extra_slack`` to log tau; the
  search therefore aims below eps by those amounts plus an equal margin for
  the rounding of the search's own sums.
  """
  dt = logits.dtype
  lse = logsumexp(logits, axis=-1, where=valid)
  margin = 3 * _tail.log_slack(logits.shape[-1], dt) + 2 * log_extra_slack
  margin = margin + 2 * _certify.magnitude_slack(logits, valid)
  return jnp.log(jnp.asarray(eps, dt)) + lse - margin


def _select_fixed(policy, s, valid, log_extra_slack):
  n_valid = jnp.sum(valid, axis=-1, dtype=jnp.int32)
  topk = count_kept(policy, n_valid, s.shape[-1])
  if isinstance(policy, _policies.Dense):
    return valid
  return _threshold.topk_mask(s, topk, valid)


def _select_certified(policy, s, valid, log_extra_slack):
  log_budget = certified_log_budget(policy.eps, s, valid, log_extra_slack)
  keep = _threshold.budget_mask(s, log_budget, valid)
  if policy.max_topk is not None:
    capped = _threshold.topk_mask(s, policy.max_topk, valid)
    over = jnp.sum(keep, -1) > policy.max_topk
    keep = jnp.where(over[..., None], capped, keep)
  return keep


_SELECTORS = {
  _policies.Dense: _select_fixed,
  _policies.FixedK: _select_fixed,
  _policies.Ratio: _select_fixed,
  _policies.PowerLaw: _select_fixed,
  _policies.Certified: _select_certified,
}


def _check_policy(policy):
  if type(policy) not in _SELECTORS:
    raise TypeError(
      f"{policy=} is not a selection policy; expected one of"
      f" {[t.__name__ for t in _SELECTORS]}"
    )


def select_with_slack(
  logits, policy, *, valid, norms=None, log_extra_slack=0.0
) -> Selection:
  """``select`` on validated arrays, with extra log slack for computed logits.

  Args:
    logits: ``[..., n]`` float logits (any float dtype; math in float32, or
      float64 for float64 input).
    policy: a selection policy.
    valid: ``[..., n]`` bool.
    norms: optional ``[..., n]`` (broadcastable) value norms, for the
      output-error bound.
    log_extra_slack: ``[...]`` or scalar, added to the certificate's log tau
      (2 x the logit rounding bound when logits came from q and k).

  Returns:
    A Selection.
  """
  _check_policy(policy)
  s = jax.lax.stop_gradient(logits).astype(_tail.compute_dtype(logits.dtype))
  log_extra_slack = jax.lax.stop_gradient(jnp.asarray(log_extra_slack, s.dtype))
  keep = _SELECTORS[type(policy)](policy, s, valid, log_extra_slack)
  ok = _certify.row_validity(s, valid)
  keep = keep & valid & ok[..., None]
  cert = _certify.make_certificate(
    s,
    keep,
    valid,
    norms=None if norms is None else jax.lax.stop_gradient(norms),
    log_extra_slack=log_extra_slack,
  )
  return Selection(keep=keep, k_kept=cert.k_kept, certificate=cert)


def select(logits, policy, *, mask=None, values=None, key=None) -> Selection:
  """Chooses the kept keys of every row and certifies what was dropped.

  THEORY 6.1 (exact certified search by threshold, no sort), 6.5 (every
  call carries a certificate), 8.1 (Top-k). Fixed-count policies keep the
  ``topk`` largest logits (ties at the threshold broken by increasing key
  index); ``Certified(eps)`` keeps the fewest keys whose dropped mass is
  certified <= eps (all keys tied at the threshold are kept, so the set is
  minimal up to ties). The certificate's tv_bound is the exact tail mass of
  the kept set, rounded up (never below the float64 truth).

  Args:
    logits: ``[..., n_keys]`` logits, any float dtype.
    policy: ``Dense``, ``FixedK``, ``Ratio``, ``PowerLaw`` or ``Certified``.
      ``Certified(search='delta'|'mc')`` needs queries and keys to save
      work; given logits it runs the 'exact' search on them.
    mask: optional bool broadcastable to ``logits``, True for a real key.
    values: optional ``[..., n_keys, d_v]``; when given, the certificate
      carries an output-error bound (THEORY 4.2/4.4).
    key: unused (accepted for a uniform signature with random policies).

  Returns:
    Selection with ``keep`` ``[..., n_keys]``, ``k_kept`` ``[...]`` and a
    Certificate of shape ``[...]``. A row with no real key (or non-finite
    logits) keeps nothing and has ``certificate.valid = False``.

  Raises:
    TypeError: if ``policy`` is not a policy.
    ValueError: if ``mask`` or ``values`` does not fit ``logits``.

  Example:
    >>> import jax.numpy as jnp, jaxtopk
    >>> sel = jaxtopk.select(jnp.array([3.0, 0.0, 2.0]), jaxtopk.FixedK(2))
    >>> sel.keep.tolist(), int(sel.k_kept)
    ([True, False, True], 2)
  """
  del key
  logits = jnp.asarray(logits)
  if logits.ndim == 0:
    raise ValueError(f"logits must have a key axis; got {logits.shape=}")
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise ValueError(f"logits must be floating; got {logits.dtype=}")
  _check_policy(policy)
  if mask is None:
    # The barrier keeps XLA from constant-folding reductions over an
    # all-True mask (seconds of compile time at n = 262,144).
    valid = jax.lax.optimization_barrier(jnp.ones(logits.shape, bool))
  else:
    mask = jnp.asarray(mask, bool)
    try:
      valid = jnp.broadcast_to(mask, logits.shape)
    except ValueError:
      raise ValueError(
        f"mask shape {mask.shape} does not broadcast to {logits.shape=}"
      ) from None
  if values is not None:
    values = jnp.asarray(values)
    if values.shape[:-1] != logits.shape:
      raise ValueError(
        f"values must be [..., n_keys, d_v] matching {logits.shape=}; got"
        f" {values.shape=}"
      )
  return _select_jit(logits, policy, valid, values)


@functools.partial(jax.jit, static_argnames="policy")
def _select_jit(logits, policy, valid, values):
  norms = None if values is None else _certify.value_norms(values)
  return select_with_slack(logits, policy, valid=valid, norms=norms)
