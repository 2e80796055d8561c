"""Block statistics kernel: exact per-query, per-key-block softmax masses.

For every query and every contiguous block of ``block_k`` keys, the kernel
computes the block's max logit m_qb and log-sum-exp lse_qb = log sum_{i in b}
e^{s_qi} over the block's real keys, and the number of real keys it saw. These
are the exact block masses of THEORY 3.3: a block dropped from attention
removes exactly e^{lse_qb} from Z, so ``select_blocks`` can keep blocks by
mass until the dropped mass is certified <= eps (THEORY 6.1, at block
granularity).

The kernel reads q and k only (no values): it is the "indexer" pass of sparse
attention. One grid step per (batch*head, query tile, key block); no state
crosses steps, so the same grid serves TPU and GPU.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxtopk.kernels import _common


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the block-statistics kernel.

  Attributes:
    block_q: queries per tile (TPU: multiple of 8; GPU: power of 2 >= 16).
    block_k: keys per block (TPU: multiple of 128; GPU: power of 2 >= 16).
      This is also the granularity of block selection.
  """

  block_q: int = 128
  block_k: int = 128

  @classmethod
  def get_default(cls) -> "BlockSizes":
    return cls()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockStats:
  """Per-query, per-key-block softmax statistics.

  Attributes:
    max_logit: ``[b, h, q, n_blocks]`` float32 max real logit of the block
      (-inf where the block has no real key for this query).
    denom: ``[b, h, q, n_blocks]`` float32 sum_{i in block} e^{s_i -
      max_logit} (0 where empty): the block's mass as a (max, sum) pair,
      what ``core.PartialSoftmax.from_stats`` takes.
    lse: ``[b, h, q, n_blocks]`` float32 log sum_{i in block} e^{s_i}
      (-inf where empty), for selection.
    count: ``[b, h, q, n_blocks]`` int32 real keys of the block visible to
      the query (padding and causal masks applied).
    bad: ``[b, h, q, n_blocks]`` int32 visible real keys whose logit is NaN
      or +inf (their row is invalid, ``core.row_valid``).
  """

  max_logit: jax.Array
  denom: jax.Array
  lse: jax.Array
  count: jax.Array
  bad: jax.Array


def _kernel(
  q_ref,
  k_ref,
  kvm_ref,
  m_ref,
  l_ref,
  cnt_ref,
  bad_ref,
  *,
  scale,
  causal,
  bq,
  bk,
):
  """One (query tile, key block): refs q [bq, d], k [bk, d], kvm [1, bk]."""
  qi, kj = pl.program_id(1), pl.program_id(2)
  q = q_ref[...]
  k = k_ref[...]
  s = lax.dot_general(
    q,
    k,
    (((1,), (1,)), ((), ())),
    preferred_element_type=jnp.float32,
    precision=_common.PRECISION,
  )  # [bq, bk]
  s = s * scale
  valid = kvm_ref[...] != 0  # [1, bk]
  if causal:
    qpos = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    kpos = kj * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    valid = valid & (kpos <= qpos)
  else:
    valid = jnp.broadcast_to(valid, (bq, bk))
  # NaN (s != s) or +inf logits: counted, then kept out of the masses.
  broken = valid & ((s != s) | (s > jnp.finfo(jnp.float32).max))
  ok = valid & ~broken
  s = jnp.where(ok, s, _common.MASK_VALUE)
  # >= MASK_VALUE: a block of -inf logits (overflow) gives exp(-inf) = 0.
  m = jnp.maximum(jnp.max(s, axis=1, keepdims=True), _common.MASK_VALUE)
  p = jnp.where(ok, jnp.exp(s - m), 0.0)
  m_ref[...] = m
  l_ref[...] = jnp.sum(p, axis=1, keepdims=True)  # [bq, 1]
  cnt_ref[...] = jnp.sum(valid.astype(jnp.float32), axis=1, keepdims=True)
  bad_ref[...] = jnp.sum(broken.astype(jnp.float32), axis=1, keepdims=True)


