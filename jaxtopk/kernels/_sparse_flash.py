"""Sparse flash attention over kept key blocks only (THEORY 3.3, 8.2).

Each query tile attends to the key blocks listed for it (``BlockSelection``
from ``select_blocks``): keys outside the list are never read and never
multiplied. Online softmax in float32 (FlashAttention-2) by the certificate
core's ``online_step``: the output stays normalised (a convex combination
of kept values, so values near the largest float do not overflow) and the
kernel returns the kept keys' (max, sum, rounding) statistics, the head of
the certificate (``sparse_flash_stats``), and their log-sum-exp log Z_H.

The value product rounds the weights to the value dtype first, as flash
kernels do (bfloat16: 2^-9 relative, like the output's own cast): output
rounding, which certificates do not cover (``Certificate``); the XLA
reference multiplies float32 weights.

TPU: block lists are scalar-prefetched and drive the K/V BlockSpec index
maps (grid axis over list positions, ``pl.when`` skips padding entries,
which repeat the last index so no new block is fetched). GPU: the kernel
loops over the list and slices K/V with ``pl.ds``.

Gradients: ``jax.custom_vjp``. The backward pass is NOT a Pallas kernel: it
differentiates ``gathered_attention`` in XLA, which gathers each query
tile's kept K/V blocks ([b, h, n_q_tiles, max_kept * block_k, d]) and
recomputes block-sparse attention on them. It is the exact gradient through
the kept keys (the selection is piecewise constant, THEORY 8.2) and its
cost grows with the kept blocks, not with kv_len, but it materialises the
gathered blocks and the [block_q, max_kept * block_k] logits per tile in
memory instead of streaming them as a flash backward kernel would.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxtopk.kernels import _block_stats
from jaxtopk.kernels import _common
from jaxtopk.selection import core


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the sparse flash kernel.

  Attributes:
    block_q: queries per tile (TPU: multiple of 8; GPU: power of 2 >= 16).
    block_k: keys per block; must equal the selection's block size.
  """

  block_q: int = 128
  block_k: int = 128

  @classmethod
  def get_default(cls) -> "BlockSizes":
    return cls()


def _block_update(q, k, v, kvm, blk, qi, carry, *, scale, causal, bq, bk):
  """One online-softmax step over key block ``blk``; carry (m, l, o, err).

  ``core.online_step``: o stays normalised (a convex combination of the
  kept values: values near the largest float do not overflow) and ``err``
  tracks the rounding of l for the certificate.
  """
  s = lax.dot_general(
    q,
    k,
    (((1,), (1,)), ((), ())),
    preferred_element_type=jnp.float32,
    precision=_common.PRECISION,
  )  # [bq, bk]
  s = s * scale
  valid = kvm != 0  # [1, bk]
  if causal:
    qpos = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    kpos = blk * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    valid = valid & (kpos <= qpos)
  else:
    valid = jnp.broadcast_to(valid, (bq, bk))

  def pv(p):
    return jnp.dot(
      p.astype(v.dtype),
      v,
      preferred_element_type=jnp.float32,
      precision=_common.PRECISION,
    )

  return core.online_step(*carry, s, valid, pv, mask_value=_common.MASK_VALUE)


def _init(bq, dv):
  return (
    jnp.full((bq, 1), _common.MASK_VALUE, jnp.float32),
    jnp.zeros((bq, 1), jnp.float32),
    jnp.zeros((bq, dv), jnp.float32),
    jnp.zeros((bq, 1), jnp.float32),
  )


def _finish(m, ell, o, err, o_ref, m_ref, l_ref, e_ref):
  o_ref[...] = o.astype(o_ref.dtype)
  m_ref[...] = m
  l_ref[...] = ell
  e_ref[...] = err


