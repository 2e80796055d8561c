"""Certified block-sparse prefill: block stats -> selection -> sparse flash.

The pipeline for a whole sequence of queries (THEORY 3.3, 6.1):

1. ``block_stats`` (Pallas) scores q against every key block and returns
   each block's exact mass as a (max, sum e^{s - max}) pair (q and k only;
   no values).
2. ``select_blocks`` (XLA) keeps, per query, blocks by mass until the
   dropped mass is <= eps (aiming below eps by the certificate's own
   rounding margin, ``core.search_log_margin``), and takes the union over
   each query tile.
3. ``sparse_flash_stats`` (Pallas) attends to the kept blocks only with the
   core's ``online_step`` and returns the normalised output and the kept
   keys' (max, sum, rounding) statistics.
4. The certificate comes from the certificate core only: the kept part and
   every dropped block become ``core.PartialSoftmax``s (``from_stats``), the
   dropped blocks are merged by ``PartialSoftmax.reduce`` and the head by
   ``core.merge``, and ``finalize`` rounds up for the logits' own error
   (``core.logit_error_bound`` from per-block key summaries, subnormal
   inputs included) and the sums'.

keys_scored counts both passes: every real visible key is scored once by the
statistics pass and the kept ones again by the sparse pass. The statistics
pass is what makes the block masses exact; it costs one QK^T (no softmax over
values, no PV product).

Values: a masked key's value is never read into an output (masked values are
zeroed before the kernel, so a NaN there changes nothing); a non-finite
value of a REAL key makes the rows that attend to its block invalid.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxtopk.kernels import _block_stats
from jaxtopk.kernels import _common
from jaxtopk.kernels import _select
from jaxtopk.kernels import _sparse_flash
from jaxtopk.selection import Certificate
from jaxtopk.selection import core


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
  kernels = dict(backend=backend, interpret=interpret)
  return _pipeline(
    query,
    key,
    value,
    eps=eps,
    mask=mask,
    scale=scale,
    is_causal=is_causal,
    max_blocks=max_blocks,
    bs=bs,
    kernels=kernels,
  )


def _pipeline(
  query, key, value, *, eps, mask, scale, is_causal, max_blocks, bs, kernels
):
  """Stats -> selection -> sparse attention -> certificate.

  ``kernels`` is None for the pure-jnp references, else the Pallas
  ``backend`` / ``interpret`` arguments.
  """
  b, h, nq, _ = query.shape
  nk = key.shape[2]
  bq, bk = bs.block_q, bs.block_k
  # Selection and certificate are piecewise constant in q, k (THEORY 8.2):
  # gradients flow only through the sparse kernel's softmax.
  sq, sk = jax.lax.stop_gradient(query), jax.lax.stop_gradient(key)
  summary = _common.key_summary(sk, block_size=bk, mask=mask)
  delta = _common.logit_error(sq, summary, scale=scale)  # [b, h, q]
  n_terms = nk + _common.cdiv(nk, bk)
  if mask is not None:  # a masked value is never read, even as 0 * NaN
    value = jnp.where(jnp.asarray(mask, bool)[:, None, :, None], value, 0)
  if eps == 0.0 and kernels is not None:
    # Dense: every visible block is kept, no statistics pass is needed.
    st = None
    idx, count = _all_blocks(b, h, nq, nk, bq, bk, is_causal)
    kept = None
  else:
    if kernels is None:
      st = _block_stats.block_stats_reference(
        sq, sk, mask=mask, scale=scale, is_causal=is_causal, block_k=bk
      )
    else:
      st = _block_stats.block_stats(
        sq,
        sk,
        mask=mask,
        scale=scale,
        is_causal=is_causal,
        block_sizes=_block_stats.BlockSizes(bq, bk),
        **kernels,
      )
    margin = core.search_log_margin(n_terms, delta, delta.dtype)
    sel = _select.select_blocks(
      st.lse, eps=eps, block_q=bq, max_blocks=max_blocks, log_margin=margin
    )
    idx, count, kept = sel.block_idx, sel.block_count, sel.kept
  flash = dict(mask=mask, scale=scale, is_causal=is_causal)
  if kernels is None:
    out, _, fs = _sparse_flash.sparse_flash_stats_reference(
      query, key, value, idx, count, block_q=bq, block_k=bk, **flash
    )
  else:
    out, _, fs = _sparse_flash.sparse_flash_stats(
      query, key, value, idx, count, block_sizes=bs, **flash, **kernels
    )
  cert_out, cert = prefill_certificate(
    jax.lax.stop_gradient(value),
    out,
    fs,
    st,
    kept,
    delta=delta,
    mask=mask,
    is_causal=is_causal,
    n_terms=n_terms,
    block_q=bq,
    block_k=bk,
  )
  # The certificate's output is the kernel's with invalid rows zeroed; keep
  # the kernel's (differentiable) values on valid rows.
  out = jnp.where(cert.valid[..., None], out, jnp.zeros((), out.dtype))
  del cert_out
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
  return _pipeline(
    query,
    key,
    value,
    eps=eps,
    mask=mask,
    scale=scale,
    is_causal=is_causal,
    max_blocks=max_blocks,
    bs=bs,
    kernels=None,
  )


def _all_blocks(b, h, nq, nk, bq, bk, is_causal):
  """Block lists keeping every (visible) key block of every query tile."""
  nqt, nkb = _common.cdiv(nq, bq), _common.cdiv(nk, bk)
  blk = jnp.arange(nkb, dtype=jnp.int32)
  if is_causal:
    last_q = jnp.minimum((jnp.arange(nqt) + 1) * bq - 1, nq - 1)  # [nqt]
    count = (last_q // bk + 1).astype(jnp.int32)  # blocks 0..last_q // bk
    count = jnp.minimum(count, nkb)
    idx = jnp.minimum(blk[None, :], count[:, None] - 1)  # [nqt, nkb]
  else:
    count = jnp.full((nqt,), nkb, jnp.int32)
    idx = jnp.broadcast_to(blk, (nqt, nkb))
  idx = jnp.broadcast_to(idx, (b, h, nqt, nkb))
  count = jnp.broadcast_to(count, (b, h, nqt))
  return idx, count


def _block_norms(value, *, block_size, mask):
  """``[b, h_kv, nb]`` max ||v_j|| over each block's real keys (rounded up;
  NaN where a real value is not finite: ``core.value_norms``)."""
  b, hkv, n, _ = value.shape
  v = _common.pad_to(value, 2, block_size)
  nb = v.shape[2] // block_size
  norms = core.value_norms(v).reshape(b, hkv, nb, block_size)
  real = jnp.ones((b, n), bool) if mask is None else jnp.asarray(mask, bool)
  real = _common.pad_to(real, 1, block_size, False).reshape(b, 1, nb, -1)
  return core.max_norm(norms, real)


def prefill_certificate(
  value,
  out,
  flash_stats,
  stats,
  kept_tiles,
  *,
  delta,
  mask,
  is_causal,
  n_terms,
  block_q,
  block_k,
) -> tuple[jax.Array, Certificate]:
  """Output and Certificate of block-sparse attention (by the core only).

  Args:
    value: ``[b, h_kv, s, v_dim]`` values (head-major).
    out: ``[b, h, q, v_dim]`` the sparse kernel's normalised output.
    flash_stats: the kept keys' ``FlashStats`` (``[b, h, q]``).
    stats: BlockStats of every block (None for dense: everything kept).
    kept_tiles: ``[b, h, n_q_tiles, n_blocks]`` kept blocks per query tile
      (None for dense).
    delta: ``[b, h, q]`` bound on every logit's rounding
      (``core.logit_error_bound``).
    mask: ``[b, s]`` key-padding mask or None.
    is_causal: the causal mask was applied.
    n_terms: terms reduced into the masses (keys plus blocks).
    block_q, block_k: tiling.

  Returns:
    ``(output, certificate)``: the output in ``out``'s dtype with invalid
    rows zeroed, and a Certificate with fields ``[b, h, q]``.
  """
  b, h, nq, _ = out.shape
  nk = value.shape[2]
  g = h // value.shape[1]
  vnorm = _block_norms(value, block_size=block_k, mask=mask)
  vnorm = jnp.repeat(vnorm, g, axis=1)[:, :, None, :]  # [b, h, 1, nb]
  bad = jnp.isnan(vnorm)  # a real value is not finite
  vnorm_ok = jnp.where(bad, 0.0, vnorm)
  if stats is None:
    vis = _block_stats.visible_mask(b, nq, nk, mask, is_causal)  # [b,1,q,s]
    vis = _common.pad_to(vis, 3, block_k, False)
    cnt = jnp.sum(vis.reshape(b, 1, nq, -1, block_k), -1, dtype=jnp.int32)
    cnt = jnp.broadcast_to(cnt, (b, h, nq, cnt.shape[-1]))  # [b, h, q, nb]
    kept = cnt > 0
    logits_ok = True
  else:
    cnt = stats.count
    kept = jnp.repeat(kept_tiles, block_q, axis=2)[:, :, :nq] & (cnt > 0)
    logits_ok = jnp.sum(stats.bad, axis=-1) == 0
  k_kept = jnp.sum(jnp.where(kept, cnt, 0), axis=-1)
  scored = k_kept if stats is None else jnp.sum(cnt, axis=-1) + k_kept
  head = core.PartialSoftmax.from_stats(
    flash_stats.m,
    flash_stats.denom,
    o=out,
    err=flash_stats.err,
    logit_error=delta,
    k_kept=k_kept,
    keys_scored=scored,
    head_norm=core.max_norm(vnorm_ok, kept),
    tail_norm=0.0,
    logits_ok=logits_ok & ~jnp.any(bad & kept, axis=-1),
  )
  if stats is not None:
    dropped = (cnt > 0) & ~kept
    tails = core.PartialSoftmax.from_stats(
      stats.max_logit,
      jnp.where(dropped, stats.denom, 0.0),
      tail=True,
      logit_error=delta[..., None],
      head_norm=0.0,
      tail_norm=jnp.where(dropped, vnorm, 0.0),  # NaN: a broken value
    )
    tail = core.PartialSoftmax.reduce(tails, -1)
    tail = dataclasses.replace(tail, o=jnp.zeros_like(head.o))
    head = core.merge(head, tail)
  o, cert = head.finalize(n_terms=n_terms)
  return o.astype(out.dtype), cert
