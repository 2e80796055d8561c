"""Certified split-K decode: Delta-Search over a head-major KV cache.

One query per head against a long cache ``[b, kv_heads, n, d]`` (THEORY 6.2,
DESIGN "one decode step"):

1. Outside the kernel (XLA): box summaries of the cache blocks give an upper
   bound u_b on every EXACT logit of block b (``box_upper_bound_dot`` plus
   the logit rounding bound delta of ``core.logit_error_bound``, which also
   covers subnormal inputs that the CPU reads as 0; THEORY 3.3, 3.4);
   blocks are ordered by u_b, largest first, and dealt round-robin to
   ``num_splits`` splits (split s gets ordered positions s, s + S, ...). For
   each split and position j the remaining bound R_s(j) = log sum_{its
   positions > j} |B| e^{u_b} is precomputed, and per row the stopping
   level log c, c = e^t / (1 - e^t), t = log eps minus the certificate's
   margin (``core.search_log_margin``).
2. The kernel (one program per query head and split; ``_decode_tpu`` and
   ``_decode_gpu`` are the two grid styles, ``_decode_step`` their shared
   body) scores its blocks in order with ``core.online_step`` (normalised
   output, rounding tracked) and stops after position j as soon as
   R_s(j) <= log c_s + log(Z_s + F_s) (Delta-Search's rule, per split).
   The floor F_s shares out the mass L of the highest-bounded block, which
   split 0 scores first (``top_block_log_mass``, computed in XLA): F_s =
   L / S for the other splits, which may then stop before scoring anything
   (a live count of 0), and split 0's c is divided by S (``split_levels``).
   The shares sum to at most Z_H, so if every split stops this way, tau <=
   U / (Z_H + U) <= e^t <= eps. Without the floor a split could only
   compare its bounds with its own scored mass: one that holds no heavy
   block scored nearly all of its blocks (76-81% of the keys kept at tv
   1e-4 to 3e-3 for eps 0.01 on the H200 benchmark).
3. The certificate comes from the core only: each split's statistics are a
   ``core.PartialSoftmax`` (``from_stats``), merged by
   ``PartialSoftmax.reduce`` (split-K),
   with the unscored blocks' bounds added to the tail (``add_tail``), and
   ``finalize`` bounds tau by what was really scored, whatever the stopping
   decisions were.

Policy fields (``jaxtopk.kernels._backend``): the search is Delta-Search
with the box bound; ``max_topk`` caps the scored blocks (one split, at most
``max_topk // block_k`` blocks: the kept set is whole scored blocks).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.special import logsumexp

from jaxtopk import theory
from jaxtopk.kernels import _common
from jaxtopk.kernels import _decode_gpu
from jaxtopk.kernels import _decode_tpu
from jaxtopk.selection import Certificate
from jaxtopk.selection import core
from jaxtopk.selection.internal import box_upper_bound_dot

_RUN = {"tpu": _decode_tpu.run, "gpu": _decode_gpu.run}


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the decode kernel.

  Attributes:
    block_k: keys per cache block (TPU: multiple of 8; GPU: power of 2).
    num_splits: split-K programs per query head.
  """

  block_k: int = 128
  num_splits: int = 8

  @classmethod
  def get_default(cls) -> "BlockSizes":
    return cls()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodePlan:
  """Visiting order of the cache blocks (computed in XLA, outside kernels).

  Attributes:
    order: ``[b, h, S, bps]`` int32 block index per split and position
      (padding positions repeat the split's last live block).
    rest: ``[b, h, S, bps]`` float32 log bound on the mass of the split's
      blocks after each position (``MASK_VALUE`` when none is left).
    n_live: ``[b, h, S]`` int32 positions the split may score (blocks with
      real keys, capped by ``max_blocks``).
    total: ``[b, h, S]`` float32 log bound on the mass of all the split's
      live blocks (-inf when none; +inf for a NaN bound).
    upper: ``[b, h, n_blocks]`` float32 bounds u_b on the exact logits.
    count: ``[b, h, n_blocks]`` int32 real keys per block.
  """

  order: jax.Array
  rest: jax.Array
  n_live: jax.Array
  total: jax.Array
  upper: jax.Array
  count: jax.Array


