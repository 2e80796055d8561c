"""Global selection over a key axis split across devices (THEORY 6.1).

Each shard holds a slice of every row's logits. These functions choose the
SAME kept set a single device would choose over the whole row, exchanging
only small per-row statistics (never the logits themselves):

- ``global_topk_keep``: the ``topk`` largest logits of the whole row. The
  shards agree on the global ``topk``-th largest value t in one of two ways:
  'candidates', every shard proposes its local ``min(topk, n_local)``
  largest logits and one all-gather gives every shard the union (the global
  top-k is a subset of it): ``devices * min(topk, n_local)`` logits per row;
  or 'radix', a radix select over the order-preserving bits of the logits
  (``selection._threshold.sortable_bits``), 8 bits per round, each round one
  psum of a 256-bin count histogram: 4 rounds (float32) of 256 counts per
  row whatever topk, n and the device count. 'auto' picks the one moving
  fewer bytes. Keys above t are kept; of the keys equal to t, the lowest
  global indices are kept until ``topk`` are (an all-gather of per-shard tie
  counts gives each shard its prefix), which is ``lax.top_k``'s and
  ``selection._threshold.topk_mask``'s tie rule, so the kept set equals the
  single-device one exactly.
- ``global_certified_keep``: the certified set of a GLOBAL budget eps (not
  eps per shard): keep the largest logits down to a threshold whose tail
  below it holds at most ``eps`` of the global softmax mass. A threshold,
  unlike a per-shard count, means the same thing on every shard, so it can
  be found from two psums of fixed-size histograms of exp-mass over logit
  bins measured from the global max M (a coarse pass over
  ``[0, log(n / eps) + 2]`` of gap ``M - s``, then a fine pass inside the
  boundary bin): ``2 * num_bins`` floats per row, independent of n and of the
  device count. The tail mass is a suffix sum of the merged histogram, so
  the threshold satisfies the budget up to float rounding, which a margin in
  the budget absorbs.

Why the certificate stays sound: the threshold only DECIDES the kept set.
The certificate is computed afterwards from that kept set alone (the exact
global head and tail masses, merged in log space, see ``_kv_sharded.py``),
so an imperfect threshold can only make the set larger than minimal or the
bound larger than eps (and then the certificate says so); it can never make
the bound smaller than the true dropped mass. Minimality is a quality
figure (THEORY 6.1): the kept set exceeds the minimal one by at most the
keys inside one fine bin (width ``log(n / eps) / num_bins**2`` in logit).

All functions work per row over the last axis and take ``axis_name``: the
mapped axis (shard_map or vmap) the key axis is split over, or None for a
single shard. Shards are ordered by ``lax.axis_index``: shard i holds keys
``[i * n_local, (i + 1) * n_local)``.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxtopk.selection import _threshold

NUM_BINS = 64
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


def _kth_largest_bits_candidates(s, valid, topk, row_topk, axis_name):
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
  return _threshold.sortable_bits(thr)


def _kth_largest_bits_radix(bits, valid, row_topk, axis_name):
  """Radix select over 8-bit digits: one psum of a 256-bin count per digit.

  Finds the largest T with #{valid, bits >= T} >= row_topk over the whole
  row (the row_topk-th largest key), exactly as
  ``selection._threshold.kth_largest_bits``, in 4 (float32) or 8 (float64)
  collective rounds of ``256`` counts per row.
  """
  ut = bits.dtype
  nbits = jnp.iinfo(ut).bits
  prefix = jnp.zeros(bits.shape[:-1], ut)
  need = jnp.maximum(row_topk, 1)
  for p in range(nbits // _DIGIT_BITS):
    shift = nbits - _DIGIT_BITS * (p + 1)
    if p == 0:
      match = valid
    else:
      high = jnp.asarray(shift + _DIGIT_BITS, ut)
      match = valid & ((bits >> high) == (prefix >> high)[..., None])
    digit = ((bits >> jnp.asarray(shift, ut)) & (_RADIX - 1)).astype(jnp.int32)
    hist = _row_histogram(match.astype(jnp.int32), digit, _RADIX)
    hist = psum(hist, axis_name)  # [..., 256]
    at_or_above = jnp.flip(jnp.cumsum(jnp.flip(hist, -1), axis=-1), -1)
    ok = at_or_above >= need[..., None]  # True for digits <= the answer
    d_star = jnp.sum(ok, axis=-1) - 1  # largest digit with enough keys
    d_star = jnp.maximum(d_star, 0)
    above = jnp.concatenate(
      [at_or_above[..., 1:], jnp.zeros_like(at_or_above[..., :1])], -1
    )
    need = need - jnp.take_along_axis(above, d_star[..., None], -1)[..., 0]
    prefix = prefix | (d_star.astype(ut) << jnp.asarray(shift, ut))
  return prefix[..., None]


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
  bits = _threshold.sortable_bits(s)
  if method == "auto":
    nbits = jnp.iinfo(bits.dtype).bits
    radix_words = 2 * (nbits // _DIGIT_BITS) * _RADIX  # all-reduce: 2x
    cand_words = n_shards * min(topk, n_local)
    method = "radix" if cand_words > radix_words else "candidates"
  if method == "radix":
    thr = _kth_largest_bits_radix(bits, valid, row_topk, axis_name)
  else:
    thr = _kth_largest_bits_candidates(s, valid, topk, row_topk, axis_name)
  above = valid & (bits > thr)
  ties = valid & (bits == thr)
  n_above = psum(jnp.sum(above, axis=-1, dtype=jnp.int32), axis_name)
  n_ties_local = jnp.sum(ties, axis=-1, dtype=jnp.int32)
  need = row_topk - n_above - _shard_prefix(n_ties_local, axis_name)  # [...]
  rank = jnp.cumsum(ties, axis=-1, dtype=jnp.int32) - 1
  keep = above | (ties & (rank < need[..., None]))
  return keep & (row_topk > 0)[..., None]


def _row_histogram(mass, bins, num_bins):
  """Per-row sums of ``mass`` by integer bin: ``[..., n]`` -> ``[..., nb]``."""
  lead = mass.shape[:-1]
  rows = math.prod(lead)
  ids = jnp.arange(rows, dtype=jnp.int32).reshape(*lead, 1) * num_bins + bins
  out = jax.ops.segment_sum(
    mass.reshape(-1), ids.reshape(-1), num_segments=rows * num_bins
  )
  return out.reshape(*lead, num_bins)


def _first_true(ok):
  """Index of the first True along the last axis (its length if none)."""
  n = ok.shape[-1]
  idx = jnp.arange(n, dtype=jnp.int32)
  return jnp.min(jnp.where(ok, idx, n), axis=-1)


def global_certified_keep(
  logits,
  valid,
  row_max,
  log_budget,
  *,
  n_total: int,
  axis_name,
  num_bins: int = NUM_BINS,
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

  Returns:
    ``[..., n_local]`` bool kept set, an upper set of the row's logits (every
    kept logit is >= every dropped one), a subset of ``valid``.
  """
  s = lax.stop_gradient(logits)
  dt = s.dtype
  m = jnp.where(jnp.isfinite(row_max), row_max, 0.0)[..., None]
  log_budget = jnp.broadcast_to(jnp.asarray(log_budget, dt), row_max.shape)
  span = jnp.log(jnp.asarray(max(n_total, 2), dt)) - log_budget + 2.0
  width = (span / (num_bins - 1))[..., None]  # [..., 1]
  gap = jnp.where(valid, m - s, 0.0)  # >= 0 on real keys
  mass = jnp.where(valid, jnp.exp(-gap), 0.0)
  last = num_bins - 1
  cbin = jnp.clip(jnp.floor(gap / width), 0, last).astype(jnp.int32)
  hist = psum(_row_histogram(mass, cbin, num_bins), axis_name)  # [..., nb]
  total = jnp.sum(hist, axis=-1, keepdims=True)
  allowed = jnp.exp(log_budget)[..., None] * total
  # tail[j] = mass in bins >= j (dropped when bins < j are kept), j = 0..nb.
  tail = jnp.flip(jnp.cumsum(jnp.flip(hist, -1), axis=-1), -1)
  tail = jnp.concatenate([tail, jnp.zeros_like(tail[..., :1])], axis=-1)
  j_star = _first_true(tail <= allowed)  # [...] in 1..nb for a real row
  b = jnp.maximum(j_star - 1, 0)[..., None]  # the boundary coarse bin
  tail_after_b = jnp.take_along_axis(tail, b + 1, axis=-1)  # [..., 1]
  fine_width = width / num_bins
  fbin = jnp.floor((gap - b.astype(dt) * width) / fine_width)
  fbin = jnp.clip(fbin, 0, last).astype(jnp.int32)
  in_b = valid & (cbin == b)
  fine = _row_histogram(jnp.where(in_b, mass, 0.0), fbin, num_bins)
  fine = psum(fine, axis_name)
  ftail = jnp.flip(jnp.cumsum(jnp.flip(fine, -1), axis=-1), -1)
  ftail = jnp.concatenate([ftail, jnp.zeros_like(ftail[..., :1])], axis=-1)
  f_star = _first_true(ftail + tail_after_b <= allowed)[..., None]
  keep = (cbin < b) | ((cbin == b) & (fbin < f_star))
  return valid & keep & (j_star[..., None] > 0)
