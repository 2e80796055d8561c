"""Blockwise (flash-style) Top-k prefill on the XLA path, with certificates.

THEORY 1, 3.3 (block bounds), 6.1/6.2 (certified selection, Delta-Search),
6.5, 8.1/8.2 (Top-k prefill and training). The engine behind
``topk_attention(implementation=None | 'xla')``; never materialises the
``[q_len, kv_len]`` logits of the whole call: queries are cut into tiles of
``BlockSizes.block_q`` rows (all heads of a kv head's GQA group together),
and each tile works on its own ``[tile, kv_len]`` slice at most.

A chunk of a sequence's newest queries over a cache (``q_offset``: query
row i of sequence b sits at key position ``i + q_offset[b]``, the decode's
route for many query steps) reads the cache's head-major keys and stored
value norms as they are (``kv_layout='bhsd'``, ``value_norms``).

Layout: inputs in the jax.nn layout are transposed ONCE to head-major
``[batch, kv_heads, group, q_len, head_dim]`` queries and
``[batch, kv_heads, kv_len, head_dim]`` keys and values (DESIGN: layout
decides speed on XLA CPU).

A row's real keys: its mask, intersected with one interval of key positions
``[lo, hi)`` (``_key_range``) that kv_len, ``is_causal``, the local window
and the sequence lengths cut (a key outside it is a masked key, in the kept
set, the block summaries and the certificate alike; a row past its query
length has none). The interval is computed per tile from positions, never as
a ``[q_len, kv_len]`` mask.

Two engines, one per kind of policy:

- Scan-all (``Dense``, ``FixedK``, ``Ratio``, ``PowerLaw``,
  ``Certified(search=Exact())``, and the default ``Auto`` up to
  ``AUTO_SCAN_BLOCKS`` key blocks or with ``dense_above``): a tile scores
  every key it can see (one einsum), chooses its kept set by the policy's
  rule over those logits (that of ``jaxtopk.select`` on the same logits:
  ties of fixed counts broken by key index; Certified's from one coarse
  histogram pass, minimal up to the keys within one bin of its threshold,
  ``threshold.COARSE_BINS``: every scored key's value is multiplied anyway,
  so the passes that would trim them cost time and save none), then forms
  the softmax over the kept keys and its product with the values. Causal
  tiles never touch keys above their diagonal: tiles are grouped into at
  most ``BlockSizes.max_bands`` bands of consecutive tiles, and a band's
  tiles score only the keys its last row can see (a band of ``w`` tiles
  wastes at most ``w - 1`` tiles' worth of keys).
- Block search (``Certified(search=DeltaSearch(...))``, and the default
  ``Certified(eps)``, ``Auto``, on longer rows: where the box bounds cannot
  rule a block out, the rounds score it anyway; a tile whose rows need
  more blocks than all rounds but the last score (so the rounds would end
  up scoring every block), by a lower bound read from the box bounds
  before any round (``_flat``), runs the scan-all engine over every key
  instead):
  Delta-Search (THEORY 6.2) at TILE granularity. Keys are cut into blocks of
  ``Certified.block_size``; every block has a box summary (THEORY 3.3) that
  bounds the logit of each of its keys for each row of the tile (widened by
  the row's logit rounding bound, so it bounds the EXACT logits). The tile
  scores the union of the blocks its rows need, in a few batched rounds of
  geometrically growing size (the blocks with the largest bound relative to
  the uncertified rows' mass first), until every row's unscored-mass bound
  U fits its budget: U <= eps (Z_S + U) (with the rounding margin
  ``core.search_log_margin``), Z_S the row's scored mass. Blocks never
  scored are neither multiplied by q nor by v. Then, per row, the kept set is
  the MINIMAL set among the scored keys (up to one coarse bin, as above,
  and ties at the threshold) whose
  dropped scored mass plus U fits the budget (``budget_mask`` with U as fixed
  extra tail), capped at ``Certified.max_topk``. Excess over the exact
  minimal set of the whole row (H*): keys of unscored blocks are never kept,
  and the dropped scored mass allowed is smaller than H*'s by
  (U - Z_U)(1 - eps) <= U (Z_U the true mass of the unscored blocks), so
  the keys kept beyond H* carry at most U of mass (plus ties), itself at
  most eps of the row's bound mass. ``MCSearch`` is refused by name: the
  prefill takes no PRNG key, and running it deterministically would drop its
  ``delta`` and ``num_samples`` fields (use ``search='delta'`` here, or
  ``decode_attention`` / ``certified_search``, which sample).

The certificate of every row comes from ``jaxtopk.selection.core``: a
``core.PartialSoftmax`` of the scored keys (``PartialSoftmax.from_logits``,
with the kept-set output through the caller's einsum), the unscored
blocks' bounds merged into its tail (``add_tail``), and ``finalize``, run
once on every tile's per-row statistics after the tiles. The logit
rounding bound of a row (``core.logit_error_bound``, subnormal inputs
included) is formed from per-block key summaries over the blocks the row
can see.
Logits are computed at ``Precision.HIGHEST`` (the bounds assume
full-precision dot products).

Gradients flow through the softmax over the kept keys (THEORY 8.2): the
selection runs on stop-gradient logits; each tile is a ``jax.checkpoint``, so
the backward pass recomputes a tile at a time and never stores the logits of
the whole call.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.special import logsumexp

from jaxtopk import theory
from jaxtopk.selection import core
from jaxtopk.selection import internal
from jaxtopk.selection.threshold import RESIDUAL

HIGHEST = core.PRECISION  # full float32 products (the bounds assume it)

# What this path honours (``Policy.require``): every policy, the exact and
# Delta-Search strategies with box block bounds, max_topk and dense_above
# (both through ``internal.keep_mask``). MC-Search and the low-rank key bound
# are refused by name.
SUPPORTS = internal.capabilities(
  "policy=Dense",
  "policy=FixedK",
  "policy=Ratio",
  "policy=PowerLaw",
  "policy=Certified",
  "search=exact",
  "search=delta",
  "bound=box",
  "max_topk",
  "dense_above",
)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the blockwise prefill.

  Attributes:
    block_q: query rows per tile (per head); a tile's buffers are
      ``[batch, heads, block_q, kv_len]`` at most.
    max_bands: causal scan-all tiles are grouped into at most this many
      bands of equal key length, each of at least two tiles (more bands:
      less work above the diagonal, more code to compile).
    first_round: blocks scored by a tile in the first round of the block
      search; each later round doubles the total.
    scan_all_share: a block-search tile whose rows need at least this
      share of the key blocks (a lower bound from their box bounds, for
      every kv head) scores every key at once instead of in rounds; None:
      from ``FLAT_MIN_BLOCKS`` key blocks, where the rounds would score
      every block anyway (they need more than all rounds but the last
      score), for the same keys at ~20% more cost; above 1: never.
  """

  block_q: int = 256
  max_bands: int = 8
  first_round: int = 4
  scan_all_share: float | None = None

  def __post_init__(self):
    for name in ("block_q", "max_bands", "first_round"):
      v = getattr(self, name)
      if not (isinstance(v, int) and v >= 1):
        raise ValueError(f"BlockSizes.{name}={v!r} must be an int >= 1")
    v = self.scan_all_share
    ok = isinstance(v, int | float) and v > 0 and math.isfinite(v)
    if v is not None and not ok:
      raise ValueError(
        f"BlockSizes.scan_all_share={v!r} must be None or a finite number > 0"
      )

  @classmethod
  def get_default(cls) -> "BlockSizes":
    return cls()