@functools.partial(
  jax.jit,
  static_argnames=(
    "scale",
    "is_causal",
    "block_sizes",
    "backend",
    "interpret",
  ),
)
def block_stats(
  query,
  key,
  *,
  mask=None,
  scale: float | None = None,
  is_causal: bool = False,
  block_sizes: BlockSizes | None = None,
  backend: str | None = None,
  interpret: bool = False,
) -> BlockStats:
  """Exact per-query, per-key-block max logit and log-sum-exp (Pallas).

  THEORY 3.3: the block masses e^{lse_qb} whose sum over dropped blocks is the
  tail mass Z_T of block-sparse attention.

  Args:
    query: ``[batch, heads, q_len, head_dim]``.
    key: ``[batch, kv_heads, kv_len, head_dim]``; heads % kv_heads == 0 (GQA).
    mask: optional ``[batch, kv_len]`` bool, True for a real key.
    scale: logit scale, default 1/sqrt(head_dim).
    is_causal: query i sees keys j <= i (top-left aligned, as jax.nn).
    block_sizes: tiling; ``BlockSizes.get_default()`` if None.
    backend: 'tpu' or 'gpu' grid style (see ``_common``); None picks by
      platform.
    interpret: run the kernel in Pallas interpret mode (CPU).

  Returns:
    BlockStats with ``n_blocks = ceil(kv_len / block_k)``.

  Example:
    >>> q = jnp.ones((1, 2, 16, 8)); k = jnp.ones((1, 2, 40, 8))
    >>> st = block_stats(q, k, block_sizes=BlockSizes(8, 16), interpret=True)
    >>> st.lse.shape
    (1, 2, 16, 3)
  """
  _common.check_head_major(query, key)
  bs = block_sizes or BlockSizes.get_default()
  backend = _common.resolve_backend(backend)
  b, h, nq, d = query.shape
  hkv, nk = key.shape[1], key.shape[2]
  scale = float(d**-0.5 if scale is None else scale)
  bq, bk = bs.block_q, bs.block_k
  kvm = _common.pad_to(_common.kv_mask_array(mask, b, nk), 2, bk)
  if backend == "gpu":  # power-of-2 head dim >= 16 (exact zero terms)
    _common.check_gpu_block("block_q", bq)
    _common.check_gpu_block("block_k", bk)
    query, key = map(_common.pad_last_for_triton, (query, key))
    d = query.shape[-1]
  q = _common.pad_to(query, 2, bq).reshape(b * h, -1, d)
  k = _common.pad_to(key, 2, bk).reshape(b * hkv, -1, d)
  nq_p, nk_p = q.shape[1], k.shape[1]
  nqt, nkb = nq_p // bq, nk_p // bk

  def kv_row(i):
    return _common.kv_row(i, h, hkv)

  kernel = functools.partial(
    _kernel, scale=scale, causal=is_causal, bq=bq, bk=bk
  )
  out_spec = pl.BlockSpec((None, None, bq, 1), lambda i, qi, kj: (i, kj, qi, 0))
  stat = jax.ShapeDtypeStruct((b * h, nkb, nq_p, 1), jnp.float32)
  m, ell, cnt, bad = pl.pallas_call(
    kernel,
    grid=(b * h, nqt, nkb),
    in_specs=[
      pl.BlockSpec((None, bq, d), lambda i, qi, kj: (i, qi, 0)),
      pl.BlockSpec((None, bk, d), lambda i, qi, kj: (kv_row(i), kj, 0)),
      pl.BlockSpec((None, 1, bk), lambda i, qi, kj: (lax.div(i, h), 0, kj)),
    ],
    out_specs=[out_spec] * 4,
    out_shape=[stat] * 4,
    compiler_params=_common.compiler_params(
      backend, ("parallel", "parallel", "parallel")
    ),
    interpret=interpret,
    name="jaxtopk_block_stats",
  )(q, k, kvm)

  def unpack(x):
    x = x[..., 0].reshape(b, h, nkb, nq_p)[:, :, :, :nq]
    return jnp.swapaxes(x, 2, 3)  # [b, h, q, nb]

  return _stats(unpack(m), unpack(ell), unpack(cnt), unpack(bad))


def _stats(m, ell, cnt, bad) -> BlockStats:
  """BlockStats from raw (max, sum, count, bad) with empty blocks -inf."""
  has = ell > 0
  m = jnp.where(has, m, -jnp.inf)
  ell = jnp.where(has, ell, 0.0)
  lse = jnp.where(has, m + jnp.log(jnp.where(has, ell, 1.0)), -jnp.inf)
  return BlockStats(
    max_logit=m,
    denom=ell,
    lse=lse,
    count=cnt.astype(jnp.int32),
    bad=bad.astype(jnp.int32),
  )


def visible_mask(b, nq, nk, mask=None, is_causal=False) -> jax.Array:
  """``[b, 1, q, s]`` bool: key s is real and visible to query q."""
  vis = jnp.ones((b, 1, nq, nk), bool)
  if mask is not None:
    vis = vis & jnp.asarray(mask, bool)[:, None, None, :]
  if is_causal:
    vis = vis & jnp.tril(jnp.ones((nq, nk), bool))
  return vis


@functools.partial(jax.jit, static_argnames=("scale", "is_causal", "block_k"))
def block_stats_reference(
  query, key, *, mask=None, scale=None, is_causal=False, block_k: int = 128
) -> BlockStats:
  """Pure-jnp ``block_stats`` (same arguments; ``block_k`` as BlockSizes)."""
  _common.check_head_major(query, key)
  b, h, nq, d = query.shape
  hkv, nk = key.shape[1], key.shape[2]
  scale = d**-0.5 if scale is None else scale
  kk = jnp.repeat(key, h // hkv, axis=1)
  s = jnp.einsum(
    "bhqd,bhkd->bhqk",
    query.astype(jnp.float32),
    kk.astype(jnp.float32),
    precision=_common.PRECISION,
  )  # [b, h, q, s]
  s = s * scale
  vis = jnp.broadcast_to(visible_mask(b, nq, nk, mask, is_causal), s.shape)
  s = _common.pad_to(s, 3, block_k)
  vis = _common.pad_to(vis, 3, block_k, False)
  nb = s.shape[3] // block_k
  s = s.reshape(b, h, nq, nb, block_k)  # [b, h, q, nb, bk]
  vis = vis.reshape(b, h, nq, nb, block_k)
  broken = vis & (jnp.isnan(s) | (s == jnp.inf))
  ok = vis & ~broken
  m = jnp.max(jnp.where(ok, s, -jnp.inf), axis=-1)
  ms = jnp.where(jnp.isfinite(m), m, 0.0)[..., None]
  ell = jnp.sum(jnp.where(ok, jnp.exp(jnp.where(ok, s, ms) - ms), 0.0), -1)
  return _stats(
    m,
    ell,
    jnp.sum(vis, axis=-1, dtype=jnp.int32),
    jnp.sum(broken, axis=-1, dtype=jnp.int32),
  )
