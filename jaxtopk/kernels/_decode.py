"""Certified split-K decode: Delta-Search over a head-major KV cache.

One query per head against a long cache ``[b, kv_heads, n, d]`` (THEORY 6.2,
DESIGN "one decode step"):

1. Outside the kernel (XLA): box summaries of the cache blocks give a sound
   upper bound u_b on every logit of block b (THEORY 3.3,
   ``jaxtopk.theory.box_upper_bound``); blocks are ordered by u_b, largest
   first, and dealt round-robin to ``num_splits`` splits (split s gets ordered
   positions s, s + S, s + 2S, ...). For each split and position j the
   remaining bound R_s(j) = log sum_{its positions > j} |B| e^{u_b} is
   precomputed.
2. The kernel (one program per query head and split) scores its blocks in
   order with an online softmax (m, l, acc) and stops after position j as
   soon as R_s(j) <= log(eps / (1 - eps)) + log Z_s (Delta-Search's stopping
   rule, per split). If every split stops this way, sum_s U_s <= eps/(1-eps)
   sum_s Z_s, so tau <= U / (Z_H + U) <= eps (THEORY 2.4).
3. Partial (acc, m, l) and the number of scored positions per split are
   merged outside the kernel (split-K), and ``_certify.certificate`` bounds
   tau from what was really scored, whatever the stopping decisions were.

TPU: ordered block indices are scalar-prefetched and drive the K/V index
maps; once a split has stopped its remaining steps skip all compute, but the
pipeline still fetches their blocks (a manual-DMA version would not). GPU:
a while loop that really stops reading.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.scipy.special import logsumexp

from jaxtopk import theory
from jaxtopk.kernels import _certify
from jaxtopk.kernels import _common
from jaxtopk.selection import Certificate

# The kernel aims a little below eps so that the final certificate, which adds
# rounding slack, still lands at or below eps.
_EPS_MARGIN = 0.98


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
    n_live: ``[b, h, S]`` int32 positions holding a block with real keys.
    upper: ``[b, h, n_blocks]`` float32 sound logit upper bounds u_b.
    count: ``[b, h, n_blocks]`` int32 real keys per block.
  """

  order: jax.Array
  rest: jax.Array
  n_live: jax.Array
  upper: jax.Array
  count: jax.Array


def plan(query, box: theory.BoxSummary, *, scale, num_splits: int):
  """Orders blocks by box upper bound and deals them to splits (XLA).

  Args:
    query: ``[b, h, d]``.
    box: key boxes ``[b, h_kv, n_blocks, d]``, counts ``[b, h_kv or 1,
      n_blocks]`` (``theory.box_summary`` or a KVCache's incremental one).
    scale: logit scale.
    num_splits: split-K programs per head.
  """
  b, h, _ = query.shape
  hkv = box.kmin.shape[1]
  g = h // hkv
  count = jnp.broadcast_to(box.count, box.kmin.shape[:3])
  box = theory.BoxSummary(
    kmin=jnp.repeat(box.kmin, g, axis=1),
    kmax=jnp.repeat(box.kmax, g, axis=1),
    count=jnp.repeat(count, g, axis=1),
  )  # [b, h, nb, d]
  upper = theory.box_upper_bound(query, box, scale=scale)  # [b, h, nb]
  count = box.count
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
  suffix = lax.cumlogsumexp(logw, axis=3, reverse=True)
  rest = jnp.concatenate(
    [suffix[..., 1:], jnp.full_like(suffix[..., :1], -jnp.inf)], axis=-1
  )
  rest = jnp.where(jnp.isfinite(rest), rest, _common.MASK_VALUE)
  last = jnp.take_along_axis(order, jnp.maximum(n_live - 1, 0)[..., None], -1)
  order = jnp.where(jnp.arange(bps) < n_live[..., None], order, last)
  return DecodePlan(order, rest.astype(jnp.float32), n_live, upper, count)


def _kv_mask(mask, key):
  if mask is None:
    return None
  return jnp.broadcast_to(jnp.asarray(mask, bool)[:, None, :], key.shape[:3])