def _tpu_kernel(
  idx_ref,
  cnt_ref,
  q_ref,
  k_ref,
  v_ref,
  kvm_ref,
  o_ref,
  m_ref,
  l_ref,
  e_ref,
  m_sc,
  l_sc,
  o_sc,
  e_sc,
  *,
  nqt,
  max_kept,
  **kw,
):
  i, qi, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  row = i * nqt + qi

  @pl.when(j == 0)
  def _init_scratch():
    m0, l0, o0, e0 = _init(m_sc.shape[0], o_sc.shape[1])
    m_sc[...] = m0
    l_sc[...] = l0
    o_sc[...] = o0
    e_sc[...] = e0

  @pl.when(j < cnt_ref[row])
  def _step():
    blk = idx_ref[row * max_kept + j]
    m, ell, o, err = _block_update(
      q_ref[...],
      k_ref[...],
      v_ref[...],
      kvm_ref[...],
      blk,
      qi,
      (m_sc[...], l_sc[...], o_sc[...], e_sc[...]),
      **kw,
    )
    m_sc[...] = m
    l_sc[...] = ell
    o_sc[...] = o
    e_sc[...] = err

  @pl.when(j == max_kept - 1)
  def _out():
    _finish(
      m_sc[...], l_sc[...], o_sc[...], e_sc[...], o_ref, m_ref, l_ref, e_ref
    )


def _gpu_kernel(
  idx_ref,
  cnt_ref,
  q_ref,
  k_ref,
  v_ref,
  kvm_ref,
  o_ref,
  m_ref,
  l_ref,
  e_ref,
  **kw,
):
  qi = pl.program_id(1)
  bq, bk = kw["bq"], kw["bk"]
  q = q_ref[...]
  dv = v_ref.shape[-1]

  def body(j, carry):
    blk = idx_ref[j]
    start = pl.multiple_of(blk * bk, bk)
    k = k_ref[pl.ds(start, bk), :]
    v = v_ref[pl.ds(start, bk), :]
    kvm = kvm_ref[:, pl.ds(start, bk)]
    return _block_update(q, k, v, kvm, blk, qi, carry, **kw)

  m, ell, o, err = lax.fori_loop(0, cnt_ref[0], body, _init(bq, dv))
  _finish(m, ell, o, err, o_ref, m_ref, l_ref, e_ref)