# By default a search tile may switch to the scan-all engine (``_flat``)
# from FLAT_MIN_BLOCKS key blocks: below it the rounds are few and the
# switch would only add the second engine to the compiled program.
FLAT_MIN_BLOCKS = 32

# Default tiles of more than TILE_LOGITS logits (batch x heads x block_q x
# kv_len) take MIN_WIDE_BLOCK_Q query rows: 2,048 queries over 32,768 keys,
# 8 heads, 2 kv heads: Dense() 4.1 s with tiles of 128 rows against 4.4-5.0
# with 256 (64: 4.6), Certified exact 5.6 s against 7.8; over 16,384 keys
# 10% less with 128; at 4,096 keys x 4 heads no difference.
TILE_LOGITS = 1 << 24
MIN_WIDE_BLOCK_Q = 128

# Block size of the key summaries behind the logit rounding bound when the
# policy names none (Dense and fixed counts).
_SUMMARY_BLOCK = 64


# ``Auto`` scores every key at once (the scan-all engine) up to this many
# key blocks: there the tile search saves nothing and compiles more
# (causal, B=1, 4 heads, T = 1,024, 16 blocks of 64: 38-41 ms against 43 ms
# on flat and concentrated rows, first call 2.6-3.0 s against 4.1-4.9 s; at
# T = 2,048 the search wins on concentrated rows, 101 ms against 127 ms).
AUTO_SCAN_BLOCKS = 16


def kind_of(policy, kv_len: int) -> str:
  """'dense', 'count', 'exact' or 'search': which engine and rule run."""
  if policy.kind != "certified":
    return policy.kind
  if policy.search.name == "auto":
    # The tile search, which scores every block where needed, past
    # AUTO_SCAN_BLOCKS blocks; with dense_above (training: rows expected to
    # keep most keys) scoring every key at once costs less (Flax layer, seq
    # 1,024: forward 1.37x nnx.MultiHeadAttention against 1.74x through the
    # search).
    few = kv_len <= AUTO_SCAN_BLOCKS * policy.block_size
    return "exact" if few or policy.dense_above is not None else "search"
  return "exact" if policy.scores_all else "search"


# ---------------------------------------------------------------------------
# Small helpers.


