"""Global selection over a key axis split across devices (THEORY 6.1).

Each shard holds a slice of every row's logits. These functions choose the
SAME kept set a single device would choose over the whole row, exchanging
only small per-row statistics (never the logits themselves):

- ``global_topk_keep``: the ``topk`` largest logits of the whole row. The
  shards agree on the global ``topk``-th largest value t in one of two ways:
  'candidates', every shard proposes its local ``min(topk, n_local)``
  largest logits and one all-gather gives every shard the union (the global
  top-k is a subset of it): ``devices * min(topk, n_local)`` logits per row;
  or 'radix', ``selection.threshold.topk_threshold`` (the single-device
  mechanism) with its psum: a radix select over the order-preserving bits of
  the logits, 8 bits per round, each round one psum of a 256-bin count
  histogram: 4 rounds (float32) of 256 counts per row whatever topk, n and
  the device count. 'auto' picks the one moving
  fewer bytes. Keys above t are kept; of the keys equal to t, the lowest
  global indices are kept until ``topk`` are (an all-gather of per-shard tie
  counts gives each shard its prefix), which is ``lax.top_k``'s and
  ``selection.topk_mask``'s tie rule, so the kept set equals the
  single-device one exactly.
- ``global_certified_keep``: the certified set of a GLOBAL budget eps (not
  eps per shard): keep the largest logits down to a threshold whose tail
  below it holds at most ``eps`` of the global softmax mass. A threshold,
  unlike a per-shard count, means the same thing on every shard, so it can
  be found from psums of fixed-size histograms of exp-mass over logit bins
  measured from the global max M: ``selection.threshold.budget_threshold``
  (the single-device mechanism) with its psum, a coarse pass over
  ``[0, log(n / eps) + 2]`` of gap ``M - s``, then passes inside the
  boundary bin: ``levels * num_bins`` floats per row, independent of n and
  of the device count. The tail mass is a suffix sum of the merged histogram, so
  the threshold satisfies the budget up to float rounding, which a margin in
  the budget absorbs.

Why the certificate stays sound: the threshold only DECIDES the kept set.
The certificate is computed afterwards from that kept set alone (the exact
global head and tail masses, merged in log space, see ``_kv_sharded.py``),
so an imperfect threshold can only make the set larger than minimal or the
bound larger than eps (and then the certificate says so); it can never make
the bound smaller than the true dropped mass. Minimality is a quality
figure (THEORY 6.1): the kept set exceeds the minimal one by at most the
keys inside one finest bin (width about ``(log(n / eps) + 2) /
num_bins**levels`` in logit).

All functions work per row over the last axis and take ``axis_name``: the
mapped axis (shard_map or vmap) the key axis is split over, or None for a
single shard. Shards are ordered by ``lax.axis_index``: shard i holds keys
``[i * n_local, (i + 1) * n_local)``.
"""

import jax
import jax.numpy as jnp
from jax import lax

from jaxtopk.selection import threshold

NUM_BINS = threshold.NUM_BINS
_DIGIT_BITS = 8
_RADIX = 1 << _DIGIT_BITS


def psum(x, axis_name):
  """``lax.psum`` over ``axis_name``, or ``x`` itself when it is None."""
  return x if axis_name is None else lax.psum(x, axis_name)


def pmax(x, axis_name):
  """``lax.pmax`` over ``axis_name``, or ``x`` itself when it is None."""
  return x if axis_name is None else lax.pmax(x, axis_name)


def gather_last(x, axis_name):
  """``[..., m]`` -> ``[..., devices * m]``: the shards' ``x`` in order."""
  if axis_name is None:
    return x
  return lax.all_gather(x, axis_name, axis=x.ndim - 1, tiled=True)


def _shard_prefix(count, axis_name):
  """Sum of ``count`` over the shards before this one (exclusive prefix)."""
  if axis_name is None:
    return jnp.zeros_like(count)
  every = lax.all_gather(count, axis_name, axis=count.ndim)  # [..., D]
  idx = lax.axis_index(axis_name)
  before = jnp.arange(every.shape[-1]) < idx
  return jnp.sum(jnp.where(before, every, 0), axis=-1).astype(count.dtype)


def _kth_largest_candidates(s, valid, topk, row_topk, axis_name):
  """Threshold from an all-gather of every shard's local top candidates."""
  n_local = s.shape[-1]
  cand = jnp.where(valid, s, -jnp.inf)  # selection only; math never sees it
  local = lax.top_k(cand, min(topk, n_local))[0]  # [..., c]
  every = gather_last(local, axis_name)  # [..., D * c]
  if every.shape[-1] < topk:
    raise ValueError(
      f"{topk=} exceeds the {every.shape[-1]} keys of the whole row"
    )
  best = lax.top_k(every, topk)[0]  # [..., topk], descending
  idx = jnp.clip(row_topk - 1, 0, topk - 1)[..., None]
  thr = jnp.take_along_axis(best, idx, axis=-1)  # [..., 1]
  return thr[..., 0]