def _forward(q, k, v, block_idx, block_count, mask, cfg):
  scale, is_causal, bs, backend, interpret = cfg
  b, h, nq, d = q.shape
  hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
  bq, bk = bs.block_q, bs.block_k
  nqt = _common.cdiv(nq, bq)
  max_kept = block_idx.shape[-1]
  if block_idx.shape[:3] != (b, h, nqt):
    raise ValueError(
      f"{block_idx.shape=} must be (batch, heads, n_q_tiles, max_kept) ="
      f" {(b, h, nqt, max_kept)} for {bq=}"
    )
  kvm = _common.pad_to(_common.kv_mask_array(mask, b, nk), 2, bk)
  dv_out = dv
  if backend == "gpu":  # power-of-2 dims >= 16 (zero terms and columns)
    q, k, v = map(_common.pad_last_for_triton, (q, k, v))
    d, dv = q.shape[-1], v.shape[-1]
  qp = _common.pad_to(q, 2, bq).reshape(b * h, -1, d)
  kp = _common.pad_to(k, 2, bk).reshape(b * hkv, -1, d)
  vp = _common.pad_to(v, 2, bk).reshape(b * hkv, -1, dv)
  nq_p, nk_p = qp.shape[1], kp.shape[1]
  idx = block_idx.astype(jnp.int32).reshape(b * h, nqt, max_kept)
  cnt = block_count.astype(jnp.int32).reshape(b * h, nqt)
  kw = dict(scale=scale, causal=is_causal, bq=bq, bk=bk)
  stat = jax.ShapeDtypeStruct((b * h, nq_p, 1), jnp.float32)
  out_shape = [jax.ShapeDtypeStruct((b * h, nq_p, dv), q.dtype)] + [stat] * 3

  def kv_row(i):
    return _common.kv_row(i, h, hkv)

  if backend == "tpu":

    def kv_map(i, qi, j, idx_ref, cnt_ref):
      return (kv_row(i), idx_ref[(i * nqt + qi) * max_kept + j], 0)

    def kvm_map(i, qi, j, idx_ref, cnt_ref):
      return (lax.div(i, h), 0, idx_ref[(i * nqt + qi) * max_kept + j])

    grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(b * h, nqt, max_kept),
      in_specs=[
        pl.BlockSpec((None, bq, d), lambda i, qi, j, *_: (i, qi, 0)),
        pl.BlockSpec((None, bk, d), kv_map),
        pl.BlockSpec((None, bk, dv), kv_map),
        pl.BlockSpec((None, 1, bk), kvm_map),
      ],
      out_specs=[
        pl.BlockSpec((None, bq, dv), lambda i, qi, j, *_: (i, qi, 0)),
      ]
      + [pl.BlockSpec((None, bq, 1), lambda i, qi, j, *_: (i, qi, 0))] * 3,
      scratch_shapes=[
        pltpu.VMEM((bq, 1), jnp.float32),
        pltpu.VMEM((bq, 1), jnp.float32),
        pltpu.VMEM((bq, dv), jnp.float32),
        pltpu.VMEM((bq, 1), jnp.float32),
      ],
    )
    kernel = functools.partial(_tpu_kernel, nqt=nqt, max_kept=max_kept, **kw)
    o, m, ell, err = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=out_shape,
      compiler_params=_common.compiler_params(
        backend, ("parallel", "parallel", "arbitrary")
      ),
      interpret=interpret,
      name="jaxtopk_sparse_flash",
    )(idx.reshape(-1), cnt.reshape(-1), qp, kp, vp, kvm)
  else:
    kernel = functools.partial(_gpu_kernel, **kw)
    o, m, ell, err = pl.pallas_call(
      kernel,
      grid=(b * h, nqt),
      in_specs=[
        pl.BlockSpec((None, None, max_kept), lambda i, qi: (i, qi, 0)),
        pl.BlockSpec((None, 1), lambda i, qi: (i, qi)),
        pl.BlockSpec((None, bq, d), lambda i, qi: (i, qi, 0)),
        pl.BlockSpec((None, nk_p, d), lambda i, qi: (kv_row(i), 0, 0)),
        pl.BlockSpec((None, nk_p, dv), lambda i, qi: (kv_row(i), 0, 0)),
        pl.BlockSpec((None, 1, nk_p), lambda i, qi: (lax.div(i, h), 0, 0)),
      ],
      out_specs=[pl.BlockSpec((None, bq, dv), lambda i, qi: (i, qi, 0))]
      + [pl.BlockSpec((None, bq, 1), lambda i, qi: (i, qi, 0))] * 3,
      out_shape=out_shape,
      compiler_params=_common.compiler_params(backend, ()),
      interpret=interpret,
      name="jaxtopk_sparse_flash",
    )(idx, cnt, qp, kp, vp, kvm)
  o = o.reshape(b, h, nq_p, dv)[:, :, :nq, :dv_out]
  m, ell, err = (x.reshape(b, h, nq_p)[:, :, :nq] for x in (m, ell, err))
  has = ell > 0
  m = jnp.where(has, m, -jnp.inf)
  lse = jnp.where(has, m + jnp.log(jnp.where(has, ell, 1.0)), -jnp.inf)
  return o, lse, FlashStats(m=m, denom=ell, err=err)


@functools.partial(
  jax.jit, static_argnames=("q_len", "kv_len", "block_q", "block_k")
)
def kept_key_mask(block_idx, block_count, *, q_len, kv_len, block_q, block_k):
  """``[b, h, q_len, kv_len]`` bool: key lies in a block kept for its tile."""
  b, h, nqt, max_kept = block_idx.shape
  nkb = _common.cdiv(kv_len, block_k)
  pos = jnp.arange(max_kept)
  live = pos < block_count[..., None]  # [b, h, nqt, max_kept]
  onehot = (block_idx[..., None] == jnp.arange(nkb)) & live[..., None]
  kept_blk = jnp.any(onehot, axis=3)  # [b, h, nqt, nkb]
  kept = jnp.repeat(jnp.repeat(kept_blk, block_q, axis=2), block_k, axis=3)
  return kept[:, :, :q_len, :kv_len]