def _cdiv(a, b):
  return -(-a // b)


def _to5(x, b, hk, g):
  """A mask or bias broadcastable to [b, h, t, s], as a 5-d array.

  Shape ``[b|1, hk|1, g|1, t|1, s|1]`` (heads split into kv heads and group).
  """
  if x is None:
    return None
  x = jnp.asarray(x)
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  nb, nh, nt, ns = x.shape
  if nh == 1:
    return x.reshape(nb, 1, 1, nt, ns)
  return x.reshape(nb, hk, g, nt, ns)


def _pad_axis(x, axis, size, value):
  pad = size - x.shape[axis]
  if pad <= 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _rows_of(x, q0, bq):
  """The rows [q0, q0 + bq) of a 5-d mask/bias (axis 3), or x if broadcast."""
  if x is None or x.shape[3] == 1:
    return x
  return lax.dynamic_slice_in_dim(x, q0, bq, axis=3)


def _round_up(x):
  """x rounded up by a relative 2 eps and an absolute tiny; -inf stays -inf
  (a block whose keys all have bias -inf has no mass), +inf and NaN stay."""
  dt = x.dtype
  up = x + jnp.abs(x) * 2 * jnp.finfo(dt).eps + jnp.finfo(dt).tiny
  return jnp.where(x == -jnp.inf, x, up)


# ---------------------------------------------------------------------------
# Per-call preparation: head-major arrays, norms, key-block summaries.


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static sizes of one call."""

  b: int
  t: int
  h: int
  hk: int
  g: int
  d: int
  dv: int
  s: int  # kv_len
  bq: int  # query rows per tile
  tp: int  # padded q_len (multiple of bq)
  bs: int  # key block size (summaries; search blocks)
  sp: int  # padded kv_len (multiple of bs)
  causal: bool
  window: tuple[int, int] | None  # (left, right) keys around the query
  kind: str

  @property
  def nt(self):
    return self.tp // self.bq

  @property
  def nb(self):
    return self.sp // self.bs


def _prepare(
  query, key, value, mask, bias, lens, plan, values_bound, kv, value_norms
):
  """Head-major, padded arrays and per-key / per-block summaries.

  ``lens`` is ``(q_lens, kv_lens)``, each None or ``[batch]`` int; ``kv``
  the keys' and values' layout ('bshd' or 'bhsd'); ``value_norms`` None or
  the values' ``core.value_norms`` in that layout (without the head dim).
  """
  p = plan
  dt = core.compute_dtype(jnp.result_type(query.dtype, key.dtype))
  # Flush flags read the inputs' own bits (before any cast).
  q_fl = core.flushed(query)  # [b, t, h]
  k_fl = core.flushed(key)  # [b, s, hk] (or [b, hk, s])
  q_nrm = core.norms_up(query)  # [b, t, h]
  k_nrm = core.norms_up(key)

  def qmajor(x):  # [b, t, h, ...] -> [b, hk, g, tp, ...]
    x = x.reshape(p.b, p.t, p.hk, p.g, *x.shape[3:])
    x = jnp.moveaxis(x, 1, 3)
    return _pad_axis(x, 3, p.tp, 0)

  # [b, s, hk, ...] (or [b, hk, s, ...] given 'bhsd') -> [b, hk, sp, ...]
  def kmajor(x, fill=0):
    x = x if kv == "bhsd" else jnp.moveaxis(x, 1, 2)
    return _pad_axis(x, 2, p.sp, fill)

  arr = dict(
    q=qmajor(query.astype(dt)),  # [b, hk, g, tp, d]
    q_nrm=qmajor(q_nrm),  # [b, hk, g, tp]
    q_fl=qmajor(q_fl),
    k=kmajor(key.astype(dt)),  # [b, hk, sp, d]
    v=kmajor(value.astype(dt)),  # [b, hk, sp, dv]
  )
  nb, bs = p.nb, p.bs
  kb = arr["k"].reshape(p.b, p.hk, nb, bs, p.d)
  sg = jax.lax.stop_gradient
  arr["blk_knrm"] = core.max_nan(kmajor(k_nrm).reshape(p.b, p.hk, nb, bs), -1)
  arr["blk_kfl"] = jnp.any(kmajor(k_fl, False).reshape(p.b, p.hk, nb, bs), -1)
  arr["blk_kabs"] = core.max_nan(jnp.abs(sg(kb)), axis=3)  # [b, hk, nb, d]
  if values_bound:
    if value_norms is None:
      value_norms = core.value_norms(sg(value))
    vn = kmajor(sg(value_norms))  # [b, hk, sp]; NaN = broken
    arr["vn"] = vn
    # A non-finite value of a key a row does not attend to must change
    # nothing (0 * inf is NaN in the weighted sum): zero it for the product.
    # A row that attends to one is still invalid through its NaN norm.
    v = arr["v"]
    arr["v"] = jnp.where(jnp.isfinite(v), v, jnp.zeros((), v.dtype))
    arr["blk_vn"] = core.max_nan(vn.reshape(p.b, p.hk, nb, bs), -1)
  if p.kind == "search":
    key_real = jnp.arange(p.sp) < p.s  # padding keys are not real
    box = theory.box_summary(sg(arr["k"]), block_size=bs, mask=key_real)
    arr["box"] = box
  arr["q_lens"], arr["kv_lens"], arr["q_offset"] = (
    None if x is None else jnp.asarray(x).astype(jnp.int32) for x in lens
  )
  arr["mask"] = _to5(mask, p.b, p.hk, p.g)
  arr["bias"] = _to5(bias, p.b, p.hk, p.g)
  for name, fill in (("mask", False), ("bias", 0.0)):
    x = arr[name]
    if x is not None and x.shape[3] != 1:
      arr[name] = _pad_axis(x, 3, p.tp, fill)
  if arr["bias"] is not None:
    arr["bias"] = arr["bias"].astype(dt)
  return arr, dt


def _key_range(c, q0):
  """The keys ``[lo, hi)`` each row of a tile may see by its structure.

  kv_len, ``is_causal``, ``local_window_size`` and the sequence lengths all
  cut a row's keys to one interval; a key outside it is not a real key (as
  if masked). A row at or past its query length sees none. Row i of
  sequence b sits at key position ``i + q_offset[b]`` (``i`` without an
  offset).

  Returns:
    ``(lo, hi)``, int32 ``[b|1, 1, 1, bq]``.
  """
  p = c.p
  row = (q0 + jnp.arange(p.bq, dtype=jnp.int32)).reshape(1, 1, 1, p.bq)
  qpos = row
  if c.arr["q_offset"] is not None:  # offset <= s - t: no overflow
    qpos = row + c.arr["q_offset"].reshape(p.b, 1, 1, 1)
  lo = jnp.zeros_like(qpos)
  hi = jnp.full_like(qpos, p.s)
  if p.causal:
    hi = jnp.minimum(hi, qpos + 1)
  if p.window is not None:
    left, right = p.window  # clipped to the sequence lengths: no overflow
    lo = jnp.maximum(lo, qpos - left)
    hi = jnp.minimum(hi, qpos + right + 1)
  kv_lens, q_lens = c.arr["kv_lens"], c.arr["q_lens"]
  if kv_lens is not None:
    hi = jnp.minimum(hi, kv_lens.reshape(p.b, 1, 1, 1))
  if q_lens is not None:
    hi = jnp.where(row >= q_lens.reshape(p.b, 1, 1, 1), lo, hi)
  return lo, jnp.maximum(hi, lo)


def _in_range(pos, lo, hi):
  """``pos`` ``[..., n]`` (same rank as ``lo[..., None]``) in [lo, hi)."""
  return (pos >= lo[..., None]) & (pos < hi[..., None])


def _visible_blocks(p, rng, nbl, mask_t):
  """``[b|1, hk|1, g|1, bq, nbl]`` bool: the block holds a key the row sees.

  Also returns the count of such keys ``[..., bq, nbl]`` (int32).
  """
  bs = p.bs
  lo, hi = (x[..., None] for x in rng)  # [b|1, 1, 1, bq, 1]
  start = (jnp.arange(nbl, dtype=jnp.int32) * bs).reshape(1, 1, 1, 1, nbl)
  cnt = jnp.minimum(hi, start + bs) - jnp.maximum(lo, start)
  cnt = jnp.clip(cnt, 0, bs)  # [b|1, 1, 1, bq, nbl]
  if mask_t is not None and mask_t.shape[4] != 1:
    # A full mask: count its True entries per block (one pass per tile).
    m = _pad_axis(mask_t[..., : nbl * bs], 4, nbl * bs, False)
    m = m.reshape(*m.shape[:4], nbl, bs)
    cols = jnp.arange(nbl * bs, dtype=jnp.int32).reshape(1, 1, 1, 1, nbl, bs)
    see = (cols >= lo[..., None]) & (cols < hi[..., None])
    cnt = jnp.sum(m & see, axis=-1, dtype=jnp.int32)
  elif mask_t is not None:  # broadcast over keys: all or nothing per row
    cnt = jnp.where(mask_t, cnt, 0)
  return cnt > 0, cnt


def _row_logit_error(p, arr, q_t, qn_t, qfl_t, vis_blk, bias_abs, scale):
  """``[b, hk, g, bq]`` delta: |computed - exact logit| for every key a row
  sees (``core.logit_error_bound`` over the blocks it can see)."""
  nbl = vis_blk.shape[-1]
  kn = arr["blk_knrm"][:, :, None, None, :nbl]  # [b, hk, 1, 1, nbl]
  k_norm = core.max_nan(jnp.where(vis_blk, kn, 0.0), -1)
  fl = arr["blk_kfl"][:, :, None, None, :nbl]
  k_fl = jnp.any(vis_blk & fl, -1)
  a = core.abs_dot_box(
    jax.lax.stop_gradient(q_t), arr["blk_kabs"][:, :, None, :nbl]
  )  # [b, hk, g, bq, nbl]
  abs_dot = core.max_nan(jnp.where(vis_blk, a, 0.0), -1)
  kam = jnp.max(arr["blk_kabs"][:, :, :nbl], -1)[:, :, None, None, :]
  return core.logit_error_bound(
    q_norm=qn_t,
    k_norm=k_norm,
    head_dim=p.d,
    scale=scale,
    abs_dot=abs_dot,
    q_flushed=qfl_t,
    k_flushed=k_fl,
    bias_abs=bias_abs,
    q_absmax=jnp.max(jnp.abs(jax.lax.stop_gradient(q_t)), -1),
    k_absmax=core.max_nan(jnp.where(vis_blk, kam, 0.0), -1),
  )


def _all_rows_logit_error(c):
  """``[nt, b, hk, g, bq]`` delta of every tile's rows, or None.

  A row's delta depends on its query and on the key blocks it can see,
  which the key ranges decide unless a mask varies along the keys or a
  bias is given (then each tile computes its own rows', ``_tile_delta``).
  One small loop over the tiles (over every key block, the ones a row
  cannot see masked) traces the bound's float-safe arithmetic once,
  instead of in every band's tile program (the causal bands held a copy
  each: a third of a Dense() prefill's code at T = 1,024).
  """
  p, arr = c.p, c.arr
  mask = arr["mask"]
  if arr["bias"] is not None or (mask is not None and mask.shape[4] != 1):
    return None

  def rows(i):
    rng, q_t, qn_t, qfl_t, mask_t, _ = _tile_rows(c, i)
    vis_blk, _ = _visible_blocks(p, rng, p.nb, mask_t)
    return _row_logit_error(p, arr, q_t, qn_t, qfl_t, vis_blk, None, c.scale)

  return jax.lax.stop_gradient(lax.map(rows, jnp.arange(p.nt)))


def _tile_delta(c, i, q_t, qn_t, qfl_t, vis_blk, bias_abs):
  """``[b, hk, g, bq]``: the tile's rows of ``_all_rows_logit_error``, else
  computed here."""
  if c.delta is not None:
    return lax.dynamic_index_in_dim(c.delta, i, 0, keepdims=False)
  return _row_logit_error(
    c.p, c.arr, q_t, qn_t, qfl_t, vis_blk, bias_abs, c.scale
  )


def _bias_abs(bias_cols, real):
  """max |bias| over a row's real keys whose bias is finite (or None)."""
  if bias_cols is None:
    return None
  b = jax.lax.stop_gradient(bias_cols)
  ok = real & jnp.isfinite(b)
  return jnp.max(jnp.where(ok, jnp.abs(b), 0.0), -1)


# ---------------------------------------------------------------------------
# The two engines. A tile function returns (core.PartialSoftmax, keep or None)
# for
# rows [i bq, (i + 1) bq) of every batch and head.


@dataclasses.dataclass
class _Ctx:
  """What every tile of one call reads (arrays are traced)."""

  p: _Plan
  arr: dict
  dt: object
  policy: object
  scale: object
  values_bound: bool
  return_keep: bool
  first_round: int
  scan_all_share: float | None
  delta: jax.Array | None = None  # _all_rows_logit_error, if it applies


def _tile_rows(c, i):
  """The tile's key ranges, queries, their norms and flush flags, mask and
  bias rows."""
  q0 = i * c.p.bq
  sl = lambda x: lax.dynamic_slice_in_dim(x, q0, c.p.bq, axis=3)  # noqa: E731
  return (
    _key_range(c, q0),  # (lo, hi) [b|1, 1, 1, bq]
    sl(c.arr["q"]),  # [b, hk, g, bq, d]
    sl(c.arr["q_nrm"]),  # [b, hk, g, bq]
    sl(c.arr["q_fl"]),
    _rows_of(c.arr["mask"], q0, c.p.bq),
    _rows_of(c.arr["bias"], q0, c.p.bq),
  )


def _pv(v):
  """The value_fn of ``core.PartialSoftmax.from_logits``: weights times
  values."""
  return lambda w: jnp.einsum("bkgqs,bksd->bkgqd", w, v, precision=HIGHEST)


def _scan_all_tile(c, length, i):
  """One query tile against every key in [0, length) it can see."""
  p, arr = c.p, c.arr
  rng, q_t, qn_t, qfl_t, mask_t, bias_t = _tile_rows(c, i)
  cols = jnp.arange(length, dtype=jnp.int32).reshape(1, 1, 1, 1, length)
  real = _in_range(cols, *rng)  # [b|1, 1, 1, bq, L]
  if mask_t is not None:
    real = real & (mask_t if mask_t.shape[4] == 1 else mask_t[..., :length])
  k = arr["k"][:, :, :length]  # [b, hk, L, d]
  s = jnp.einsum("bkgqd,bksd->bkgqs", q_t, k, precision=HIGHEST)
  s = s * c.scale  # [b, hk, g, bq, L]
  bias_cols = None
  if bias_t is not None:
    bias_cols = bias_t if bias_t.shape[4] == 1 else bias_t[..., :length]
    s = s + bias_cols
  real = jnp.broadcast_to(real, s.shape)
  vis_blk, _ = _visible_blocks(p, rng, _cdiv(length, p.bs), mask_t)
  delta = _tile_delta(
    c, i, q_t, qn_t, qfl_t, vis_blk, _bias_abs(bias_cols, real)
  )  # [b, hk, g, bq]
  sgs = jax.lax.stop_gradient(s)
  pos = real & (sgs > -jnp.inf)
  # A search tile that runs this (``_flat``) keeps its own count of terms,
  # which its certificate's margin uses.
  n_keys = p.sp + p.nb if p.kind == "search" else p.s
  keep = internal.keep_mask(
    sgs, c.policy, pos, logit_error=delta, n_keys=n_keys, coarse=True
  )
  vn = arr["vn"][:, :, None, None, :length] if c.values_bound else None
  part = core.PartialSoftmax.from_logits(
    s,
    keep,
    real,
    logit_error=delta,
    value_fn=_pv(arr["v"][:, :, :length]),
    value_norms=vn,
  )
  full = _pad_axis(keep, 4, p.sp, False) if c.return_keep else None
  return part, full


def _round_sizes(nb, first):
  """Blocks scored per round: first, first, 2 first, 4 first, ... (sum nb)."""
  sizes, total, r = [], 0, max(1, min(first, nb))
  while total < nb:
    r = min(r, nb - total)
    sizes.append(r)
    total += r
    r = total  # each later round doubles the total
  return sizes


def _search_tile(c, i):
  """One query tile: Delta-Search over key blocks in batched rounds."""
  p, arr, dt, policy = c.p, c.arr, c.dt, c.policy
  bs, nb = p.bs, p.nb
  sg = jax.lax.stop_gradient
  rng, q_t, qn_t, qfl_t, mask_t, bias_t = _tile_rows(c, i)
  lead = (p.b, p.hk, p.g, p.bq)
  vis_blk, cnt = _visible_blocks(p, rng, nb, mask_t)
  vis_blk = jnp.broadcast_to(vis_blk, (*lead, nb))
  cnt = jnp.broadcast_to(cnt, (*lead, nb))

  # A full-width mask or bias is read at the gathered key positions.
  def at_cols(x, pos):
    x = jnp.broadcast_to(x, (*lead, x.shape[4]))
    pc = jnp.minimum(pos, p.s - 1)[:, :, None, None, :]
    pc = jnp.broadcast_to(pc, (*lead, pc.shape[-1]))
    return jnp.take_along_axis(x, pc, -1)

  bias_blk = bias_abs = None
  if bias_t is not None:
    bias_blk, bias_abs = _bias_blocks(p, sg(bias_t), rng, mask_t, vis_blk)
  delta = _tile_delta(c, i, q_t, qn_t, qfl_t, vis_blk, bias_abs)

  # Sound bound on each block's EXACT logits, per row: the box bound on the
  # logits of the inputs as read (rounding included), widened by delta
  # (which covers what flushed subnormal inputs drop), plus the block's
  # largest bias. log_mass = log(count e^u); +inf (scored first, never
  # certified away) where the bound is not a number or a value is broken.
  u = internal.box_upper_bound_dot(
    sg(q_t).reshape(p.b, p.hk, p.g * p.bq, p.d), arr["box"], scale=c.scale
  ).reshape(*lead, nb)
  u = u + delta[..., None]
  if bias_blk is not None:
    u = _round_up(u + bias_blk)
  log_mass = u + jnp.log(jnp.maximum(cnt, 1).astype(dt))
  log_mass = jnp.where(jnp.isnan(log_mass), jnp.inf, log_mass)
  if c.values_bound:
    bad = jnp.isnan(arr["blk_vn"])[:, :, None, None, :]
    log_mass = jnp.where(bad, jnp.inf, log_mass)
  log_mass = jnp.where(vis_blk, log_mass, -jnp.inf)  # [b, hk, g, bq, nb]
  # THEORY 6.4: each row reads the boxes of the blocks it sees (2 keys'
  # bytes each) to bound them.
  n_box = 2 * jnp.sum(vis_blk, -1, dtype=jnp.int32)

  n_terms = p.sp + nb
  target = jnp.log(jnp.asarray(policy.eps, dt)) - core.search_log_margin(
    n_terms, delta, dt
  )
  kb = arr["k"].reshape(p.b, p.hk, nb, bs, p.d)
  vb = arr["v"].reshape(p.b, p.hk, nb, bs, p.dv)

  def unscored_log(scored_blk):
    lm = jnp.where(scored_blk[:, :, None, None, :], -jnp.inf, log_mass)
    return logsumexp(lm, axis=-1)  # [b, hk, g, bq]; -inf when none

  def certified(lse_s, log_un):
    """THEORY 6.2's stopping rule with every scored key kept."""
    norm = jnp.logaddexp(lse_s, log_un)
    return (log_un == -jnp.inf) | (log_un - norm <= target), norm

  def key_pos(idx):
    """Key positions ``[b, hk, R bs]`` of blocks ``idx`` ``[b, hk, R]``."""
    offs = jnp.arange(bs, dtype=idx.dtype).reshape(1, 1, 1, bs)
    return (idx[..., None] * bs + offs).reshape(*idx.shape[:2], -1)

  def score(idx, ok):
    """Logits (with gradient) and real-key mask of blocks ``idx``."""
    r = idx.shape[-1]
    kg = jnp.take_along_axis(kb, idx[..., None, None], axis=2)
    kg = kg.reshape(p.b, p.hk, r * bs, p.d)  # [b, hk, r bs, d]
    s = jnp.einsum("bkgqd,bksd->bkgqs", q_t, kg, precision=HIGHEST)
    s = s * c.scale  # [b, hk, g, bq, r bs]
    pos = key_pos(idx)
    real = (jnp.repeat(ok, bs, axis=-1) & (pos < p.s))[:, :, None, None, :]
    real = real & _in_range(pos[:, :, None, None, :], *rng)
    if mask_t is not None:
      real = real & (mask_t if mask_t.shape[4] == 1 else at_cols(mask_t, pos))
    if bias_t is not None:
      s = s + (bias_t if bias_t.shape[4] == 1 else at_cols(bias_t, pos))
    return s, jnp.broadcast_to(real, s.shape)

  def lse_pos(s, real):
    ok = real & (s > -jnp.inf)
    lse = logsumexp(s, axis=-1, where=ok)
    return jnp.where(jnp.any(ok, -1), lse, -jnp.inf)

  def finish(chunks, scored_blk):
    log_un = unscored_log(scored_blk)
    idx = jnp.concatenate([x[0] for x in chunks], -1)  # [b, hk, S]
    s = jnp.concatenate([x[1] for x in chunks], -1)  # [b, hk, g, bq, S bs]
    real = jnp.concatenate([x[2] for x in chunks], -1)
    r = idx.shape[-1]
    sgs = sg(s)
    pos = real & (sgs > -jnp.inf)
    keep = internal.keep_mask(
      sgs,
      policy,
      pos,
      logit_error=delta,
      n_keys=n_terms,
      log_extra=log_un,
      coarse=True,
    )
    vg = jnp.take_along_axis(vb, idx[..., None, None], axis=2)
    vn = norms = None
    if c.values_bound:
      vnb = arr["vn"].reshape(p.b, p.hk, nb, bs)
      vn = jnp.take_along_axis(vnb, idx[..., None], axis=2)
      vn = vn.reshape(p.b, p.hk, 1, 1, r * bs)
      bn = jnp.where(jnp.isnan(arr["blk_vn"]), 0.0, arr["blk_vn"])
      norms = jnp.broadcast_to(bn[:, :, None, None, :], (*lead, nb))
    part = core.PartialSoftmax.from_logits(
      s,
      keep,
      real,
      logit_error=delta,
      value_fn=_pv(vg.reshape(p.b, p.hk, r * bs, p.dv)),
      value_norms=vn,
    )
    unscored = vis_blk & ~scored_blk[:, :, None, None, :]
    part = part.add_tail(log_mass, unscored, norms=norms)
    part = dataclasses.replace(part, keys_scored=part.keys_scored + n_box)
    full = None
    if c.return_keep:
      cols = jnp.broadcast_to(key_pos(idx)[:, :, None, None, :], keep.shape)
      # A round slot with no block left to score repeats some block index
      # (possibly a scored one): only kept keys are written (positions of
      # kept keys are unique), the rest dropped out of range.
      cols = jnp.where(keep, cols, p.sp)
      full = jnp.zeros((*lead, p.sp), bool)
      full = jnp.put_along_axis(
        full, cols, keep, -1, inplace=False, mode="drop"
      )
    return part, full

  sizes = _round_sizes(nb, c.first_round)

  def run(j, chunks, scored_blk, lse_s):
    log_un = unscored_log(scored_blk)
    done, norm = certified(lse_s, log_un)
    # Priority of a block: its bound relative to the mass of the rows that
    # still need blocks (the largest over those rows).
    # (A row whose norm is still +inf, from a block with an infinite bound,
    # ranks its blocks by their bound alone: every block a row still needs
    # has a priority above -inf, so the rounds, whose sizes add up to nb,
    # score all of them before the last round ends.)
    norm = jnp.where(jnp.isfinite(norm), norm, 0.0)
    rel = sg(log_mass) - norm[..., None]
    rel = jnp.where(jnp.isnan(rel), jnp.inf, rel)
    rel = jnp.where(done[..., None], -jnp.inf, rel)
    prio = jnp.where(scored_blk, -jnp.inf, jnp.max(rel, axis=(2, 3)))
    val, idx = lax.top_k(prio, sizes[j])  # [b, hk, R]
    ok = val > -jnp.inf
    s, real = score(idx, ok)
    lse_s = jnp.logaddexp(lse_s, lse_pos(sg(s), real))
    hit = (idx[..., None] == jnp.arange(nb).reshape(1, 1, 1, nb)) & ok[
      ..., None
    ]
    scored_blk = scored_blk | jnp.any(hit, axis=-2)  # [b, hk, nb]
    chunks = [*chunks, (idx, s, real)]
    if j == len(sizes) - 1:
      return finish(chunks, scored_blk)
    done, _ = certified(lse_s, unscored_log(scored_blk))
    return lax.cond(
      jnp.all(done),
      lambda ch, sb, ls: finish(ch, sb),
      lambda ch, sb, ls: run(j + 1, ch, sb, ls),
      chunks,
      scored_blk,
      lse_s,
    )

  def scan_all():
    part, full = _scan_all_tile(c, p.s, i)
    part = dataclasses.replace(part, keys_scored=part.keys_scored + n_box)
    return part, full

  lse0 = jnp.full(lead, -jnp.inf, dt)

  def search():
    return run(0, [], jnp.zeros((p.b, p.hk, nb), bool), lse0)

  share = c.scan_all_share
  if (share is None and nb < FLAT_MIN_BLOCKS) or (share or 0) > 1:
    return search()  # (the switch would compile a second engine)
  most = sum(sizes[:-1]) + 1 if share is None else share * nb
  return lax.cond(_flat(log_mass, policy.eps, most), scan_all, search)


def _flat(log_mass, eps, most):
  """Whether the search of every kv head's rows must score at least
  ``most`` blocks: then one product over every key costs less than the
  rounds.

  A row's search stops only once its unscored blocks' bound U_rest is at
  most eps (Z_S + U_rest) <= eps U (Z_S, the scored mass, is at most the
  bound of the scored blocks; U the bound of all), so it scores bounds worth
  T = (1 - eps) U. With the bounds u_j relative to the largest (each <= 1)
  that is at least T blocks; and for tau < 1, where the c blocks with u_j
  >= tau sum to B < T, more than c blocks, each other one adding < tau:
  at least c + (T - B) / tau. Every block with u_j > eps U is among them,
  and the tile scores the union of its rows' blocks.
  """
  top = jnp.max(log_mass, -1, keepdims=True)  # [b, hk, g, bq, 1]
  u = jnp.exp(log_mass - jnp.where(jnp.isfinite(top), top, 0.0))
  target = (1 - eps) * jnp.sum(u, -1)
  need = target  # each block's bound is at most 1
  for tau in (0.5, 0.25, 0.125, 0.0625):
    high = u >= tau
    b_high = jnp.sum(jnp.where(high, u, 0.0), -1)
    c = jnp.sum(high, -1).astype(u.dtype)
    need = jnp.maximum(
      need, jnp.where(target > b_high, c + (target - b_high) / tau, 0.0)
    )
  ok = jnp.isfinite(top[..., 0])
  need = jnp.max(jnp.where(ok, need, 0.0), (2, 3))  # [b, hk]
  sure = (u > eps * jnp.sum(u, -1, keepdims=True)) & ok[..., None]
  union = jnp.sum(jnp.any(sure, (2, 3)), -1).astype(need.dtype)
  return jnp.all(jnp.maximum(need, union) >= most)


def _bias_blocks(p, bias_t, rng, mask_t, vis_blk):
  """Per row and key block: the largest bias (NaN propagates), and per row
  the largest finite |bias| over the keys it sees."""
  nb, bs = p.nb, p.bs
  if bias_t.shape[4] == 1:
    blk = jnp.broadcast_to(bias_t, (*bias_t.shape[:4], nb))
    fin = jnp.isfinite(bias_t[..., 0]) & jnp.any(vis_blk, -1)
    return blk, jnp.where(fin, jnp.abs(bias_t[..., 0]), 0.0)
  bp = _pad_axis(bias_t[..., : p.s], 4, p.sp, -jnp.inf)
  bp = bp.reshape(*bp.shape[:4], nb, bs)  # [.., bq, nb, bs]
  cols = jnp.arange(p.sp, dtype=jnp.int32).reshape(1, 1, 1, 1, nb, bs)
  lo, hi = (x[..., None, None] for x in rng)  # [b|1, 1, 1, bq, 1, 1]
  see = (cols >= lo) & (cols < hi)  # [b|1, 1, 1, bq, nb, bs]
  if mask_t is not None:
    if mask_t.shape[4] == 1:
      see = see & mask_t[..., None]
    else:
      mp = _pad_axis(mask_t[..., : p.s], 4, p.sp, False)
      see = see & mp.reshape(*mp.shape[:4], nb, bs)
  fin = see & jnp.isfinite(bp)
  return jnp.max(bp, -1), jnp.max(jnp.where(fin, jnp.abs(bp), 0.0), (-2, -1))


# ---------------------------------------------------------------------------
# The driver.


def _bands(nt, max_bands):
  """Consecutive tile ranges [(i0, i1)], at most ``max_bands`` of them.

  Each band holds at least two tiles where there are two: on XLA:CPU a band
  of one tile cost more than the keys above the diagonal it saves (Dense,
  causal, batch 2, 4 heads, head_dim 64, tiles of 256 rows: 73 ms in four
  one-tile bands against 40 ms in two bands of two at T = 1,024; 239 ms
  against 116 ms at T = 2,048; jax.nn 42 and 152 ms).
  """
  n = max(1, min(nt // 2, max_bands))
  edges = [round(j * nt / n) for j in range(n + 1)]
  return [(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


def blockwise_attention(
  query,
  key,
  value,
  *,
  policy,
  mask=None,
  bias=None,
  is_causal=False,
  scale,
  scale_ok=True,
  q_lens=None,
  kv_lens=None,
  window=None,
  values_bound=True,
  block_sizes=None,
  return_lse=False,
  return_keep=False,
  q_offset=None,
  kv_layout="bshd",
  value_norms=None,
):
  """Blockwise Top-k attention (see the module docstring); arguments checked.

  Args:
    query: ``[batch, q_len, num_heads, head_dim]`` (q_len >= 1).
    key: ``[batch, kv_len, num_kv_heads, head_dim]`` (kv_len >= 1).
    value: ``[batch, kv_len, num_kv_heads, head_dim_v]``.
    policy: a policy this path supports (``SUPPORTS``).
    mask: None or bool broadcastable to ``[batch, num_heads, q_len, kv_len]``.
    bias: None or float, same broadcasting; -inf = a key of zero mass.
    is_causal: top-left aligned causal mask (Python bool).
    scale: logit scale, a Python float or a 0-d array (traced is fine).
    scale_ok: bool (or 0-d array): whether a traced scale is finite and >=
      ``core.MIN_SCALE``.
    q_lens: None or ``[batch]`` int: query rows at or past it see no key.
    kv_lens: None or ``[batch]`` int: keys at or past it are not real.
    window: None or static ``(left, right)`` ints >= 0: query i sees keys
      [i - left, i + right] only (``local_window_size``).
    values_bound: whether the certificate carries output_error_bound.
    block_sizes: ``BlockSizes`` (default ``BlockSizes.get_default()``).
    return_lse: also return the log-sum-exp of the logits the output was
      computed from (its kept keys), ``[batch, q_len, num_heads]`` in the
      compute dtype; ``core.finite_log`` on a row that keeps no key.
    return_keep: also return the kept set ``[batch, num_heads, q_len,
      kv_len]`` (tests and analysis only: it is the size of the logits).
    q_offset: None or ``[batch]`` int: query row i of sequence b sits at
      key position ``i + q_offset[b]`` (causal and the window are relative
      to it; a row at a negative position sees no key); at most ``kv_len -
      q_len`` (a cache's newest steps: ``length - q_len``).
    kv_layout: 'bshd' (the jax.nn layout above) or 'bhsd' (keys and values
      ``[batch, num_kv_heads, kv_len, head_dim]``, a KVCache's).
    value_norms: None or the values' ``core.value_norms`` in their layout
      without the last axis (a cache's stored norms), else computed.

  Returns:
    ``(output, certificate, lse, keep)``: output ``[batch, q_len, num_heads,
    head_dim_v]`` in query's dtype, Certificate arrays ``[batch, q_len,
    num_heads]``; ``lse`` and ``keep`` None unless asked for.
  """
  bsz = block_sizes or BlockSizes.get_default()
  b, t, h, d = query.shape
  s, hk = (
    (key.shape[2], key.shape[1]) if kv_layout == "bhsd" else key.shape[1:3]
  )
  kind = kind_of(policy, s)
  bs = policy.block_size if kind == "search" else min(_SUMMARY_BLOCK, s)
  bq = min(bsz.block_q, t)
  if block_sizes is None and b * h * bq * s > TILE_LOGITS:
    bq = min(bq, MIN_WIDE_BLOCK_Q)
  if window is not None:  # beyond the sequences a window changes nothing
    window = (min(window[0], t if q_offset is None else s), min(window[1], s))
  plan = _Plan(
    b=b,
    t=t,
    h=h,
    hk=hk,
    g=h // hk,
    d=d,
    dv=value.shape[-1],
    s=s,
    bq=bq,
    tp=_cdiv(t, bq) * bq,
    bs=bs,
    sp=_cdiv(s, bs) * bs,
    causal=bool(is_causal),
    window=window,
    kind=kind,
  )
  lens = (q_lens, kv_lens, q_offset)
  arr, dt = _prepare(
    query,
    key,
    value,
    mask,
    bias,
    lens,
    plan,
    values_bound,
    kv_layout,
    value_norms,
  )
  ctx = _Ctx(
    p=plan,
    arr=arr,
    dt=dt,
    policy=policy,
    scale=jnp.asarray(scale, dt) if not isinstance(scale, float) else scale,
    values_bound=values_bound,
    return_keep=return_keep,
    first_round=bsz.first_round,
    scan_all_share=bsz.scan_all_share,
  )
  ctx = dataclasses.replace(ctx, delta=_all_rows_logit_error(ctx))
  n_terms = plan.sp + plan.nb if kind == "search" else s

  def tile(fn):
    # The backward recomputes a tile, but keeps its rows' budget thresholds
    # (a few floats per row) rather than running the histogram passes again.
    return jax.checkpoint(
      fn, policy=jax.checkpoint_policies.save_only_these_names(RESIDUAL)
    )

  if kind == "search":
    groups = [((0, plan.nt), functools.partial(_search_tile, ctx))]
  else:
    # A band's last row sees keys below i1 bq (causal) or i1 bq + right
    # (a window), shifted by the largest offset, s - t; without either
    # every row may see every key.
    reach = 0 if plan.causal else None
    if window is not None:
      reach = window[1] if reach is None else min(reach, window[1])
    if reach is not None and q_offset is not None:
      reach += s - t
    # Bands pay where the rows see few keys above the first band's; a
    # chunk of the newest t <= s / 4 steps wastes at most t / 2 of s keys
    # per row in one band, and compiles one tile program instead of eight.
    one = reach is None or (q_offset is not None and 4 * t <= s)
    ranges = [(0, plan.nt)] if one else _bands(plan.nt, bsz.max_bands)

    def length(i1):
      return s if reach is None else min(s, i1 * bq + reach)

    groups = [
      ((i0, i1), functools.partial(_scan_all_tile, ctx, length(i1)))
      for i0, i1 in ranges
    ]
  outs = [lax.map(tile(fn), jnp.arange(i0, i1)) for (i0, i1), fn in groups]
  part, keep = jax.tree.map(lambda *x: jnp.concatenate(x, 0), *outs)
  # The certificate is finished once, on every tile's per-row statistics
  # ([nt, b, hk, g, bq] each), not in each band's tile program, where the
  # gradient also recomputed row validity inside every tile (a causal
  # Dense() prefill's gradient at T = 1,024, 2 bands: 8,960 -> 6,830
  # optimised HLO lines; docs/performance.md "Flax layers").
  o, cert = part.finalize(n_terms=n_terms, scale_ok=scale_ok)
  lse = None
  if return_lse:  # log 0 for a row with no key of mass, NaN if broken
    empty = (part.denom == 0) & (part.tail_sum == 0) & part.logits_ok
    lse = core.log_sum_exp_residual(part.log_head, cert.valid, empty)

  def to_bth(x):  # [nt, b, hk, g, bq, ...] -> [b, t, h, ...]
    x = jnp.moveaxis(x, 0, 3)  # [b, hk, g, nt, bq, ...]
    x = x.reshape(b, hk, plan.g, plan.tp, *x.shape[5:])[:, :, :, :t]
    x = jnp.moveaxis(x, 3, 1)  # [b, t, hk, g, ...]
    return x.reshape(b, t, h, *x.shape[4:])

  out = to_bth(o).astype(query.dtype)
  cert = jax.tree.map(to_bth, cert)
  if return_lse:
    lse = core.finite_log(to_bth(lse))
  if return_keep:
    keep = jnp.moveaxis(keep, 0, 3).reshape(b, hk, plan.g, plan.tp, plan.sp)
    keep = keep[:, :, :, :t, :s].reshape(b, h, t, s)
  return out, cert, lse, keep
