"""Shared per-row machinery: shifted log-masses, rounding slack, validation.

Every bound in jaxtopk.theory is a ratio of exponential sums (THEORY 2.4):
tau <= U / (Z_H + U). To keep such ratios accurate and SOUND in float32 even
when logits are huge (a range of 1e4), every sum is computed relative to one
reference logit ``ref`` (the largest real logit of the row): a sum over a set
S is represented by its log relative to ``ref``,

  log_mass(S) = (m_S - ref) + log sum_{i in S} exp(s_i - m_S),

with m_S the set's own maximum (so nothing underflows), and ``ref`` never
added back. The float rounding of such a quantity is at most ``err * eps``
plus the summation error, where ``err`` is reported alongside: a single
rounding of each difference s_i - m_S and m_S - ref. Bounds add that slack
(and ``log_slack`` for the sums) so that they stay above the float64 truth.

Masked entries are excluded with ``where``-style selection; the values put in
their slots are finite (the set's maximum), so gradients stay finite.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Ulps of relative error allowed per level of a summation tree, plus a
# sqrt(n) term for reductions that are not tree-shaped (XLA CPU reduces in
# vectorised sequential chunks).
_ULPS_PER_LEVEL = 4.0


def compute_dtype(dtype) -> jnp.dtype:
  """float32, or float64 when ``dtype`` is float64 (x64 on)."""
  return jnp.promote_types(jnp.dtype(dtype), jnp.float32)


def log_slack(n_terms, dtype) -> jax.Array:
  """Log-space round-up that keeps a float bound above the exact value.

  A reduction of ``n_terms`` nonnegative float terms has relative error at
  most about ``log2(n_terms) + 1`` ulps per level for a tree, ``sqrt(n)``
  ulps typically for a sequential sum; we add ``_ULPS_PER_LEVEL`` ulps per
  level plus ``sqrt(n_terms)`` ulps, plus a few for the final exp/log.
  """
  eps = jnp.finfo(dtype).eps
  n = jnp.maximum(jnp.asarray(n_terms, dtype), 1.0)
  levels = jnp.log2(n) + 4.0
  return ((_ULPS_PER_LEVEL * levels + jnp.sqrt(n)) * eps).astype(dtype)


class LogMass(NamedTuple):
  """log of sum_{i in S} exp(s_i) relative to a reference, with its error.

  Attributes:
    log: log(sum_S exp(s_i - ref)); -inf for an empty set.
    err: the rounding of ``log`` is at most ``err * eps`` (plus the
      summation error of ``log_slack``).
  """

  log: jax.Array
  err: jax.Array


def log_mass(s, where, ref) -> LogMass:
  """Log of sum_{where} exp(s_i), relative to ``ref``, underflow-free.

  Args:
    s: ``[n]`` values in the compute dtype.
    where: ``[n]`` bool, the set S.
    ref: scalar reference (finite), usually the row's largest real logit.

  Returns:
    LogMass. NaN propagates from any NaN or +inf in the set.
  """
  m = jnp.max(s, where=where, initial=-jnp.inf)
  m0 = jax.lax.stop_gradient(jnp.where(m == -jnp.inf, ref, m))
  d = jnp.where(where, s - m0, 0.0)
  w = jnp.where(where, jnp.exp(d), 0.0)
  tot = jnp.sum(w)
  log = (m0 - ref) + jnp.log(tot)
  spread = jnp.sum(w * -d) / jnp.where(tot > 0, tot, 1.0)
  err = jnp.abs(m0 - ref) + jnp.where(jnp.isfinite(spread), spread, 0.0)
  return LogMass(log=log, err=jax.lax.stop_gradient(err))


def row_ref(s, valid):
  """(ref, ok): the largest real logit (0 if not finite) and its finiteness.

  ``ok`` is False for a row with no real key, a NaN or +inf among its real
  logits, or only -inf logits: such a row has no softmax distribution and
  every quantity of the package is NaN there.
  """
  m = jnp.max(s, where=valid, initial=-jnp.inf)
  ok = jnp.isfinite(m)
  ref = jax.lax.stop_gradient(jnp.where(ok, m, 0.0))
  return ref, ok


def finish_log_bound(log_u, log_h, err, n_terms, ok):
  """log of U / (Z_H + U), rounded up; NaN where not ``ok``.

  Args:
    log_u: log of an upper bound U on the tail mass (relative to ref).
    log_h: log of a lower bound on the head mass Z_H (relative to ref).
    err: accumulated rounding coefficient of ``log_u`` and ``log_h``.
    n_terms: number of summed terms (for ``log_slack``).
    ok: bool, whether the row has a distribution.

  Returns:
    log bound in [-inf, 0]: 0 when nothing is kept (tau <= 1), -inf when U is
    zero (nothing real outside H).
  """
  dt = log_u.dtype
  eps = jnp.finfo(dt).eps
  x = log_h - log_u
  b = -jax.nn.softplus(x)
  fin = jnp.isfinite(x)
  slack = log_slack(n_terms, dt) + 2 * eps * (
    err + jnp.where(fin, jnp.abs(x), 0.0) + 2.0
  )
  b = jnp.where(log_u == -jnp.inf, -jnp.inf, b + slack)
  b = jnp.minimum(b, 0.0)
  return jnp.where(ok, b, jnp.nan)


def exp_up(log_b):
  """exp of a log upper bound, never rounded below the value it bounds.

  XLA on CPU flushes subnormal results to zero, so exp(-88.5) in float32 is
  0 although the bounded quantity (say e^-88.6 = 3e-39 in float64) is not.
  Below the smallest normal number this returns that number (still an upper
  bound); a bound of exactly -inf gives 0.
  """
  tiny = jnp.finfo(log_b.dtype).tiny
  small = log_b < jnp.log(tiny)
  out = jnp.exp(jnp.where(small, 0.0, log_b))
  out = jnp.where(small, tiny, out)
  return jnp.where(log_b == -jnp.inf, 0.0, out)


def up_positive(x, positive):
  """``x`` raised to the smallest normal number where it must be positive.

  For products of bounds whose exact value is positive but whose float
  value may have been flushed to zero or be subnormal.
  """
  tiny = jnp.finfo(x.dtype).tiny
  return jnp.where(positive & (x < tiny), tiny, x)


def sorted_desc(s, valid):
  """Real logits sorted in decreasing order; padded slots at the end.

  Returns:
    (srt, n_valid): ``[n]`` sorted values (slots at rank >= n_valid hold the
    smallest real logit, or 0, and must be excluded by the caller) and the
    int32 number of real keys.
  """
  n_valid = jnp.sum(valid, dtype=jnp.int32)
  srt = -jnp.sort(jnp.where(valid, -s, jnp.inf))
  rank = jnp.arange(s.shape[-1])
  last = srt[jnp.maximum(n_valid - 1, 0)]
  fill = jnp.where(jnp.isfinite(last), last, 0.0)
  srt = jnp.where(rank < n_valid, srt, fill)
  return srt, n_valid


def as_mask(logits, mask):
  """Bool mask broadcast to the logits' shape (all True when None)."""
  if mask is None:
    return jnp.ones(jnp.shape(logits), bool)
  return jnp.broadcast_to(jnp.asarray(mask, bool), jnp.shape(logits))