def plan(
  query,
  box: theory.BoxSummary,
  *,
  scale,
  num_splits: int,
  delta=None,
  max_blocks: int | None = None,
):
  """Orders blocks by their logit bound and deals them to splits (XLA).

  Args:
    query: ``[b, h, d]``.
    box: key boxes ``[b, h_kv, n_blocks, d]``, counts ``[b, h_kv or 1,
      n_blocks]`` (``theory.box_summary`` or a KVCache's incremental one).
    scale: logit scale.
    num_splits: split-K programs per head.
    delta: optional ``[b, h]`` logit rounding bound, added to the box bounds
      (which then bound the EXACT logits).
    max_blocks: optional cap on the positions scored per split.
  """
  b, h, d = query.shape
  hkv = box.kmin.shape[1]
  g = h // hkv
  count = jnp.broadcast_to(box.count, box.kmin.shape[:3])  # [b, hkv, nb]
  box = theory.BoxSummary(kmin=box.kmin, kmax=box.kmax, count=count)
  q = query.reshape(b, hkv, g, d)
  upper = box_upper_bound_dot(q, box, scale=scale).reshape(b, h, -1)
  if delta is not None:
    upper = upper + delta[..., None]
  count = jnp.repeat(count, g, axis=1)  # [b, h, nb]
  nb = upper.shape[-1]
  bps = _common.cdiv(nb, num_splits)
  total = bps * num_splits
  order = jnp.argsort(-upper, axis=-1, stable=True).astype(jnp.int32)
  order = jnp.pad(order, ((0, 0), (0, 0), (0, total - nb)))
  live = jnp.take_along_axis(count, jnp.minimum(order, nb - 1), -1) > 0
  live = live & (jnp.arange(total) < nb)
  logw = jnp.where(
    live,
    jnp.log(jnp.maximum(jnp.take_along_axis(count, order, -1), 1))
    + jnp.take_along_axis(upper, jnp.minimum(order, nb - 1), -1),
    -jnp.inf,
  )
  # Round-robin: position p -> split p % S, slot p // S.
  order = order.reshape(b, h, bps, num_splits).swapaxes(2, 3)
  logw = logw.reshape(b, h, bps, num_splits).swapaxes(2, 3)
  live = live.reshape(b, h, bps, num_splits).swapaxes(2, 3)
  n_live = jnp.sum(live, axis=-1, dtype=jnp.int32)  # live come first
  if max_blocks is not None:
    n_live = jnp.minimum(n_live, max_blocks)
  suffix = lax.cumlogsumexp(logw, axis=3, reverse=True)
  rest = jnp.concatenate(
    [suffix[..., 1:], jnp.full_like(suffix[..., :1], -jnp.inf)], axis=-1
  )
  rest = jnp.where(rest > -jnp.inf, rest, _common.MASK_VALUE)
  rest = jnp.where(jnp.isnan(rest), jnp.inf, rest)  # never stop on NaN
  total = jnp.where(jnp.isnan(suffix[..., 0]), jnp.inf, suffix[..., 0])
  last = jnp.take_along_axis(order, jnp.maximum(n_live - 1, 0)[..., None], -1)
  order = jnp.where(jnp.arange(bps) < n_live[..., None], order, last)
  return DecodePlan(
    order,
    rest.astype(jnp.float32),
    n_live,
    total.astype(jnp.float32),
    upper,
    count,
  )


def stop_level(eps, delta, n_terms):
  """``[...]`` log c of the per-split rule (see the module docstring)."""
  dt = delta.dtype
  margin = core.search_log_margin(n_terms, delta, dt)
  t = (math.log(eps) if eps > 0 else -jnp.inf) - margin
  log_c = t - jnp.log1p(-jnp.exp(t))
  return jnp.maximum(log_c, _common.MASK_VALUE).astype(jnp.float32)