def global_topk_keep(
  logits, valid, *, topk: int, axis_name, row_topk=None, method="auto"
) -> jax.Array:
  """The global ``topk`` largest real logits of each row, as a local mask.

  Args:
    logits: ``[..., n_local]`` this shard's logits (float32 or float64).
    valid: ``[..., n_local]`` bool, True for a real key.
    topk: static number of kept keys over the whole row (the maximum over
      rows when ``row_topk`` is given), <= the global number of keys; rows
      with fewer real keys keep all of them.
    axis_name: mapped axis the keys are split over, or None.
    row_topk: optional ``[...]`` int per-row count, 0 <= row_topk <= topk
      (e.g. ``Ratio`` over each row's real keys).
    method: how the shards agree on the threshold: 'candidates' (one
      all-gather of ``devices * min(topk, n_local)`` logits per row),
      'radix' (4 psums of 256 counts per row, float32; independent of topk
      and n), or 'auto' (the one moving fewer bytes).

  Returns:
    ``[..., n_local]`` bool kept set (a subset of ``valid``). Ties at the
    threshold go to the lowest global index, as in ``lax.top_k``.
  """
  n_local = logits.shape[-1]
  if topk < 1:
    raise ValueError(f"{topk=} must be >= 1")
  if method not in ("auto", "candidates", "radix"):
    raise ValueError(f"{method=} must be 'auto', 'candidates' or 'radix'")
  s = lax.stop_gradient(logits)
  if row_topk is None:
    row_topk = jnp.full(s.shape[:-1], topk, jnp.int32)
  row_topk = jnp.asarray(row_topk, jnp.int32)
  n_shards = 1 if axis_name is None else lax.axis_size(axis_name)
  if method == "auto":
    nbits = jnp.finfo(s.dtype).bits
    radix_words = 2 * (nbits // _DIGIT_BITS) * _RADIX  # all-reduce: 2x
    cand_words = n_shards * min(topk, n_local)
    method = "radix" if cand_words > radix_words else "candidates"
  if method == "radix":
    thr, _ = threshold.topk_threshold(
      s, row_topk, valid, axis_name=axis_name, digit_bits=_DIGIT_BITS
    )
  else:
    thr = _kth_largest_candidates(s, valid, topk, row_topk, axis_name)
  thr = thr[..., None]
  above = valid & (s > thr)
  ties = valid & (s == thr)
  n_above = psum(jnp.sum(above, axis=-1, dtype=jnp.int32), axis_name)
  n_ties_local = jnp.sum(ties, axis=-1, dtype=jnp.int32)
  need = row_topk - n_above - _shard_prefix(n_ties_local, axis_name)  # [...]
  rank = jnp.cumsum(ties, axis=-1, dtype=jnp.int32) - 1
  keep = above | (ties & (rank < need[..., None]))
  return keep & (row_topk > 0)[..., None]


def global_certified_keep(
  logits,
  valid,
  row_max,
  log_budget,
  *,
  n_total: int,
  axis_name,
  num_bins: int = NUM_BINS,
  levels: int = threshold.LEVELS,
) -> jax.Array:
  """Keeps the largest logits until the global dropped mass is <= budget.

  THEORY 6.1 with a histogram of exp-mass; see the module docstring.

  Args:
    logits: ``[..., n_local]`` this shard's logits.
    valid: ``[..., n_local]`` bool, True for a real key.
    row_max: ``[...]`` the GLOBAL max real logit of each row (a pmax).
    log_budget: ``[...]`` or scalar, log of the allowed dropped fraction of
      the global softmax mass (< 0).
    n_total: static number of keys over all shards.
    axis_name: mapped axis the keys are split over, or None.
    num_bins: bins per histogram pass.
    levels: histogram passes (coarse, then refinements).

  Returns:
    ``[..., n_local]`` bool kept set, an upper set of the row's logits (every
    kept logit is >= every dropped one), a subset of ``valid``.
  """
  s = lax.stop_gradient(logits)
  t = threshold.budget_threshold(
    s,
    log_budget,
    valid,
    relative=True,
    axis_name=axis_name,
    row_max=row_max,
    n_total=n_total,
    num_bins=num_bins,
    levels=levels,
  )
  return valid & (s >= t[..., None])