def check_same_shape(ref, ref_name="logits", **arrays) -> None:
  """Raises ValueError naming the first array whose shape differs."""
  for name, a in arrays.items():
    if a is not None and jnp.shape(a) != jnp.shape(ref):
      raise ValueError(
        f"{name} has shape {jnp.shape(a)} but {ref_name} has shape"
        f" {jnp.shape(ref)}; they must match."
      )


def check_has_key_axis(logits) -> None:
  if jnp.ndim(logits) == 0:
    raise ValueError(
      f"logits must have a key axis; got shape {jnp.shape(logits)}"
    )


def concrete(x):
  """``x`` as a numpy array when it is not a tracer, else None."""
  try:
    return np.asarray(x)
  except (
    jax.errors.TracerArrayConversionError,
    jax.errors.ConcretizationTypeError,
  ):
    return None


def check_topk(topk, n: int, scalar: bool = True) -> None:
  """Raises ValueError unless 1 <= topk <= n (checked when concrete).

  With ``scalar=False`` an integer array (one topk per row) is allowed.
  """
  t = concrete(topk)
  if t is None:
    return
  if (scalar and t.ndim != 0) or not np.issubdtype(t.dtype, np.integer):
    kind = "a scalar integer" if scalar else "integer"
    raise ValueError(f"{topk=} must be {kind}")
  if not np.all((t >= 1) & (t <= n)):
    raise ValueError(f"{topk=} must be in [1, n_keys={n}]")


def check_eps(eps, name="eps") -> None:
  """Raises ValueError unless every eps is in (0, 1) (when concrete)."""
  e = concrete(eps)
  if e is None:
    return
  if not np.all((e > 0) & (e < 1)):
    raise ValueError(f"{name}={eps!r} must be in (0, 1)")


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def apply_rows(row_fn, in_axes, kwargs, *args):
  """jit(vmap^k(row_fn)) over the leading axes of ``args[0]``.

  Public wrappers validate their arguments in Python, then call this, so an
  eager call compiles once per shape instead of dispatching every op.

  Args:
    row_fn: a module-level per-row function (static, hashed by identity).
    in_axes: static per-argument in_axes for every vmap level (0 or None).
    kwargs: static tuple of (name, value) keyword arguments for ``row_fn``.
    *args: the row arguments; ``args[0]`` is ``[..., n_keys]``.
  """
  fn = functools.partial(row_fn, **dict(kwargs))
  return vmap_rows(fn, args[0].ndim - 1, in_axes)(*args)


def vmap_rows(row_fn, n_lead: int, in_axes):
  """vmaps ``row_fn`` ``n_lead`` times with the given ``in_axes``."""
  fn = row_fn
  for _ in range(n_lead):
    fn = jax.vmap(fn, in_axes=in_axes)
  return fn
