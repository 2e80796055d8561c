"""Tail mass of a truncated softmax row: TV = tau, KL = -log(1 - tau).

THEORY.md sections 1 and 2. Everything is written for ONE attention row and
vmapped over any leading axes by the public wrappers at the bottom.

Conventions shared by the whole package:
- ``logits`` is ``[..., n_keys]``; the math runs in float32, or float64 when
  the input is float64 (x64 on).
- ``keep`` is a boolean ``[..., n_keys]`` kept set H.
- ``mask`` (optional) is a boolean ``[..., n_keys]``, True for a real key and
  False for a padded one (the jax.nn convention). Masked keys are removed from
  the row: never kept, never tail. They are handled with ``where=`` reductions,
  never by writing -inf into the logits.
- A row with no real key has no distribution: its tail mass is NaN.
"""

import jax
import jax.numpy as jnp
from jax.scipy.special import logsumexp

# Rounding slack for bounds: a float32 log-sum-exp over n terms may be off by a
# few ulps per level of the reduction tree. Bounds add this much (in log space)
# so that they stay above the float64 truth (THEORY 3.4).
_ULPS_PER_LEVEL = 4.0


def compute_dtype(dtype) -> jnp.dtype:
  """float32, or float64 when ``dtype`` is float64 (x64 on)."""
  return jnp.promote_types(jnp.dtype(dtype), jnp.float32)


def _valid(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
  if mask is None:
    return jnp.ones(logits.shape, bool)
  return jnp.asarray(mask, bool)


def check_same_shape(logits, **arrays) -> None:
  """Raises ValueError naming the first array whose shape differs."""
  for name, a in arrays.items():
    if a is not None and jnp.shape(a) != jnp.shape(logits):
      raise ValueError(
        f"{name} has shape {jnp.shape(a)} but logits has shape"
        f" {jnp.shape(logits)}; they must match."
      )


def log_slack(n_terms, dtype) -> jax.Array:
  """Log-space round-up that keeps a float bound above the exact value.

  A tree reduction of ``n_terms`` float terms has relative error at most about
  ``log2(n_terms) + 1`` ulps per level; we add ``_ULPS_PER_LEVEL`` ulps per
  level, plus a few for the final exp/log.
  """
  eps = jnp.finfo(dtype).eps
  levels = jnp.log2(jnp.maximum(jnp.asarray(n_terms, dtype), 1.0)) + 4.0
  return (_ULPS_PER_LEVEL * levels * eps).astype(dtype)


def _log_masses_row(logits, keep, mask):
  """(lse over real keys, lse over kept real keys, lse over tail real keys)."""
  s = logits.astype(compute_dtype(logits.dtype))
  valid = _valid(s, mask)
  keep = jnp.asarray(keep, bool)
  lse_all = logsumexp(s, where=valid)
  lse_head = logsumexp(s, where=valid & keep)
  lse_tail = logsumexp(s, where=valid & ~keep)
  return lse_all, lse_head, lse_tail


def log_tail_mass_row(logits, keep, mask=None) -> jax.Array:
  """log tau for one row: log tau = lse(s_T) - lse(s) (THEORY 2.5).

  Args:
    logits: ``[n_keys]`` logits of one query row.
    keep: ``[n_keys]`` bool, the kept set H.
    mask: optional ``[n_keys]`` bool, False for padded keys.

  Returns:
    Scalar log tau: -inf when the tail holds no real key, NaN when the row
    has no real key.
  """
  lse_all, _, lse_tail = _log_masses_row(logits, keep, mask)
  return lse_tail - lse_all


def tail_mass_row(logits, keep, mask=None) -> jax.Array:
  """tau = Z_T / Z for one row; equals TV(P, P_hat) (THEORY 2.1)."""
  return jnp.exp(log_tail_mass_row(logits, keep, mask))


def kl_truncated_row(logits, keep, mask=None) -> jax.Array:
  """KL(P_hat || P) = -log(1 - tau) = lse(s) - lse(s_H) (THEORY 2.2).

  Computed from the head mass directly, so it stays exact when tau is close
  to 1 (no 1 - tau by subtraction). +inf when nothing real is kept.
  """
  lse_all, lse_head, _ = _log_masses_row(logits, keep, mask)
  return lse_all - lse_head


def _batched(row_fn, n_row_args):
  """vmaps a per-row function over all leading axes of its first argument."""

  def wrapper(logits, *args):
    logits = jnp.asarray(logits)
    if logits.ndim == 0:
      raise ValueError(f"logits must have a key axis; got {logits.shape=}")
    fn = row_fn
    for _ in range(logits.ndim - 1):
      fn = jax.vmap(fn, in_axes=(0,) * n_row_args)
    return fn(logits, *args)

  return wrapper


def log_tail_mass(logits, keep, mask=None) -> jax.Array:
  """log tau over any leading axes (THEORY 2.5).

  Args:
    logits: ``[..., n_keys]`` logits.
    keep: ``[..., n_keys]`` bool kept set.
    mask: optional ``[..., n_keys]`` bool, False for padded keys.

  Returns:
    ``[...]`` log tau in float32 (float64 for float64 input).

  Raises:
    ValueError: if ``keep`` or ``mask`` does not match ``logits``' shape.

  Example:
    >>> import jax.numpy as jnp
    >>> s = jnp.array([2.0, 1.0, 0.0])
    >>> float(jnp.exp(log_tail_mass(s, jnp.array([True, True, False]))))
    ... # doctest: +ELLIPSIS
    0.090...
  """
  logits = jnp.asarray(logits)
  check_same_shape(logits, keep=keep, mask=mask)
  keep = jnp.asarray(keep, bool)
  valid = _valid(logits, mask)
  return _batched(log_tail_mass_row, 3)(logits, keep, valid)


def tail_mass(logits, keep, mask=None) -> jax.Array:
  """tau = dropped softmax mass = TV(P, P_hat), over any leading axes.

  THEORY 2.1 ([TV]): for the truncated distribution P_hat (P renormalised on
  the kept set), TV(P, P_hat) is exactly the discarded mass tau.

  Args:
    logits: ``[..., n_keys]`` logits.
    keep: ``[..., n_keys]`` bool kept set.
    mask: optional ``[..., n_keys]`` bool, False for padded keys.

  Returns:
    ``[...]`` tau in float32 (float64 for float64 input); NaN for a row with
    no real key.
  """
  return jnp.exp(log_tail_mass(logits, keep, mask))


def kl_truncated(logits, keep, mask=None) -> jax.Array:
  """KL(P_hat || P) = -log(1 - tau) over any leading axes (THEORY 2.2).

  TV = 1 - exp(-KL). Stable for tau near 1: computed as lse(s) - lse(s_H).
  (KL(P || P_hat) is +inf whenever the tail holds mass.)

  Returns:
    ``[...]`` KL in float32 (float64 for float64 input).
  """
  logits = jnp.asarray(logits)
  check_same_shape(logits, keep=keep, mask=mask)
  keep = jnp.asarray(keep, bool)
  valid = _valid(logits, mask)
  return _batched(kl_truncated_row, 3)(logits, keep, valid)
