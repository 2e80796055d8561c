"""Certified block-sparse prefill: block stats -> selection -> sparse flash.

The pipeline of issue #4 for a whole sequence of queries (THEORY 3.3, 6.1):

1. ``block_stats`` (Pallas) scores q against every key block and returns the
   exact block masses e^{lse_qb} (q and k only; no values).
2. ``select_blocks`` (XLA) keeps, per query, blocks by mass until the dropped
   mass is <= eps, and takes the union over each query tile.
3. ``sparse_flash_attention`` (Pallas) attends to the kept blocks only and
   returns log Z_H.
4. ``_certify.certificate`` bounds tau with the dropped blocks' exact masses
   and the kernel's head mass, rounding slack included.

keys_scored counts both passes: every real visible key is scored once by the
statistics pass and the kept ones again by the sparse pass. The statistics
pass is what makes the block masses exact; it costs one QK^T (no softmax over
values, no PV product).
"""

import functools

import jax
import jax.numpy as jnp

from jaxtopk.kernels import _block_stats
from jaxtopk.kernels import _certify
from jaxtopk.kernels import _common
from jaxtopk.kernels import _select
from jaxtopk.kernels import _sparse_flash
from jaxtopk.selection import Certificate


@functools.partial(
  jax.jit,
  static_argnames=(
    "eps",
    "scale",
    "is_causal",
    "max_blocks",
    "block_sizes",
    "backend",
    "interpret",
  ),
)
def certified_sparse_attention(
  query,
  key,
  value,
  *,
  eps: float,
  mask=None,
  scale: float | None = None,
  is_causal: bool = False,
  max_blocks: int | None = None,
  block_sizes: _sparse_flash.BlockSizes | None = None,
  backend: str | None = None,
  interpret: bool = False,
) -> tuple[jax.Array, Certificate]:
  """Block-sparse attention with a certificate on the dropped mass.

  Args:
    query: ``[batch, heads, q_len, head_dim]``.
    key: ``[batch, kv_heads, kv_len, head_dim]`` (GQA).
    value: ``[batch, kv_heads, kv_len, v_dim]``.
    eps: per-query dropped-mass budget in [0, 1); 0 is dense attention
      (every block kept, no statistics pass, certificate tau = 0).
    mask: optional ``[batch, kv_len]`` bool, True for a real key.
    scale: logit scale, default 1/sqrt(head_dim).
    is_causal: top-left causal mask, as jax.nn.
    max_blocks: optional static cap on kept blocks per query tile (the
      certificate then reports what was really dropped, possibly > eps).
    block_sizes: tiling shared by both kernels.
    backend: 'tpu' or 'gpu' grid style; None picks by platform.
    interpret: Pallas interpret mode (CPU).

  Returns:
    (output ``[b, h, q, v_dim]`` in the query dtype, Certificate with fields
    ``[b, h, q]``). Where eps is met and valid, ``tv_bound <= eps`` up to
    the rounding slack.
  """
  _common.check_head_major(query, key, value)
  bs = block_sizes or _sparse_flash.BlockSizes.get_default()
  d = query.shape[-1]
  if not 0.0 <= eps < 1.0:
    raise ValueError(f"{eps=} must be in [0, 1)")
  scale = float(d**-0.5 if scale is None else scale)
  if eps == 0.0:
    # Dense: every block is kept, no statistics pass is needed, and the
    # certificate is tau = 0 (keys_scored = the visible keys, as dense).
    return _dense(
      query, key, value, mask, scale, is_causal, bs, backend, interpret
    )
  # Selection and certificate are piecewise constant in q, k (THEORY 8.2):
  # gradients flow only through the sparse kernel's softmax.
  sq, sk = jax.lax.stop_gradient(query), jax.lax.stop_gradient(key)
  st = _block_stats.block_stats(
    sq,
    sk,
    mask=mask,
    scale=scale,
    is_causal=is_causal,
    block_sizes=_block_stats.BlockSizes(bs.block_q, bs.block_k),
    backend=backend,
    interpret=interpret,
  )
  sel = _select.select_blocks(
    st.lse, eps=eps, block_q=bs.block_q, max_blocks=max_blocks
  )
  out, lse_h = _sparse_flash.sparse_flash_attention(
    query,
    key,
    value,
    sel.block_idx,
    sel.block_count,
    mask=mask,
    scale=scale,
    is_causal=is_causal,
    block_sizes=bs,
    backend=backend,
    interpret=interpret,
  )
  cert = prefill_certificate(
    sq,
    sk,
    jax.lax.stop_gradient(value),
    jax.lax.stop_gradient(out),
    lse_h,
    st,
    sel.kept,
    mask=mask,
    scale=scale,
    block_q=bs.block_q,
    block_k=bs.block_k,
  )
  return out, cert