@functools.partial(
  jax.jit,
  static_argnames=("scale", "is_causal", "block_q", "block_k"),
)
def sparse_flash_attention_reference(
  query,
  key,
  value,
  block_idx,
  block_count,
  *,
  mask=None,
  scale=None,
  is_causal=False,
  block_q: int = 128,
  block_k: int = 128,
):
  """Pure-jnp ``sparse_flash_attention``: softmax over the kept keys only.

  Returns:
    (output ``[b, h, q, dv]`` in the query dtype, lse ``[b, h, q]`` float32,
    -inf and a zero output where no real key is kept).
  """
  _common.check_head_major(query, key, value)
  b, h, nq, d = query.shape
  hkv, nk = key.shape[1], key.shape[2]
  scale = d**-0.5 if scale is None else scale
  g = h // hkv
  kk = jnp.repeat(key, g, axis=1).astype(jnp.float32)
  vv = jnp.repeat(value, g, axis=1).astype(jnp.float32)
  s = jnp.einsum(
    "bhqd,bhkd->bhqk",
    query.astype(jnp.float32),
    kk,
    precision=_common.PRECISION,
  )  # [b, h, q, s]
  s = s * scale
  vis = _block_stats.visible_mask(b, nq, nk, mask, is_causal)
  keep = vis & kept_key_mask(
    block_idx,
    block_count,
    q_len=nq,
    kv_len=nk,
    block_q=block_q,
    block_k=block_k,
  )
  # -inf before exp (not only a where after it): a dropped key with a huge
  # logit would otherwise overflow exp and turn its zero gradient into NaN.
  s = jnp.where(keep, s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1, where=keep)  # [b, h, q]
  has = jnp.isfinite(lse)
  p = jnp.where(keep, jnp.exp(s - jnp.where(has, lse, 0.0)[..., None]), 0.0)
  o = jnp.einsum("bhqk,bhkd->bhqd", p, vv, precision=_common.PRECISION)
  return o.astype(query.dtype), lse


