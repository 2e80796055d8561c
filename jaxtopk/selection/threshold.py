"""Few-pass thresholds: which logits a row keeps, found without sorting.

THEORY 6.1. A documented internal API (``from jaxtopk.selection import
threshold``) for every path that selects keys: ``select``, the searches,
the XLA prefill and decode, and the sharded paths (``jaxtopk.parallel``
passes its ``axis_name``; a single device passes None). It only DECIDES
the kept set: every certificate is computed afterwards from the kept set by
``jaxtopk.selection.core``, so an imperfect threshold can make a kept set
larger than minimal, never a bound smaller than the truth.

Two thresholds, both a handful of passes over a row (no sort, no
``lax.top_k``, no ``fori_loop`` of 32 bit passes), and both shardable: every
pass reduces to a small per-row histogram, summed over ``axis_name``:

- ``topk_threshold``: the ``topk``-th largest logit, exactly, by radix select
  over the order-preserving integer image of the floats (``sortable_bits``),
  ``digit_bits`` bits per pass: 4 passes of 256-bin count histograms for
  float32 (8 for float64).
- ``budget_threshold``: the largest threshold t such that the mass of the
  logits below t fits a budget (top-p). ``levels`` passes of ``num_bins``-bin
  histograms of exp-mass over the gap to the row max: a coarse pass over
  gaps ``[0, log(n / budget) + 2]``, then each further pass refines inside
  the boundary bin of the one before. The kept set exceeds the minimal one
  by at most the keys inside one finest bin (width ``span / ((num_bins - 1)
  num_bins**(levels - 1))`` in logit, ~4e-5 for 3 levels), plus keys tied
  with or rounding at its edge.

On top of them:

- ``topk_mask``: exactly ``topk`` keys (ties at the threshold by increasing
  key index); ``budget_mask``: ``valid & (logits >= budget_threshold)``.
- ``mask_indices``: positions of the True entries of a mask (the first
  ``size`` of them), by per-column bit counts and prefix sums (no
  ``jnp.nonzero``, no sort): the compaction a path needs to gather the kept
  values only.
- ``column_max``: maxima of strided columns of a row, the cheap summary that
  decode uses to bracket a threshold before it compacts candidates.

Everything works on ``[..., n]`` arrays with per-row arguments ``[...]``;
it is already batched (vmap is not needed, but works). Speed on XLA:CPU
(measured, BUILD_NOTES "Few-pass selection and decode"): a reduction over
the MAJOR axis of a ``[..., group, n / group]`` view runs vectorised
(~0.2 ms per million logits for a count) while one over the minor axis runs
~4x slower, and a scatter-add histogram costs ~2 ms per million entries;
the functions are written accordingly.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxtopk.selection import core

NUM_BINS = 64  # bins per budget histogram pass
LEVELS = 3  # budget histogram passes (coarse + 2 refinements)
# One pass of COARSE_BINS bins (``budget_mask(coarse=True)``): for a path
# whose cost does not depend on how many of its scored keys are kept (the
# prefill's tiles multiply every scored key's value), the refinement passes
# buy nothing and cost most of the threshold's time (they keep [rows, n]
# gaps, masses and bins alive between passes: a causal Certified prefill at
# T = 1,024 runs in ~55% of the time with one pass, its gradient in ~90%).
# The kept set then exceeds the minimal one by at most the keys within one
# bin, span / 255 (~0.05 logit at n = 1,024 and eps = 0.05: ~1% more keys
# kept on flat rows). 512 or 1,024 bins were slower (a 1,024-bin gradient
# slower than three passes of 64).
COARSE_BINS = 256
DIGIT_BITS = 8  # bits per radix pass of topk_threshold
GROUP = 32  # positions per strided group of mask_indices / column_max
OVERFLOW_BINS = 16  # extra scatter bins of a budget pass's last bin
# The checkpoint name of every budget threshold (``jax.checkpoint``
# policies: ``save_only_these_names(RESIDUAL)`` keeps the [rows] thresholds,
# not the histograms).
RESIDUAL = "jaxtopk_threshold"


def _psum(x, axis_name):
  return x if axis_name is None else lax.psum(x, axis_name)


def _pmax(x, axis_name):
  return x if axis_name is None else lax.pmax(x, axis_name)


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
  ut, sign = _uint_sign(x.dtype, "sortable_bits")
  u = lax.bitcast_convert_type(x, ut)
  return jnp.where((u & sign) != 0, ~u, u | sign)


def from_sortable_bits(u: jax.Array, dtype) -> jax.Array:
  """The inverse of ``sortable_bits``: ``from_sortable_bits(sortable_bits(x))
  == x`` bit for bit."""
  ut, sign = _uint_sign(jnp.dtype(dtype), "from_sortable_bits")
  u = jnp.asarray(u, ut)
  raw = jnp.where((u & sign) != 0, u & ~sign, ~u)
  return lax.bitcast_convert_type(raw, dtype)


def _uint_sign(dtype, name):
  if dtype == jnp.float64:
    return jnp.uint64, jnp.uint64(1 << 63)
  if dtype == jnp.float32:
    return jnp.uint32, jnp.uint32(1 << 31)
  raise ValueError(f"{name} needs float32 or float64; got {dtype=}")


def row_histogram(values, bins, num_bins: int, *, axis_name=None):
  """Per-row sums of ``values`` by integer bin, summed over ``axis_name``.

  Args:
    values: ``[..., n]`` numbers to add up (masses or 0/1 counts).
    bins: ``[..., n]`` int32 in ``[0, num_bins)``.
    num_bins: static number of bins.
    axis_name: mapped axis the row is split over, or None.

  Returns:
    ``[..., num_bins]`` sums (a scatter-add; psum'd when sharded).
  """
  lead = values.shape[:-1]
  rows = math.prod(lead)
  ids = jnp.arange(rows, dtype=jnp.int32).reshape(*lead, 1) * num_bins + bins
  out = jax.ops.segment_sum(
    values.reshape(-1), ids.reshape(-1), num_segments=rows * num_bins
  )
  return _psum(out.reshape(*lead, num_bins), axis_name)


def _spread(bins, where, num_bins):
  """``bins`` where ``where``, else bins spread by position.

  Entries that add 0 still go through the scatter; sending them all to one
  bin serialises the scatter on that bin (~2x slower on XLA:CPU).
  """
  lane = lax.broadcasted_iota(jnp.int32, bins.shape, bins.ndim - 1)
  return jnp.where(where, bins, lane % num_bins)


def _suffix_sum(hist):
  """``[..., nb + 1]``: out[j] = sum of hist[j:] (out[nb] = 0).

  A cumsum (XLA:CPU: a reduce-window). An associative scan ran 2.7x faster
  on ``[4096, 65]`` (0.63 against 1.70 ms) but added 10-25% to the compile
  time of every program with a threshold, for ~3 ms of a 35-40 ms prefill.
  """
  tail = jnp.flip(jnp.cumsum(jnp.flip(hist, -1), axis=-1), -1)
  return jnp.concatenate([tail, jnp.zeros_like(tail[..., :1])], axis=-1)


def _first_true(ok):
  """Index of the first True along the last axis (its length if none)."""
  n = ok.shape[-1]
  idx = lax.broadcasted_iota(jnp.int32, ok.shape, ok.ndim - 1)
  return jnp.min(jnp.where(ok, idx, n), axis=-1)


def _digit_schedule(nbits, digit_bits):
  """(shift, width) of each radix digit, most significant first."""
  out, done = [], 0
  while done < nbits:
    width = min(digit_bits, nbits - done)
    done += width
    out.append((nbits - done, width))
  return out


def topk_threshold(
  logits, topk, valid, *, axis_name=None, digit_bits: int = DIGIT_BITS
):
  """The ``topk``-th largest valid logit of each row, exactly.

  THEORY 6.1. Radix select over ``sortable_bits``: each pass counts the
  valid logits that share the prefix found so far by their next
  ``digit_bits`` bits (one histogram, psum'd over ``axis_name``) and fixes
  that digit. ``ceil(32 / digit_bits)`` passes for float32.

  Args:
    logits: ``[..., n]`` float32/float64 (this shard's part of each row).
    topk: ``[...]`` or scalar int, the rank sought (over the whole row).
    valid: ``[..., n]`` bool, the keys that count (real, not NaN).
    axis_name: mapped axis the row is split over, or None.
    digit_bits: static bits per pass (8: 256-bin histograms).

  Returns:
    ``(thresh, n_above)``: ``[...]`` the ``topk``-th largest valid logit (the
    smallest valid one when ``topk`` >= the number of valid keys; arbitrary
    for rows without a valid key) and ``[...]`` int32 number of valid logits
    strictly above it (over the whole row). Keep the logits ``> thresh`` and
    ``topk - n_above`` of those ``== thresh`` to keep exactly ``topk``.
  """
  s = lax.stop_gradient(jnp.asarray(logits))
  bits = sortable_bits(s)
  ut = bits.dtype
  nbits = jnp.iinfo(ut).bits
  n_valid = _psum(jnp.sum(valid, axis=-1, dtype=jnp.int32), axis_name)
  topk = jnp.broadcast_to(jnp.asarray(topk, jnp.int32), n_valid.shape)
  need = jnp.clip(topk, 1, jnp.maximum(n_valid, 1))
  prefix = jnp.zeros(n_valid.shape, ut)
  for p, (shift, width) in enumerate(_digit_schedule(nbits, digit_bits)):
    if p == 0:
      match = valid
    else:
      high = jnp.asarray(shift + width, ut)
      match = valid & ((bits >> high) == (prefix >> high)[..., None])
    radix = 1 << width
    digit = ((bits >> jnp.asarray(shift, ut)) & (radix - 1)).astype(jnp.int32)
    digit = _spread(digit, match, radix)
    hist = row_histogram(
      match.astype(jnp.int32), digit, radix, axis_name=axis_name
    )
    at_or_above = _suffix_sum(hist)  # [..., radix + 1]
    d_star = jnp.maximum(
      jnp.sum(at_or_above[..., :radix] >= need[..., None], -1) - 1, 0
    )
    above = jnp.take_along_axis(at_or_above, d_star[..., None] + 1, -1)[..., 0]
    need = need - above
    prefix = prefix | (d_star.astype(ut) << jnp.asarray(shift, ut))
  thresh = from_sortable_bits(prefix, s.dtype)
  # Float comparison (-0.0 == +0.0), as callers keep ``s > thresh``.
  n_above = _psum(
    jnp.sum(valid & (s > thresh[..., None]), axis=-1, dtype=jnp.int32),
    axis_name,
  )
  return thresh, n_above


def budget_threshold(
  logits,
  log_budget,
  valid,
  *,
  relative: bool = False,
  log_extra=None,
  axis_name=None,
  row_max=None,
  n_total: int | None = None,
  num_bins: int = NUM_BINS,
  levels: int = LEVELS,
  dense_above: float | None = None,
):
  """Largest t whose dropped mass fits a budget: keep ``logits >= t``.

  THEORY 6.1 (top-p by exp-mass). Finds t such that

    sum_{valid, s_i < t} e^{s_i} + extra <= budget,

  with t as large as the histogram resolution allows (see the module
  docstring: the kept set exceeds the minimal one by at most the keys inside
  one finest bin). ``levels`` scatter passes of ``num_bins`` bins over the
  gap ``M - s`` to the row max M (psum'd over ``axis_name``): the budget is
  met up to the float rounding of those sums, which callers absorb with a
  margin (``core.search_log_margin``); the certificate is computed from the
  kept set afterwards.

  Args:
    logits: ``[..., n]`` float32/float64 (this shard's part of each row).
    log_budget: ``[...]`` or scalar: log of the allowed dropped mass, in the
      units of the logits (``relative=False``), or of the allowed FRACTION of
      the row's total mass plus extra (``relative=True``; then the total comes
      from the histogram, no separate log-sum-exp pass is needed, and the
      budget keeps its precision at any magnitude of the logits, which an
      absolute log budget near |s| ~ 1e38 cannot).
    valid: ``[..., n]`` bool, the keys that count.
    relative: see ``log_budget``.
    log_extra: optional ``[...]`` log of mass dropped regardless (e.g. the
      bounds of unscored blocks); counted against the budget.
    axis_name: mapped axis the row is split over, or None.
    row_max: optional ``[...]`` max valid logit of the whole row (else
      computed, with a pmax when sharded).
    n_total: static number of keys of the whole row (default: ``n`` times
      the size of ``axis_name``).
    num_bins: static bins per pass (>= 2).
    levels: static number of passes (>= 1).
    dense_above: optional static fraction in (0, 1]: a row whose first pass
      shows that it keeps at least this fraction of its valid keys (the keys
      in the bins before the boundary bin are kept whatever the later passes
      find) gets -inf, keep every key; where every row is such a row, the
      later passes are skipped (``Certified.dense_above``).

  Returns:
    ``[...]`` threshold t in the logits' dtype: +inf when every key may be
    dropped (the budget covers the row), -inf when even keeping every key
    does not meet it (extra too large), when the relative budget is below
    n_total times the smallest normal (flushed masses cannot be told apart
    from it: every key is kept), when ``dense_above`` says so, or the row
    has no finite maximum.
  """
  s = lax.stop_gradient(jnp.asarray(logits))
  dt = s.dtype
  n = s.shape[-1]
  if n_total is None:
    n_total = n * (1 if axis_name is None else lax.axis_size(axis_name))
  if row_max is None:
    row_max = _pmax(
      jnp.max(jnp.where(valid, s, -jnp.inf), axis=-1, initial=-jnp.inf),
      axis_name,
    )
  m = jnp.asarray(row_max, dt)
  ok_m = jnp.isfinite(m)
  mm = jnp.where(ok_m, m, 0.0)
  lb = jnp.broadcast_to(jnp.asarray(log_budget, dt), m.shape)
  extra = jnp.zeros(m.shape, dt)
  if log_extra is not None:
    extra = jnp.exp(jnp.broadcast_to(jnp.asarray(log_extra, dt), m.shape) - mm)
  # Gaps beyond `span` hold at most n e^-span <= budget / e^2 (relative to
  # the max): the coarse bins need not see them apart.
  log_rel = lb if relative else lb - mm
  span = jnp.log(jnp.asarray(max(n_total, 2), dt)) - log_rel + 2.0
  span = jnp.where(jnp.isfinite(span), jnp.maximum(span, 1.0), 1.0)
  width = span / (num_bins - 1)  # [...]
  good = valid & ~jnp.isnan(s)
  gap = jnp.where(good, mm[..., None] - s, jnp.inf)  # >= 0; inf: no mass
  mass = jnp.where(good, jnp.exp(-gap), 0.0)
  last = num_bins - 1

  def level_pass(level, lo, inside):
    """One histogram pass: bins of the gaps in [lo, lo + w num_bins)."""
    w = width / num_bins**level
    pos = jnp.floor((gap - lo[..., None]) / w[..., None])
    b = jnp.clip(pos, 0, last).astype(jnp.int32)
    # The last bin also holds every gap past the range. On a peaked row
    # most gaps lie there: they go to OVERFLOW_BINS extra bins by position,
    # added to the last bin after the scatter, which one bin would
    # serialise (2x slower on XLA:CPU).
    lane = lax.broadcasted_iota(jnp.int32, b.shape, b.ndim - 1)
    spread = jnp.where(pos > last, num_bins + lane % OVERFLOW_BINS, b)
    spread = _spread(spread, inside, num_bins)
    hist = row_histogram(
      jnp.where(inside, mass, 0.0),
      spread,
      num_bins + OVERFLOW_BINS,
      axis_name=axis_name,
    )
    over = jnp.sum(hist[..., num_bins:], -1)
    hist = hist[..., :num_bins].at[..., last].add(over)
    # b is read only where `inside` (the next level's inside is ANDed).
    return w, b, _suffix_sum(hist)

  def allowed_of(total):
    """The dropped mass allowed, relative to the max."""
    if relative:
      return jnp.exp(lb) * (total + extra) - extra
    return jnp.exp(lb - mm) - extra

  def histogram_cut():
    """``(cut, first)``: the cut in gap units, and level 0's boundary."""
    w, b, tail = level_pass(0, jnp.zeros(m.shape, dt), good)
    allowed = allowed_of(tail[..., 0])  # tail[..., 0]: the row's mass
    first = _first_true(tail <= allowed[..., None])  # 0 .. nb + 1

    def refine():
      """Levels 1.. inside each boundary bin; the final cut."""
      w_, b_, tail_, j_star = w, b, tail, first
      lo = jnp.zeros(m.shape, dt)  # lower gap edge of the current bin
      dropped = jnp.zeros(m.shape, dt)  # mass of the bins after it
      inside = good
      # Whether the current bin is open-ended: the last bin of each pass
      # also holds every gap past its range (clipped), so while every
      # boundary so far was a last bin, "drop nothing more" means keeping
      # all of them.
      open_end = jnp.ones(m.shape, bool)
      for level in range(1, levels):
        bnd = jnp.clip(j_star - 1, 0, last)
        dropped = (
          dropped + jnp.take_along_axis(tail_, bnd[..., None] + 1, -1)[..., 0]
        )
        lo = lo + bnd.astype(dt) * w_
        inside = inside & (b_ == bnd[..., None])
        open_end = open_end & (bnd == last)
        w_, b_, tail_ = level_pass(level, lo, inside)
        j_star = _first_true(tail_ + dropped[..., None] <= allowed[..., None])
      cut = lo + jnp.minimum(j_star, num_bins).astype(dt) * w_
      # Nothing of an open-ended bin dropped: its clipped gaps are kept too.
      return jnp.where(open_end & (j_star >= num_bins), jnp.inf, cut)

    if dense_above is None:
      return refine(), first
    # The keys of the bins before the boundary bin are kept whatever the
    # later passes find: rows where they are most of the row keep all.
    edge = jnp.clip(first - 1, 0, last).astype(dt) * w
    sure = _psum(
      jnp.sum(good & (gap < edge[..., None]), -1, dtype=jnp.int32), axis_name
    )
    dense = sure.astype(dt) >= dense_above * n_good
    cut = lax.cond(
      jnp.all(dense), lambda: jnp.full(m.shape, jnp.inf, dt), refine
    )
    return cut, jnp.where(dense & (first > 0), num_bins + 1, first)

  if dense_above is None:
    cut, first = histogram_cut()
  else:
    # Before any histogram, one pass: a kept set K must hold the mass
    # `need` (relative to the max), and by Cauchy-Schwarz
    # need^2 <= |K| sum_K mass^2, so |K| >= need^2 / sum(mass^2). Rows
    # where that is most of the row keep every key; where all are such rows,
    # no histogram pass runs.
    n_good = _psum(jnp.sum(good, -1, dtype=jnp.int32), axis_name).astype(dt)
    z = _psum(jnp.sum(mass, -1), axis_name)
    z2 = _psum(jnp.sum(mass * mass, -1), axis_name)
    need = z - allowed_of(z)
    sq = need * need >= dense_above * n_good * z2
    cut, first = lax.cond(
      jnp.all(sq),
      lambda: (
        jnp.full(m.shape, jnp.inf, dt),
        jnp.full(m.shape, num_bins + 1, jnp.int32),
      ),
      histogram_cut,
    )
    first = jnp.where(sq, num_bins + 1, first)
  # The bins were read from fl(M - s); callers compare s >= t. Lowered by a
  # few ulps so that every key a bin counted as kept is kept (the rounding
  # of M - s, of the bin index and of M - cut may disagree at the edge):
  # keeping more never loosens the certificate.
  eps = jnp.finfo(dt).eps
  t = mm - cut - 8 * eps * (jnp.abs(mm) + cut)
  t = jnp.where(first == 0, jnp.inf, t)  # the budget covers every key
  t = jnp.where(first > num_bins, -jnp.inf, t)  # not even all keys do
  # A budget below n tiny (relative to the max) cannot be told apart from
  # masses that flush to 0 (gaps past ~87 in float32): keep every key. This
  # is what a huge logit error margin asks for (core.search_log_margin):
  # eps is then met only by keeping the whole row.
  floor = jnp.log(jnp.asarray(max(n_total, 1), dt)) + math.log(
    float(jnp.finfo(dt).tiny)
  )
  t = jnp.where(log_rel < floor, -jnp.inf, t)
  t = jnp.where(ok_m, t, jnp.where(m == -jnp.inf, jnp.inf, -jnp.inf))
  # Named, so that a rematerialising caller can keep it for the backward
  # pass (``RESIDUAL``) instead of running the passes again.
  return checkpoint_name(t, RESIDUAL)


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
  s = jnp.asarray(logits)
  n_valid = jnp.sum(valid, axis=-1, dtype=jnp.int32)
  topk = jnp.minimum(
    jnp.broadcast_to(jnp.asarray(topk, jnp.int32), n_valid.shape), n_valid
  )
  t, n_above = topk_threshold(s, topk, valid)
  t = t[..., None]
  above = valid & (s > t)
  tie = valid & (s == t)
  need = topk - n_above
  n_tie = jnp.sum(tie, axis=-1, dtype=jnp.int32)
  # The cumulative sum is only needed when some row has surplus ties.
  keep_ties = lax.cond(
    jnp.any(n_tie > need),
    lambda: tie & (_tie_rank(tie) <= need[..., None]),
    lambda: tie,
  )
  return (above | keep_ties) & (topk > 0)[..., None]


def budget_mask(
  logits,
  log_budget,
  valid,
  log_extra=None,
  *,
  relative=False,
  dense_above=None,
  coarse: bool = False,
):
  """Smallest kept set (up to one finest bin) whose dropped mass fits a budget.

  THEORY 6.1: keeps ``valid & (logits >= budget_threshold(...))``, i.e.
  top-p with p = 1 - budget / Z. A row keeps at least its largest valid key
  whenever the budget is below the row's total mass; if even keeping every
  key exceeds the budget (extra too large), every valid key is kept.

  Args:
    logits: ``[..., n]`` float32/float64.
    log_budget: ``[...]`` log of the allowed dropped mass, in logit units
      (or of the allowed fraction with ``relative=True``).
    valid: ``[..., n]`` bool.
    log_extra: optional ``[...]`` log of mass that is dropped regardless
      (e.g. unscored blocks in Delta-Search); -inf when None.
    relative, dense_above: see ``budget_threshold``.
    coarse: one pass of ``COARSE_BINS`` bins instead of ``LEVELS`` passes
      of ``NUM_BINS``: the kept set is minimal up to one coarse bin.

  Returns:
    ``[..., n]`` bool keep mask.
  """
  s = jnp.asarray(logits)
  t = budget_threshold(
    s,
    log_budget,
    valid,
    relative=relative,
    log_extra=log_extra,
    dense_above=dense_above,
    num_bins=COARSE_BINS if coarse else NUM_BINS,
    levels=1 if coarse else LEVELS,
  )
  return valid & (s >= t[..., None])


def _group(n: int, group: int) -> int:
  """Largest power of two <= ``group`` dividing ``n`` (1 if n is odd)."""
  c = 1
  while c * 2 <= group and n % (c * 2) == 0:
    c *= 2
  return c


def column_max(logits, valid, *, group: int = GROUP):
  """Maxima of the strided columns of each row.

  Column j of a row of n keys holds the ``group`` positions ``j, j + n / g,
  ..., j + (g - 1) n / g`` (g = ``group``, dividing n): a reduction over the
  major axis of a ``[..., g, n / g]`` view, which XLA:CPU vectorises.
  Strided columns spread a contiguous run of large logits (a local window)
  over many columns.

  Args:
    logits: ``[..., n]``.
    valid: ``[..., n]`` bool (invalid keys count as -inf).
    group: static g; must divide n.

  Returns:
    ``[..., n / g]`` maxima (-inf for a column without a valid key; NaN
    where a valid logit is NaN).
  """
  s = jnp.asarray(logits)
  n = s.shape[-1]
  if n % group:
    raise ValueError(f"{group=} must divide the key axis {n=}")
  x = jnp.where(valid, s, -jnp.inf).reshape(*s.shape[:-1], group, n // group)
  return core.max_nan(x, axis=-2)  # XLA:CPU's own max drops NaN


def _prefix_sum(c):
  """Inclusive prefix sums of int32 ``[..., m]`` along the last axis."""
  return jnp.cumsum(c, axis=-1, dtype=jnp.int32)


def _nth_set_bit(bits, r, c: int):
  """Position of the ``r``-th (from 0) set bit of each uint32 of ``bits``
  whose set bits lie below bit ``c`` (a power of two), where ``r`` is less
  than its popcount (else some position < c). A binary search: log2(c)
  halvings, each a popcount of the lower half of the current window."""
  pos = jnp.zeros(r.shape, jnp.int32)
  w = c // 2
  while w >= 1:
    low = lax.population_count(bits & jnp.uint32((1 << w) - 1))
    low = low.astype(jnp.int32)
    up = r >= low  # the bit lies in the upper half
    r = jnp.where(up, r - low, r)
    pos = jnp.where(up, pos + w, pos)
    bits = jnp.where(up, bits >> jnp.uint32(w), bits)
    w //= 2
  return pos


def mask_indices(mask, size: int, *, group: int = GROUP, strided=True):
  """Positions of (the first ``size``) True entries of each row, compacted.

  No sort, no ``jnp.nonzero``: the row is cut into columns of c positions,
  each column's mask packed into one uint32, the popcounts prefix-summed,
  and output slot i finds its column by counting the column ends <= i (a
  small histogram) and its position inside the column from the bits. Cost: one
  pass over the mask plus work on ``[..., n / c]`` and ``[..., size]``.

  Args:
    mask: ``[..., n]`` bool.
    size: static number of output slots.
    group: static positions per column c (a power of two <= 32; smaller when
      it does not divide n).
    strided: True: group j holds positions ``j + k n / c`` (a fast
      major-axis pass; the output order is by (j, k), deterministic but not
      by position); False: group j holds positions ``j c .. j c + c - 1`` and
      the output is in increasing position.

  Returns:
    ``(idx, ok, count)``: ``[..., size]`` int32 positions (0 in unused
    slots), ``[..., size]`` bool True for the ``min(size, count)`` used
    slots, and ``[...]`` int32 count of True entries of the row (possibly
    more than ``size``).
  """
  mask = jnp.asarray(mask, bool)
  lead, n = mask.shape[:-1], mask.shape[-1]
  c = _group(n, min(group, 32))
  nb = n // c
  if strided:
    x = mask.reshape(*lead, c, nb)
    weights = (jnp.uint32(1) << jnp.arange(c, dtype=jnp.uint32))[:, None]
    bits = jnp.sum(
      jnp.where(x, weights, jnp.uint32(0)), axis=-2, dtype=jnp.uint32
    )
  else:
    x = mask.reshape(*lead, nb, c)
    weights = jnp.uint32(1) << jnp.arange(c, dtype=jnp.uint32)
    bits = jnp.sum(
      jnp.where(x, weights, jnp.uint32(0)), axis=-1, dtype=jnp.uint32
    )
  cnt = lax.population_count(bits).astype(jnp.int32)  # [..., nb]
  inc = _prefix_sum(cnt)  # [..., nb]
  total = inc[..., -1]
  # Column of slot i = #{columns whose inclusive end <= i}.
  ends = row_histogram(jnp.ones_like(inc), jnp.minimum(inc, size), size + 1)
  col = jnp.minimum(_prefix_sum(ends[..., :size]), nb - 1)  # [..., size]
  slot = lax.broadcasted_iota(jnp.int32, col.shape, col.ndim - 1)
  excl = jnp.take_along_axis(inc - cnt, col, -1)
  r = slot - excl  # rank of the slot's entry inside its column
  b = jnp.take_along_axis(bits, col, -1)
  within = _nth_set_bit(b, r, c)
  if strided:
    idx = within * nb + col
  else:
    idx = col * c + within
  ok = slot < total[..., None]
  return jnp.where(ok, idx, 0), ok, total