def _score(q, k, v, kvm, carry, scale):
  """Online-softmax step for one query: q [1, d], k [bk, d], v [bk, dv]."""
  m_prev, l_prev, acc_prev = carry
  s = (
    jnp.sum(
      k.astype(jnp.float32) * q.astype(jnp.float32), axis=1, keepdims=True
    )
    * scale
  )  # [bk, 1]
  valid = kvm != 0  # [bk, 1]
  s = jnp.where(valid, s, _common.MASK_VALUE)
  m_new = jnp.maximum(m_prev, jnp.max(s, axis=0, keepdims=True))  # [1, 1]
  p = jnp.where(valid, jnp.exp(s - m_new), 0.0)  # [bk, 1]
  corr = jnp.exp(m_prev - m_new)
  l_new = corr * l_prev + jnp.sum(p, axis=0, keepdims=True)
  pv = jnp.sum(p * v.astype(jnp.float32), axis=0, keepdims=True)  # [1, dv]
  return m_new, l_new, corr * acc_prev + pv


def _stop(rest_j, m, ell, log_c):
  """Delta-Search rule: remaining bound <= c * Z_s (all in log space)."""
  log_z = m + jnp.log(jnp.maximum(ell, 1e-30))
  return rest_j <= log_c + log_z


def _tpu_kernel(
  order_ref,
  live_ref,
  rest_ref,
  q_ref,
  k_ref,
  v_ref,
  kvm_ref,
  acc_out,
  m_out,
  l_out,
  n_out,
  m_sc,
  l_sc,
  acc_sc,
  st_sc,
  *,
  num_splits,
  bps,
  scale,
  log_c,
):
  i, s, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  row = i * num_splits + s

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, _common.MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
    st_sc[0] = 0  # positions scored
    st_sc[1] = 0  # stopped

  @pl.when((st_sc[1] == 0) & (j < live_ref[row]))
  def _step():
    m, ell, acc = _score(
      q_ref[...],
      k_ref[...],
      v_ref[...],
      kvm_ref[...],
      (m_sc[...], l_sc[...], acc_sc[...]),
      scale,
    )
    m_sc[...] = m
    l_sc[...] = ell
    acc_sc[...] = acc
    st_sc[0] = j + 1
    stop = _stop(rest_ref[row * bps + j], m[0, 0], ell[0, 0], log_c)
    st_sc[1] = stop.astype(jnp.int32)

  @pl.when(j == bps - 1)
  def _out():
    acc_out[...] = acc_sc[...]
    m_out[...] = m_sc[...]
    l_out[...] = l_sc[...]
    n_out[...] = jnp.full(n_out.shape, st_sc[0], jnp.int32)


def _gpu_kernel(
  order_ref,
  live_ref,
  rest_ref,
  q_ref,
  k_ref,
  v_ref,
  kvm_ref,
  acc_out,
  m_out,
  l_out,
  n_out,
  *,
  bk,
  scale,
  log_c,
):
  q = q_ref[...]
  dv = v_ref.shape[-1]
  n_live = live_ref[0]

  def cond(c):
    j, stopped = c[0], c[1]
    return (j < n_live) & (stopped == 0)

  def body(c):
    j, _, m, ell, acc = c
    start = pl.multiple_of(order_ref[j] * bk, bk)
    m, ell, acc = _score(
      q,
      k_ref[pl.ds(start, bk), :],
      v_ref[pl.ds(start, bk), :],
      kvm_ref[pl.ds(start, bk), :],
      (m, ell, acc),
      scale,
    )
    stop = _stop(rest_ref[j], jnp.max(m), jnp.max(ell), log_c)
    return j + 1, stop.astype(jnp.int32), m, ell, acc

  init = (
    jnp.int32(0),
    jnp.int32(0),
    jnp.full((1, 1), _common.MASK_VALUE, jnp.float32),
    jnp.zeros((1, 1), jnp.float32),
    jnp.zeros((1, dv), jnp.float32),
  )
  j, _, m, ell, acc = lax.while_loop(cond, body, init)
  acc_out[...] = acc
  m_out[...] = m
  l_out[...] = ell
  n_out[...] = jnp.full(n_out.shape, j, jnp.int32)


