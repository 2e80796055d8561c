"""Sort-free threshold search: radix select over order-preserving float bits.

THEORY 6.1. A full sort of a long row is slow on every backend; selecting
the ``topk`` largest logits, or the smallest set whose dropped mass is at most
a budget, only needs ONE threshold. Both are found here by radix select:
floats are mapped to unsigned integers with the same order, and the threshold
is built bit by bit from the most significant one, each bit costing one fused
O(n) pass (a count or a masked sum). 32 passes for float32 (64 for float64),
no sort, no top_k, no scatter; everything is a where= reduction, so masked
keys never enter.

Every function here works on ``[..., n_keys]`` arrays with per-row arguments
``[...]``; it is already batched (no vmap needed).

Tie-breaking (documented contract):
- ``topk_mask`` keeps exactly ``topk`` keys: all keys strictly above the
  threshold, then tied keys AT the threshold in increasing key index.
- ``budget_mask`` keeps every key at or above its threshold, so ties at the
  threshold are all kept (the kept set is minimal up to those ties).
"""

import jax
import jax.numpy as jnp
from jax import lax


def sortable_bits(x: jax.Array) -> jax.Array:
  """Maps floats to unsigned ints with the same total order.

  float32 -> uint32, float64 -> uint64. -0.0 sorts just below +0.0 (both are
  equal as floats, so either order is a valid tie-break). NaNs sort at the
  ends; callers mark rows holding NaN invalid.

  Args:
    x: float32 or float64 array.

  Returns:
    Unsigned integer array of the same shape, ``a < b`` iff ``x_a < x_b``.
  """
  if x.dtype == jnp.float64:
    ut, sign = jnp.uint64, jnp.uint64(1 << 63)
  elif x.dtype == jnp.float32:
    ut, sign = jnp.uint32, jnp.uint32(1 << 31)
  else:
    raise ValueError(f"sortable_bits needs float32 or float64; got {x.dtype=}")
  u = lax.bitcast_convert_type(x, ut)
  return jnp.where((u & sign) != 0, ~u, u | sign)


def _nbits(bits):
  return jnp.iinfo(bits.dtype).bits


def kth_largest_bits(bits, topk, valid) -> jax.Array:
  """Radix select: the ``topk``-th largest of ``bits`` over ``valid`` entries.

  Args:
    bits: ``[..., n]`` unsigned keys from ``sortable_bits``.
    topk: ``[...]`` int, 1 <= topk <= number of valid entries of the row
      (rows violating it get an arbitrary threshold).
    valid: ``[..., n]`` bool.

  Returns:
    ``[...]`` the largest T with #{valid, bits >= T} >= topk (exactly the
    topk-th largest key). One count pass per bit.
  """
  ut = bits.dtype
  topk = jnp.asarray(topk, jnp.int32)
  nbits = _nbits(bits)

  def body(i, t):
    cand = t | (jnp.asarray(1, ut) << (nbits - 1 - i).astype(ut))
    cnt = jnp.sum(valid & (bits >= cand[..., None]), axis=-1, dtype=jnp.int32)
    return jnp.where(cnt >= topk, cand, t)

  t0 = jnp.zeros(bits.shape[:-1], ut)
  return lax.fori_loop(0, nbits, body, t0)


def _tie_rank(tie):
  """1-based rank of each tied entry along the key axis."""
  return jnp.cumsum(tie.astype(jnp.int32), axis=-1)


def topk_mask(logits, topk, valid) -> jax.Array:
  """Boolean mask of the ``topk`` largest valid logits of each row, no sort.

  Ties at the threshold are broken by increasing key index. Rows with fewer
  valid keys than ``topk`` keep all their valid keys.

  Args:
    logits: ``[..., n]`` float32/float64.
    topk: ``[...]`` int (or scalar) number of keys to keep, >= 0.
    valid: ``[..., n]`` bool, False for masked keys.

  Returns:
    ``[..., n]`` bool keep mask with min(topk, n_valid) True entries per row.
  """
  bits = sortable_bits(logits)
  n_valid = jnp.sum(valid, axis=-1, dtype=jnp.int32)
  topk = jnp.minimum(jnp.broadcast_to(topk, n_valid.shape), n_valid)
  t = kth_largest_bits(bits, jnp.maximum(topk, 1), valid)[..., None]
  above = valid & (bits > t)
  tie = valid & (bits == t)
  need = topk - jnp.sum(above, axis=-1, dtype=jnp.int32)  # >= 1 if topk >= 1
  n_tie = jnp.sum(tie, axis=-1, dtype=jnp.int32)
  # The cumulative sum is only needed when some row has surplus ties.
  keep_ties = lax.cond(
    jnp.any(n_tie > need),
    lambda: tie & (_tie_rank(tie) <= need[..., None]),
    lambda: tie,
  )
  return (above | keep_ties) & (topk > 0)[..., None]


def budget_mask(logits, log_budget, valid, log_extra=None) -> jax.Array:
  """Smallest kept set (up to ties) whose dropped mass fits a budget.

  THEORY 6.1: keeps the keys with logits at or above the LARGEST threshold t
  such that  sum_{valid, s_i < t} e^{s_i} + extra <= e^{log_budget},
  i.e. top-p with p = 1 - budget / Z. The budget is in the same log units as
  the logits (pass log(eps) + lse(s) for a relative budget eps). Found by
  radix select with one masked-sum pass per bit, no sort.

  Args:
    logits: ``[..., n]`` float32/float64.
    log_budget: ``[...]`` log of the allowed dropped mass.
    valid: ``[..., n]`` bool.
    log_extra: optional ``[...]`` log of mass that is dropped regardless
      (e.g. unscored blocks in Delta-Search); -inf when None.

  Returns:
    ``[..., n]`` bool keep mask. A row keeps at least its largest valid key
    whenever the budget is below the row's total mass; if even keeping every
    key exceeds the budget (extra too large), every valid key is kept.
  """
  bits = sortable_bits(logits)
  dt = logits.dtype
  m = jnp.max(jnp.where(valid, logits, -jnp.inf), axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.where(valid, jnp.exp(logits - m), 0.0)  # [..., n], <= 1
  budget = jnp.exp(jnp.asarray(log_budget, dt) - m[..., 0])
  if log_extra is not None:
    budget = budget - jnp.exp(jnp.asarray(log_extra, dt) - m[..., 0])
  ut = bits.dtype
  nbits = _nbits(bits)

  def body(i, t):
    cand = t | (jnp.asarray(1, ut) << (nbits - 1 - i).astype(ut))
    tail = jnp.sum(jnp.where(bits < cand[..., None], e, 0.0), axis=-1)
    return jnp.where(tail <= budget, cand, t)

  t = lax.fori_loop(0, nbits, body, jnp.zeros(bits.shape[:-1], ut))
  return valid & (bits >= t[..., None])