@functools.partial(
  jax.jit,
  static_argnames=("eps", "scale", "is_causal", "max_blocks", "block_sizes"),
)
def certified_sparse_attention_reference(
  query,
  key,
  value,
  *,
  eps: float,
  mask=None,
  scale: float | None = None,
  is_causal: bool = False,
  max_blocks: int | None = None,
  block_sizes: _sparse_flash.BlockSizes | None = None,
) -> tuple[jax.Array, Certificate]:
  """Pure-jnp ``certified_sparse_attention`` (same arguments, no kernels).

  The same pipeline with ``block_stats_reference`` and
  ``sparse_flash_attention_reference`` in place of the kernels; eps = 0
  also goes through the statistics pass (every block with mass is kept, so
  the output is dense attention and tau = 0 as well).
  """
  _common.check_head_major(query, key, value)
  bs = block_sizes or _sparse_flash.BlockSizes.get_default()
  if not 0.0 <= eps < 1.0:
    raise ValueError(f"{eps=} must be in [0, 1)")
  scale = float(query.shape[-1] ** -0.5 if scale is None else scale)
  st = _block_stats.block_stats_reference(
    query, key, mask=mask, scale=scale, is_causal=is_causal, block_k=bs.block_k
  )
  sel = _select.select_blocks(
    st.lse, eps=eps, block_q=bs.block_q, max_blocks=max_blocks
  )
  out, lse_h = _sparse_flash.sparse_flash_attention_reference(
    query,
    key,
    value,
    sel.block_idx,
    sel.block_count,
    mask=mask,
    scale=scale,
    is_causal=is_causal,
    block_q=bs.block_q,
    block_k=bs.block_k,
  )
  cert = prefill_certificate(
    query,
    key,
    value,
    out,
    lse_h,
    st,
    sel.kept,
    mask=mask,
    scale=scale,
    block_q=bs.block_q,
    block_k=bs.block_k,
  )
  return out, cert


def _dense(query, key, value, mask, scale, is_causal, bs, backend, interpret):
  b, h, nq, _ = query.shape
  nk = key.shape[2]
  bq, bk = bs.block_q, bs.block_k
  nqt, nkb = _common.cdiv(nq, bq), _common.cdiv(nk, bk)
  blk = jnp.arange(nkb, dtype=jnp.int32)
  if is_causal:
    last_q = jnp.minimum((jnp.arange(nqt) + 1) * bq - 1, nq - 1)  # [nqt]
    count = (last_q // bk + 1).astype(jnp.int32)  # blocks 0..last_q // bk
    idx = jnp.minimum(blk[None, :], count[:, None] - 1)  # [nqt, nkb]
  else:
    count = jnp.full((nqt,), nkb, jnp.int32)
    idx = jnp.broadcast_to(blk, (nqt, nkb))
  idx = jnp.broadcast_to(idx, (b, h, nqt, nkb))
  count = jnp.broadcast_to(count, (b, h, nqt))
  out, lse_h = _sparse_flash.sparse_flash_attention(
    query,
    key,
    value,
    idx,
    count,
    mask=mask,
    scale=scale,
    is_causal=is_causal,
    block_sizes=bs,
    backend=backend,
    interpret=interpret,
  )
  vis = _block_stats.visible_mask(b, nq, nk, mask, is_causal)
  n_vis = jnp.broadcast_to(jnp.sum(vis, -1, dtype=jnp.int32), (b, h, nq))
  none = jnp.zeros((b, h, nq, 1), bool)
  cert = _certify.certificate(
    log_head=jax.lax.stop_gradient(lse_h),
    head_slack=jnp.zeros_like(lse_h),
    log_tail_terms=jnp.zeros((b, h, nq, 1), jnp.float32),
    tail_present=none,
    k_kept=n_vis,
    keys_scored=n_vis,
    n_terms=nk,
    out_norm=jnp.zeros_like(lse_h),
    tail_value_norm=jnp.zeros_like(lse_h),
    out_dtype=out.dtype,
  )
  return out, cert


def prefill_certificate(
  query,
  key,
  value,
  out,
  lse_head,
  stats,
  kept_tiles,
  *,
  mask,
  scale,
  block_q,
  block_k,
) -> Certificate:
  """Certificate of block-sparse attention from exact block masses.

  Args:
    query, key, value: the attention inputs (head-major).
    out: ``[b, h, q, v_dim]`` the sparse output.
    lse_head: ``[b, h, q]`` log Z_H from the sparse kernel.
    stats: BlockStats of the same inputs.
    kept_tiles: ``[b, h, n_q_tiles, n_blocks]`` kept blocks per query tile.
    mask, scale, block_q, block_k: as used by the kernels.

  Returns:
    Certificate with fields ``[b, h, q]``.
  """
  b, h, nq, _ = query.shape
  hkv = key.shape[1]
  g = h // hkv
  kept = jnp.repeat(kept_tiles, block_q, axis=2)[:, :, :nq]  # [b,h,q,nb]
  slack = _common.logit_slack(
    query,
    _common.block_abs_max(key, block_size=block_k, mask=mask),
    scale=scale,
  )  # [b, h, q, nb]
  has = stats.count > 0
  tail = has & ~kept
  head_slack = jnp.max(jnp.where(kept & has, slack, 0.0), axis=-1)
  cnt = stats.count
  k_kept = jnp.sum(jnp.where(kept, cnt, 0), axis=-1)
  scored = jnp.sum(cnt, axis=-1) + k_kept
  vnorm = _certify.block_value_norms(value, block_size=block_k, mask=mask)
  vnorm = jnp.repeat(vnorm, g, axis=1)[:, :, None, :]  # [b, h, 1, nb]
  tail_v = jnp.max(jnp.where(tail, vnorm, 0.0), axis=-1)
  out_norm = jnp.sqrt(jnp.sum(out.astype(jnp.float32) ** 2, axis=-1))
  return _certify.certificate(
    log_head=lse_head,
    head_slack=head_slack,
    log_tail_terms=stats.lse + slack,
    tail_present=tail,
    k_kept=k_kept,
    keys_scored=scored,
    n_terms=key.shape[2] + stats.lse.shape[-1],
    out_norm=out_norm,
    tail_value_norm=tail_v,
    out_dtype=out.dtype,
  )