def _run_kernel(query, key, value, mask, pl_, cfg):
  scale, bs, backend, interpret, eps = cfg
  b, h, d = query.shape
  hkv, n, dv = key.shape[1], key.shape[2], value.shape[3]
  bk, ns = bs.block_k, bs.num_splits
  bps = pl_.order.shape[-1]
  eps_t = eps * _EPS_MARGIN
  log_c = math.log(eps_t / (1 - eps_t)) if eps_t > 0 else -math.inf
  log_c = max(log_c, _common.MASK_VALUE)
  kp = _common.pad_to(key, 2, bk).reshape(b * hkv, -1, d)
  vp = _common.pad_to(value, 2, bk).reshape(b * hkv, -1, dv)
  n_p = kp.shape[1]
  kvm = _common.pad_to(_common.kv_mask_array(mask, b, n), 2, bk)
  kvm = kvm.reshape(b, n_p, 1)
  q = query.reshape(b * h, 1, d)
  order = pl_.order.reshape(b * h, ns, bps)
  live = pl_.n_live.reshape(b * h, ns)
  rest = pl_.rest.reshape(b * h, ns, bps)
  out_shape = [
    jax.ShapeDtypeStruct((b * h, ns, 1, dv), jnp.float32),
    jax.ShapeDtypeStruct((b * h, ns, 1, 1), jnp.float32),
    jax.ShapeDtypeStruct((b * h, ns, 1, 1), jnp.float32),
    jax.ShapeDtypeStruct((b * h, ns, 1, 1), jnp.int32),
  ]

  def kv_row(i):
    return _common.kv_row(i, h, hkv)

  if backend == "tpu":

    def kv_map(i, s, j, order_ref, *_):
      return (kv_row(i), order_ref[(i * ns + s) * bps + j], 0)

    def kvm_map(i, s, j, order_ref, *_):
      return (lax.div(i, h), order_ref[(i * ns + s) * bps + j], 0)

    def out_map(i, s, j, *_):
      return (i, s, 0, 0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3,
      grid=(b * h, ns, bps),
      in_specs=[
        pl.BlockSpec((None, 1, d), lambda i, s, j, *_: (i, 0, 0)),
        pl.BlockSpec((None, bk, d), kv_map),
        pl.BlockSpec((None, bk, dv), kv_map),
        pl.BlockSpec((None, bk, 1), kvm_map),
      ],
      out_specs=[
        pl.BlockSpec((None, None, 1, dv), out_map),
        pl.BlockSpec((None, None, 1, 1), out_map),
        pl.BlockSpec((None, None, 1, 1), out_map),
        pl.BlockSpec((None, None, 1, 1), out_map),
      ],
      scratch_shapes=[
        pltpu.VMEM((1, 1), jnp.float32),
        pltpu.VMEM((1, 1), jnp.float32),
        pltpu.VMEM((1, dv), jnp.float32),
        pltpu.SMEM((2,), jnp.int32),
      ],
    )
    kernel = functools.partial(
      _tpu_kernel, num_splits=ns, bps=bps, scale=scale, log_c=log_c
    )
    outs = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=out_shape,
      compiler_params=_common.compiler_params(
        backend, ("parallel", "parallel", "arbitrary")
      ),
      interpret=interpret,
      name="jaxtopk_certified_decode",
    )(order.reshape(-1), live.reshape(-1), rest.reshape(-1), q, kp, vp, kvm)
  else:
    kernel = functools.partial(_gpu_kernel, bk=bk, scale=scale, log_c=log_c)
    outs = pl.pallas_call(
      kernel,
      grid=(b * h, ns),
      in_specs=[
        pl.BlockSpec((None, None, bps), lambda i, s: (i, s, 0)),
        pl.BlockSpec((None, 1), lambda i, s: (i, s)),
        pl.BlockSpec((None, None, bps), lambda i, s: (i, s, 0)),
        pl.BlockSpec((None, 1, d), lambda i, s: (i, 0, 0)),
        pl.BlockSpec((None, n_p, d), lambda i, s: (kv_row(i), 0, 0)),
        pl.BlockSpec((None, n_p, dv), lambda i, s: (kv_row(i), 0, 0)),
        pl.BlockSpec((None, n_p, 1), lambda i, s: (lax.div(i, h), 0, 0)),
      ],
      out_specs=[
        pl.BlockSpec((None, None, 1, dv), lambda i, s: (i, s, 0, 0)),
        pl.BlockSpec((None, None, 1, 1), lambda i, s: (i, s, 0, 0)),
        pl.BlockSpec((None, None, 1, 1), lambda i, s: (i, s, 0, 0)),
        pl.BlockSpec((None, None, 1, 1), lambda i, s: (i, s, 0, 0)),
      ],
      out_shape=out_shape,
      compiler_params=_common.compiler_params(backend, ()),
      interpret=interpret,
      name="jaxtopk_certified_decode",
    )(order, live, rest, q, kp, vp, kvm)
  acc, m, ell, n_scored = outs
  return (
    acc.reshape(b, h, ns, dv),
    m.reshape(b, h, ns),
    ell.reshape(b, h, ns),
    n_scored.reshape(b, h, ns),
  )