@functools.partial(
  jax.jit,
  static_argnames=("scale", "is_causal", "block_q", "block_k"),
)
def sparse_flash_stats_reference(
  query,
  key,
  value,
  block_idx,
  block_count,
  *,
  mask=None,
  scale=None,
  is_causal=False,
  block_q: int = 128,
  block_k: int = 128,
):
  """Pure-jnp ``sparse_flash_stats`` (``core.PartialSoftmax.from_logits``).

  Returns:
    (output, lse, FlashStats) as ``sparse_flash_stats``.
  """
  o, lse = sparse_flash_attention_reference(
    query,
    key,
    value,
    block_idx,
    block_count,
    mask=mask,
    scale=scale,
    is_causal=is_causal,
    block_q=block_q,
    block_k=block_k,
  )
  b, h, nq, d = query.shape
  hkv, nk = key.shape[1], key.shape[2]
  scale = d**-0.5 if scale is None else scale
  kk = jnp.repeat(key, h // hkv, axis=1).astype(jnp.float32)
  s = (
    jnp.einsum(
      "bhqd,bhkd->bhqk",
      query.astype(jnp.float32),
      kk,
      precision=_common.PRECISION,
    )
    * scale
  )  # [b, h, q, s]
  vis = _block_stats.visible_mask(b, nq, nk, mask, is_causal)
  keep = vis & kept_key_mask(
    block_idx,
    block_count,
    q_len=nq,
    kv_len=nk,
    block_q=block_q,
    block_k=block_k,
  )
  part = core.PartialSoftmax.from_logits(jax.lax.stop_gradient(s), keep, keep)
  stats = FlashStats(m=part.m, denom=part.denom, err=part.err)
  return o, lse, stats


def gathered_attention(
  query,
  key,
  value,
  block_idx,
  block_count,
  *,
  mask=None,
  scale: float,
  is_causal: bool = False,
  block_q: int,
  block_k: int,
):
  """Block-sparse attention on gathered kept blocks (XLA; the backward).

  Same result as ``sparse_flash_attention_reference`` for block lists whose
  first ``block_count`` entries are distinct (as ``select_blocks`` gives),
  at a cost that grows with the kept blocks rather than kv_len.

  Args:
    query: ``[b, h, q_len, d]``; key ``[b, h_kv, kv_len, d]``; value
      ``[b, h_kv, kv_len, dv]``.
    block_idx: ``[b, h, n_q_tiles, max_kept]`` int32 kept blocks per tile.
    block_count: ``[b, h, n_q_tiles]`` int32 valid entries.
    mask: optional ``[b, kv_len]`` bool, True for a real key.
    scale: logit scale.
    is_causal: top-left causal mask.
    block_q: queries per tile; block_k: keys per block.

  Returns:
    (output ``[b, h, q_len, dv]`` in the query dtype, lse ``[b, h, q_len]``
    float32, -inf and a zero output where no real key is kept).
  """
  b, h, nq, d = query.shape
  hkv, nk, dv = key.shape[1], key.shape[2], value.shape[-1]
  g = h // hkv
  nqt, nkb = _common.cdiv(nq, block_q), _common.cdiv(nk, block_k)
  m_kept = block_idx.shape[-1]
  f32 = jnp.float32
  qt = _common.pad_to(query.astype(f32), 2, block_q)
  qt = qt.reshape(b, h, nqt, block_q, d)
  kb = _common.pad_to(key.astype(f32), 2, block_k).reshape(
    b, hkv, nkb, block_k, d
  )
  vb = _common.pad_to(value.astype(f32), 2, block_k).reshape(
    b, hkv, nkb, block_k, dv
  )
  bi = jnp.arange(b)[:, None, None, None]
  hi = (jnp.arange(h) // g)[None, :, None, None]
  width = m_kept * block_k
  kg = kb[bi, hi, block_idx].reshape(b, h, nqt, width, d)
  vg = vb[bi, hi, block_idx].reshape(b, h, nqt, width, dv)
  pos = block_idx[..., None] * block_k + jnp.arange(block_k)
  live = jnp.arange(m_kept) < block_count[..., None]  # [b, h, nqt, M]
  ok = (live[..., None] & (pos < nk)).reshape(b, h, nqt, width)
  if mask is not None:
    mp = _common.pad_to(jnp.asarray(mask, bool), 1, block_k, False)
    ok = ok & mp[bi, pos.reshape(b, h, nqt, width)]
  ok = ok[:, :, :, None, :]  # [b, h, nqt, 1, width]
  if is_causal:
    qpos = jnp.arange(nqt * block_q).reshape(nqt, block_q)
    ok = ok & (pos.reshape(b, h, nqt, 1, width) <= qpos[:, :, None])
  s = jnp.einsum("bhtid,bhtjd->bhtij", qt, kg, precision=_common.PRECISION)
  # -inf (not a where after exp) keeps the gradient of dropped keys at 0.
  s = jnp.where(ok, s * scale, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1, where=ok)  # [b, h, nqt, bq]
  p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
  o = jnp.einsum("bhtij,bhtjd->bhtid", p, vg, precision=_common.PRECISION)
  o = o.reshape(b, h, nqt * block_q, dv)[:, :, :nq]
  lse = lse.reshape(b, h, nqt * block_q)[:, :, :nq]
  return o.astype(query.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _sparse_flash(q, k, v, block_idx, block_count, mask, cfg):
  return _forward(q, k, v, block_idx, block_count, mask, cfg)


def _fwd(q, k, v, block_idx, block_count, mask, cfg):
  out = _forward(q, k, v, block_idx, block_count, mask, cfg)
  return out, (q, k, v, block_idx, block_count, mask)


def _bwd(cfg, res, cts):
  q, k, v, block_idx, block_count, mask = res
  scale, is_causal, bs, _, _ = cfg

  def ref(q, k, v):
    return gathered_attention(
      q,
      k,
      v,
      block_idx,
      block_count,
      mask=mask,
      scale=scale,
      is_causal=is_causal,
      block_q=bs.block_q,
      block_k=bs.block_k,
    )

  _, vjp = jax.vjp(ref, q, k, v)
  # The statistics (m, denom, err) feed certificates, which are computed on
  # stop-gradient values: their cotangents are not propagated.
  d_o, d_lse, _ = cts
  # -inf lse rows have no kept key: their cotangent cannot flow anywhere.
  d_lse = jnp.where(jnp.isfinite(d_lse), d_lse, 0.0)
  dq, dk, dv = vjp((d_o, d_lse))
  return dq, dk, dv, None, None, None


_sparse_flash.defvjp(_fwd, _bwd)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FlashStats:
  """Softmax statistics of the kept keys of each query (for certificates).

  Attributes:
    m: ``[b, h, q]`` max kept logit (-inf where nothing is kept).
    denom: ``[b, h, q]`` sum over kept keys of e^{s - m} (0 if none).
    err: ``[b, h, q]`` rounding of ``denom`` in eps units
      (``core.online_step``), for ``core.PartialSoftmax.from_stats``.
  """

  m: jax.Array
  denom: jax.Array
  err: jax.Array


def sparse_flash_stats(
  query,
  key,
  value,
  block_idx,
  block_count,
  *,
  mask=None,
  scale: float,
  is_causal: bool = False,
  block_sizes: BlockSizes,
  backend: str | None = None,
  interpret: bool = False,
):
  """``sparse_flash_attention`` that also returns the kept keys' statistics.

  Same arguments. Returns ``(output, lse, FlashStats)``; gradients flow
  through the output and lse (not through the statistics).
  """
  _common.check_head_major(query, key, value)
  backend = _common.resolve_backend(backend)
  if backend == "gpu":
    _common.check_gpu_block("block_q", block_sizes.block_q)
    _common.check_gpu_block("block_k", block_sizes.block_k)
  cfg = (
    float(scale),
    bool(is_causal),
    block_sizes,
    backend,
    bool(interpret),
  )
  return _sparse_flash(query, key, value, block_idx, block_count, mask, cfg)


@functools.partial(
  jax.jit,
  static_argnames=("scale", "is_causal", "block_sizes", "backend", "interpret"),
)
def sparse_flash_attention(
  query,
  key,
  value,
  block_idx,
  block_count,
  *,
  mask=None,
  scale: float | None = None,
  is_causal: bool = False,
  block_sizes: BlockSizes | None = None,
  backend: str | None = None,
  interpret: bool = False,
):
  """Flash attention over the kept key blocks of each query tile (Pallas).

  Softmax over K_H = real, visible keys in the tile's kept blocks:
  o_q = sum_{i in K_H} e^{s_qi - lse_q} v_i, lse_q = log Z_H (THEORY 1, 3.3).

  Args:
    query: ``[batch, heads, q_len, head_dim]``.
    key: ``[batch, kv_heads, kv_len, head_dim]`` (GQA: heads % kv_heads == 0).
    value: ``[batch, kv_heads, kv_len, v_dim]``.
    block_idx: ``[batch, heads, n_q_tiles, max_kept]`` int32 kept key-block
      indices per query tile (``BlockSelection.block_idx``);
      ``n_q_tiles = ceil(q_len / block_q)``.
    block_count: ``[batch, heads, n_q_tiles]`` int32 number of valid entries.
    mask: optional ``[batch, kv_len]`` bool, True for a real key.
    scale: logit scale, default 1/sqrt(head_dim).
    is_causal: top-left causal mask, as jax.nn.
    block_sizes: tiling; block_k must match the selection's blocks.
    backend: 'tpu' or 'gpu' grid style; None picks by platform.
    interpret: Pallas interpret mode (CPU).

  Returns:
    (output ``[b, h, q, v_dim]`` in the query dtype, lse ``[b, h, q]``
    float32; -inf lse and zero output where no real key is kept).
  """
  bs = block_sizes or BlockSizes.get_default()
  d = query.shape[-1]
  o, lse, _ = sparse_flash_stats(
    query,
    key,
    value,
    block_idx,
    block_count,
    mask=mask,
    scale=float(d**-0.5 if scale is None else scale),
    is_causal=is_causal,
    block_sizes=bs,
    backend=backend,
    interpret=interpret,
  )
  return o, lse