def top_block_log_mass(query, key, mask, pl_, delta, *, scale, block_k):
  """``[b, h]`` log of a lower bound on the mass of each row's first block.

  The block at split 0's first position (the highest bound), scored here in
  XLA (a gather of its keys only): its logits lowered by 2 delta (the
  kernel's computed logits are within delta of the exact ones, as these
  are), the log-sum-exp by the core's rounding of two block-sized sums
  (``core.log_slack``) and of their magnitudes (``core.round_down``), so L
  <= the mass the kernel computes for it. -inf for a row whose block holds
  no real key or a non-finite logit.
  """
  b, h, _ = query.shape
  hkv, n = key.shape[1], key.shape[2]
  top = pl_.order[:, :, 0, 0]  # [b, h]
  pos = top[..., None] * block_k + jnp.arange(block_k)  # [b, h, bk]
  inside = pos < n
  pos = jnp.minimum(pos, n - 1)
  bi = jnp.arange(b)[:, None, None]
  kv_head = (jnp.arange(h) // (h // hkv))[None, :, None]
  blk = key[bi, kv_head, pos]  # [b, h, bk, d]
  s = (
    jnp.einsum(
      "bhd,bhkd->bhk",
      query.astype(jnp.float32),
      blk.astype(jnp.float32),
      precision=_common.PRECISION,
    )
    * scale
  )
  real = inside
  if mask is not None:
    real = real & jnp.asarray(mask, bool)[bi, pos]
  lse = logsumexp(s - 2 * delta[..., None], axis=-1, where=real)
  lse = core.round_down(lse - 2 * core.log_slack(block_k, jnp.float32))
  return jnp.where(jnp.isfinite(lse), lse, -jnp.inf)


def split_levels(pl_: DecodePlan, log_c, log_top):
  """Per-split stopping levels: ``(plan, log c_s, log F_s)`` ``[b, h, S]``.

  Split 0 scores the block of mass >= L = e^log_top first; it keeps the
  rule c Z_0 / S, every other split gets c (Z_s + L / S): the shares sum to
  c (Z_0 / S + Z_rest + (S - 1) L / S) <= c Z. A split whose whole bound is
  already within c L / S scores nothing (its live count becomes 0). One
  split (``max_blocks``): the plain rule c Z_0.
  """
  ns = pl_.order.shape[2]
  first = jnp.arange(ns) == 0  # [S]
  log_c = log_c[..., None]
  log_c_s = jnp.where(first, log_c - math.log(ns), log_c)
  log_c_s = jnp.maximum(log_c_s, _common.MASK_VALUE).astype(jnp.float32)
  log_f = jnp.where(first, -jnp.inf, (log_top - math.log(ns))[..., None])
  # eps = 0 (log c at MASK_VALUE): no floor, every block is scored.
  log_f = jnp.where(log_c > _common.MASK_VALUE, log_f, -jnp.inf)
  log_f = log_f.astype(jnp.float32)
  idle = (pl_.total <= log_c_s + log_f) & ~first
  n_live = jnp.where(idle, 0, pl_.n_live)
  return dataclasses.replace(pl_, n_live=n_live), log_c_s, log_f


def _kv_mask(mask, key):
  if mask is None:
    return None
  return jnp.broadcast_to(jnp.asarray(mask, bool)[:, None, :], key.shape[:3])


def _run_kernel(query, key, value, mask, pl_, levels, cfg):
  scale, bs, backend, interpret = cfg
  b, h, d = query.shape
  hkv, n, dv = key.shape[1], key.shape[2], value.shape[3]
  bk, ns = bs.block_k, pl_.order.shape[2]
  dv_out = dv
  if backend == "gpu":  # power-of-2 dims (exact zero terms and columns)
    query, key, value = map(_common.pad_last_for_triton, (query, key, value))
    d, dv = query.shape[-1], value.shape[-1]
  kp = _common.pad_to(key, 2, bk).reshape(b * hkv, -1, d)
  vp = _common.pad_to(value, 2, bk).reshape(b * hkv, -1, dv)
  n_p = kp.shape[1]
  kvm = _common.pad_to(_common.kv_mask_array(mask, b, n), 2, bk)
  kvm = kvm.reshape(b, n_p, 1)
  o, m, ell, err, n_scored = _RUN[backend](
    query.reshape(b * h, 1, d),
    kp,
    vp,
    kvm,
    pl_.order.reshape(b * h, ns, -1),
    pl_.n_live.reshape(b * h, ns),
    pl_.rest.reshape(b * h, ns, -1),
    levels[0].reshape(b * h, ns),
    levels[1].reshape(b * h, ns),
    heads=h,
    kv_heads=hkv,
    block_k=bk,
    scale=scale,
    interpret=interpret,
  )
  return (
    o.reshape(b, h, ns, dv)[..., :dv_out],
    m.reshape(b, h, ns),
    ell.reshape(b, h, ns),
    err.reshape(b, h, ns),
    n_scored.reshape(b, h, ns),
  )


def _scored_blocks(pl_, n_scored, nb):
  """``[b, h, nb]`` bool: block was scored by its split."""
  pos = jnp.arange(pl_.order.shape[-1])
  hit = pos < n_scored[..., None]  # [b, h, S, bps]
  onehot = (pl_.order[..., None] == jnp.arange(nb)) & hit[..., None]
  return jnp.any(onehot, axis=(2, 3))


def block_value_norms(value, *, block_size: int, mask=None) -> jax.Array:
  """``[b, h_kv, n_blocks]`` max ||v_j|| over each block's real keys.

  ``core.value_norms`` (rounded up; NaN where a real value is not finite),
  maximised per block; the bound a KVCache keeps incrementally.

  Args:
    value: ``[b, h_kv, kv_len, v_dim]``.
    block_size: keys per block.
    mask: optional ``[b, kv_len]`` bool, True for a real key.
  """
  b, hkv, n, _ = value.shape
  v = _common.pad_to(value, 2, block_size)
  nb = v.shape[2] // block_size
  norms = core.value_norms(v).reshape(b, hkv, nb, block_size)
  real = jnp.ones((b, n), bool) if mask is None else jnp.asarray(mask, bool)
  real = _common.pad_to(real, 1, block_size, False).reshape(b, 1, nb, -1)
  return core.max_norm(norms, real)


def decode_certificate(out_parts, pl_, n_scored, value_norms, delta, n_terms):
  """Output and Certificate of a split-K decode (``selection.core`` only).

  Args:
    out_parts: per split ``(o [b, h, S, dv], m, denom, err [b, h, S])``.
    pl_: the DecodePlan.
    n_scored: ``[b, h, S]`` positions each split scored.
    value_norms: ``[b, h_kv, nb]`` block value norms.
    delta: ``[b, h]`` logit rounding bound.
    n_terms: keys plus blocks (for the sums' slack).

  Returns:
    ``(output [b, h, dv] float32, Certificate [b, h])``.
  """
  o, m, ell, err = out_parts
  h = m.shape[1]
  nb = pl_.upper.shape[-1]
  g = h // value_norms.shape[1]
  scored = _scored_blocks(pl_, n_scored, nb)  # [b, h, nb]
  cnt = pl_.count
  vnorm = jnp.repeat(value_norms, g, axis=1)  # [b, h, nb]
  parts = core.PartialSoftmax.from_stats(
    m, ell, o=o, err=err, logit_error=delta[..., None]
  )
  head = core.PartialSoftmax.reduce(parts, -1)
  k_kept = jnp.sum(jnp.where(scored, cnt, 0), axis=-1)
  head = dataclasses.replace(
    head,
    k_kept=k_kept.astype(jnp.int32),
    keys_scored=k_kept.astype(jnp.int32),
    head_norm=core.max_norm(vnorm, scored & (cnt > 0)),
    tail_norm=jnp.zeros_like(head.m),
  )
  unscored = ~scored & (cnt > 0)
  log_terms = pl_.upper + jnp.log(jnp.maximum(cnt, 1).astype(jnp.float32))
  part = head.add_tail(log_terms, unscored, norms=vnorm)
  return part.finalize(n_terms=n_terms)


def _check(query, key, value, eps):
  if query.ndim != 3:
    raise ValueError(f"query must be [batch, heads, head_dim]; {query.shape=}")
  _common.check_head_major(query[:, :, None, :], key, value)
  if not 0.0 <= eps < 1.0:
    raise ValueError(f"{eps=} must be in [0, 1)")


def _summaries(query, key, mask, summary, scale, block_k):
  """(box, delta ``[b, h]``) for a query over the cache."""
  if summary is None:
    summary = theory.box_summary(
      key, block_size=block_k, mask=_kv_mask(mask, key)
    )
  count = jnp.broadcast_to(summary.count, summary.kmin.shape[:3])
  absmax = jnp.maximum(jnp.abs(summary.kmin), jnp.abs(summary.kmax))
  # The box does not say whether a key has subnormal components (only its
  # extremes are stored): assume it may (a term of sqrt(d) tiny ||q||).
  keys = _common.KeySummary(
    absmax=absmax,
    norm=core.norms_up(absmax),
    flushed=jnp.ones(count.shape, bool),
    count=count,
  )
  delta = _common.logit_error(query[:, :, None, :], keys, scale=scale)
  return summary, delta[..., 0]


@functools.partial(
  jax.jit,
  static_argnames=(
    "eps",
    "scale",
    "max_blocks",
    "block_sizes",
    "backend",
    "interpret",
  ),
)
def certified_decode(
  query,
  key,
  value,
  *,
  eps: float,
  mask=None,
  scale: float | None = None,
  summary: theory.BoxSummary | None = None,
  value_norms=None,
  max_blocks: int | None = None,
  block_sizes: BlockSizes | None = None,
  backend: str | None = None,
  interpret: bool = False,
) -> tuple[jax.Array, Certificate]:
  """One decode step over a head-major KV cache with Delta-Search (Pallas).

  THEORY 6.2 with the blockwise bound of 3.3: blocks are scored in order of
  their box upper bound until the unscored blocks' bound is at most eps of
  the total (per split); the certificate bounds tau by what was scored.

  Args:
    query: ``[batch, heads, head_dim]``, one query per head.
    key: ``[batch, kv_heads, kv_len, head_dim]`` cache (GQA).
    value: ``[batch, kv_heads, kv_len, v_dim]``.
    eps: target dropped mass in [0, 1); 0 scores every block.
    mask: optional ``[batch, kv_len]`` bool, True for a filled cache slot.
    scale: logit scale, default 1/sqrt(head_dim).
    summary: optional key boxes of the cache blocks (``block_k`` positions
      each), e.g. kept incrementally by a KVCache; computed from ``key``
      (one pass over the keys) when None.
    value_norms: optional ``[batch, kv_heads, n_blocks]`` upper bounds on
      the value norms per block (``block_value_norms``); computed from
      ``value`` when None.
    max_blocks: optional cap on the blocks scored per row (needs
      ``num_splits = 1``): the kept set is at most ``max_blocks * block_k``
      keys, and the certificate reports the true bound.
    block_sizes: cache block size and number of splits.
    backend: 'tpu' or 'gpu' grid style; None picks by platform.
    interpret: Pallas interpret mode (CPU).

  Returns:
    (output ``[b, h, v_dim]`` in the query dtype, Certificate ``[b, h]``;
    keys_scored = k_kept = keys in the scored blocks; zeros and an invalid
    certificate on a row with no real key).

  Raises:
    ValueError: bad shapes, eps outside [0, 1), ``max_blocks`` with several
      splits.
  """
  _check(query, key, value, eps)
  bs = block_sizes or BlockSizes.get_default()
  if max_blocks is not None and (max_blocks < 1 or bs.num_splits != 1):
    raise ValueError(
      f"{max_blocks=} must be >= 1 and needs num_splits=1; got"
      f" num_splits={bs.num_splits}"
    )
  d = query.shape[-1]
  scale = float(d**-0.5 if scale is None else scale)
  backend = _common.resolve_backend(backend)
  if backend == "gpu":  # [block_k, d] arrays, no dot
    _common.check_gpu_block("block_k", bs.block_k, minimum=1)
  sq = jax.lax.stop_gradient(query)
  box, delta = _summaries(sq, key, mask, summary, scale, bs.block_k)
  if value_norms is None:
    value_norms = block_value_norms(value, block_size=bs.block_k, mask=mask)
  if mask is not None:  # a masked value is never read, even as 0 * NaN
    value = jnp.where(jnp.asarray(mask, bool)[:, None, :, None], value, 0)
  pl_ = plan(
    sq,
    box,
    scale=scale,
    num_splits=bs.num_splits,
    delta=delta,
    max_blocks=max_blocks,
  )
  nb = pl_.upper.shape[-1]
  n_terms = key.shape[2] + nb
  log_top = top_block_log_mass(
    sq, key, mask, pl_, delta, scale=scale, block_k=bs.block_k
  )
  pl_, *levels = split_levels(pl_, stop_level(eps, delta, n_terms), log_top)
  o, m, ell, err, n_scored = _run_kernel(
    query, key, value, mask, pl_, levels, (scale, bs, backend, interpret)
  )
  out, cert = decode_certificate(
    (o, m, ell, err), pl_, n_scored, value_norms, delta, n_terms
  )
  return out.astype(query.dtype), cert


@functools.partial(
  jax.jit, static_argnames=("eps", "scale", "max_blocks", "block_sizes")
)
def certified_decode_reference(
  query,
  key,
  value,
  *,
  eps: float,
  mask=None,
  scale=None,
  max_blocks: int | None = None,
  block_sizes: BlockSizes | None = None,
):
  """Pure-jnp ``certified_decode``: same plan, stopping rule and merge.

  Returns:
    (output ``[b, h, v_dim]`` in the query dtype, lse ``[b, h]`` of the
    scored keys, scored ``[b, h, n_blocks]`` bool).
  """
  _check(query, key, value, eps)
  bs = block_sizes or BlockSizes.get_default()
  b, h, d = query.shape
  hkv, n = key.shape[1], key.shape[2]
  scale = float(d**-0.5 if scale is None else scale)
  bk = bs.block_k
  box, delta = _summaries(query, key, mask, None, scale, bk)
  pl_ = plan(
    query,
    box,
    scale=scale,
    num_splits=bs.num_splits,
    delta=delta,
    max_blocks=max_blocks,
  )
  kk = jnp.repeat(key, h // hkv, axis=1).astype(jnp.float32)
  vv = jnp.repeat(value, h // hkv, axis=1).astype(jnp.float32)
  s = (
    jnp.einsum(
      "bhd,bhkd->bhk",
      query.astype(jnp.float32),
      kk,
      precision=_common.PRECISION,
    )
    * scale
  )  # [b, h, n]
  valid = jnp.ones((b, 1, n), bool) if mask is None else mask[:, None, :]
  s_p = _common.pad_to(s, 2, bk)
  v_p = _common.pad_to(jnp.broadcast_to(valid, s.shape), 2, bk, False)
  nb = s_p.shape[-1] // bk
  blk_lse = logsumexp(
    s_p.reshape(b, h, nb, bk), axis=-1, where=v_p.reshape(b, h, nb, bk)
  )  # [b, h, nb]
  log_top = top_block_log_mass(
    query, key, mask, pl_, delta, scale=scale, block_k=bk
  )
  pl_, log_c, log_f = split_levels(pl_, stop_level(eps, delta, n + nb), log_top)
  ord_lse = jnp.take_along_axis(
    blk_lse[:, :, None, :], pl_.order, axis=-1
  )  # [b, h, S, bps]
  pos = jnp.arange(pl_.order.shape[-1])
  live = pos < pl_.n_live[..., None]
  cum = lax.cumlogsumexp(jnp.where(live, ord_lse, -jnp.inf), axis=3)
  level = log_c[..., None] + jnp.logaddexp(cum, log_f[..., None])
  stop = (pl_.rest <= level) & live
  first = jnp.where(jnp.any(stop, -1), jnp.argmax(stop, -1) + 1, pl_.n_live)
  scored = _scored_blocks(pl_, first, nb)
  keep = jnp.repeat(scored, bk, axis=-1)[..., :n] & valid
  lse = logsumexp(s, axis=-1, where=keep)
  p = jnp.where(
    keep, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0.0
  )
  o = jnp.einsum("bhk,bhkd->bhd", p, vv, precision=_common.PRECISION)
  return o.astype(query.dtype), lse, scored