def merge_splits(acc, m, ell):
  """Split-K merge of partial (acc, m, l): output and log Z_H.

  Args:
    acc: ``[..., S, dv]`` unnormalised sum_i e^{s_i - m_s} v_i per split.
    m: ``[..., S]`` running max per split (MASK_VALUE when nothing scored).
    ell: ``[..., S]`` sum_i e^{s_i - m_s} per split.

  Returns:
    (output ``[..., dv]`` float32, lse ``[...]``, -inf when nothing scored).
  """
  has = ell > 0
  mm = jnp.max(jnp.where(has, m, -jnp.inf), axis=-1, keepdims=True)
  mm_safe = jnp.where(jnp.isfinite(mm), mm, 0.0)
  w = jnp.where(has, jnp.exp(m - mm_safe), 0.0)  # [..., S]
  total = jnp.sum(w * ell, axis=-1)
  o = jnp.sum(w[..., None] * acc, axis=-2)
  o = jnp.where(
    total[..., None] > 0, o / jnp.maximum(total, 1e-30)[..., None], 0.0
  )
  lse = jnp.where(
    total > 0, mm_safe[..., 0] + jnp.log(jnp.maximum(total, 1e-30)), -jnp.inf
  )
  return o, lse


def _scored_blocks(pl_, n_scored, nb):
  """``[b, h, nb]`` bool: block was scored by its split."""
  pos = jnp.arange(pl_.order.shape[-1])
  hit = pos < n_scored[..., None]  # [b, h, S, bps]
  onehot = (pl_.order[..., None] == jnp.arange(nb)) & hit[..., None]
  return jnp.any(onehot, axis=(2, 3))


def _certify_decode(
  query, out, lse, pl_, scored, box, value_norms, scale, block_k
):
  b, h, d = query.shape
  g = h // box.kmin.shape[1]
  cnt = pl_.count
  has = cnt > 0
  tail = has & ~scored
  absmax = jnp.maximum(jnp.abs(box.kmin), jnp.abs(box.kmax))
  slack = _common.logit_slack(query[:, :, None, :], absmax, scale=scale)[
    :, :, 0
  ]  # [b, h, nb]
  head_slack = jnp.max(jnp.where(scored & has, slack, 0.0), axis=-1)
  k_kept = jnp.sum(jnp.where(scored, cnt, 0), axis=-1)
  vnorm = jnp.repeat(value_norms, g, axis=1)  # [b, h, nb]
  tail_v = jnp.max(jnp.where(tail, vnorm, 0.0), axis=-1)
  log_terms = jnp.log(jnp.maximum(cnt, 1).astype(jnp.float32)) + pl_.upper
  return _certify.certificate(
    log_head=lse,
    head_slack=head_slack,
    log_tail_terms=log_terms,
    tail_present=tail,
    k_kept=k_kept,
    keys_scored=k_kept,
    n_terms=cnt.shape[-1] * (block_k + 1),
    out_norm=jnp.sqrt(jnp.sum(out.astype(jnp.float32) ** 2, axis=-1)),
    tail_value_norm=tail_v,
    out_dtype=query.dtype,
  )


def _check(query, key, value, eps):
  if query.ndim != 3:
    raise ValueError(f"query must be [batch, heads, head_dim]; {query.shape=}")
  _common.check_head_major(query[:, :, None, :], key, value)
  if not 0.0 <= eps < 1.0:
    raise ValueError(f"{eps=} must be in [0, 1)")


@functools.partial(
  jax.jit,
  static_argnames=("eps", "scale", "block_sizes", "backend", "interpret"),
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
      the value norms per block; computed from ``value`` when None.
    block_sizes: cache block size and number of splits.
    backend: 'tpu' or 'gpu' grid style; None picks by platform.
    interpret: Pallas interpret mode (CPU).

  Returns:
    (output ``[b, h, v_dim]`` in the query dtype, Certificate ``[b, h]``;
    keys_scored = k_kept = keys in the scored blocks).
  """
  _check(query, key, value, eps)
  bs = block_sizes or BlockSizes.get_default()
  d = query.shape[-1]
  scale = float(d**-0.5 if scale is None else scale)
  backend = _common.resolve_backend(backend)
  if summary is None:
    summary = theory.box_summary(
      key, block_size=bs.block_k, mask=_kv_mask(mask, key)
    )
  if value_norms is None:
    value_norms = _certify.block_value_norms(
      value, block_size=bs.block_k, mask=mask
    )
  pl_ = plan(query, summary, scale=scale, num_splits=bs.num_splits)
  acc, m, ell, n_scored = _run_kernel(
    query, key, value, mask, pl_, (scale, bs, backend, interpret, eps)
  )
  out, lse = merge_splits(acc, m, ell)
  nb = pl_.upper.shape[-1]
  scored = _scored_blocks(pl_, n_scored, nb)
  cert = _certify_decode(
    query, out, lse, pl_, scored, summary, value_norms, scale, bs.block_k
  )
  return out.astype(query.dtype), cert


@functools.partial(jax.jit, static_argnames=("eps", "scale", "block_sizes"))
def certified_decode_reference(
  query,
  key,
  value,
  *,
  eps: float,
  mask=None,
  scale=None,
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
  box = theory.box_summary(key, block_size=bk, mask=_kv_mask(mask, key))
  pl_ = plan(query, box, scale=scale, num_splits=bs.num_splits)
  kk = jnp.repeat(key, h // hkv, axis=1).astype(jnp.float32)
  vv = jnp.repeat(value, h // hkv, axis=1).astype(jnp.float32)
  s = (
    jnp.einsum(
      "bhd,bhkd->bhk",
      query.astype(jnp.float32),
      kk,
      precision=lax.Precision.HIGHEST,
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
  eps_t = eps * _EPS_MARGIN
  log_c = math.log(eps_t / (1 - eps_t)) if eps_t > 0 else -math.inf
  ord_lse = jnp.take_along_axis(
    blk_lse[:, :, None, :], pl_.order, axis=-1
  )  # [b, h, S, bps]
  pos = jnp.arange(pl_.order.shape[-1])
  live = pos < pl_.n_live[..., None]
  cum = lax.cumlogsumexp(jnp.where(live, ord_lse, -jnp.inf), axis=3)
  stop = (pl_.rest <= log_c + cum) & live
  first = jnp.where(jnp.any(stop, -1), jnp.argmax(stop, -1) + 1, pl_.n_live)
  scored = _scored_blocks(pl_, first, nb)
  keep = jnp.repeat(scored, bk, axis=-1)[..., :n] & valid
  lse = logsumexp(s, axis=-1, where=keep)
  p = jnp.where(
    keep, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0.0
  )
  o = jnp.einsum("bhk,bhkd->bhd", p, vv, precision=lax.Precision.HIGHEST)
  return o.astype(query.dtype), lse, scored
