"""``implementation='pallas'`` for ``topk_attention`` and ``decode_attention``.

Registered with the attention layer's hooks when ``jaxtopk.kernels`` is
imported (``jaxtopk`` imports it). What the Pallas backend supports:

- policies: ``Dense()`` (eps = 0: every block with mass is kept) and
  ``Certified(eps)``. Selection is at BLOCK granularity (whole key blocks of
  ``Certified.block_size`` keys are kept or dropped), so the kept set is a
  superset-by-blocks rather than the XLA path's minimal key set: both
  certify tau <= eps, their outputs differ by at most the sum of their
  output-error bounds. Prefill keeps blocks by exact mass (``block_stats``);
  decode runs Delta-Search over the cache's box summaries for every
  ``Certified.search`` ('exact', 'delta' and 'mc' all give the
  deterministic Delta-Search certificate, failure_prob 0).
- masks: key padding only (a mask that broadcasts from ``[batch, 1, 1,
  kv_len]``) and ``is_causal``; no ``bias``.
- On CPU the kernels run in interpret mode (correct, not fast).

Anything else raises NotImplementedError naming what is not supported.
"""

import jax
import jax.numpy as jnp

from jaxtopk import attention
from jaxtopk.kernels import _decode
from jaxtopk.kernels import _prefill
from jaxtopk.kernels import _sparse_flash
from jaxtopk.selection import _policies


def _eps(policy) -> float:
  if isinstance(policy, _policies.Dense):
    return 0.0
  if isinstance(policy, _policies.Certified):
    return float(policy.eps)
  raise NotImplementedError(
    f"implementation='pallas' supports Dense() and Certified(eps) policies;"
    f" got {policy=}. Use implementation='xla'."
  )


def _interpret() -> bool:
  return jax.default_backend() == "cpu"


def _key_padding(mask, b, s):
  """``[b, s]`` key mask from a mask broadcastable to [b, h, t, s]."""
  if mask is None:
    return None
  mask = jnp.asarray(mask, bool)
  shape = (1,) * (4 - mask.ndim) + mask.shape
  if shape[1] != 1 or shape[2] != 1:
    raise NotImplementedError(
      f"implementation='pallas' supports key-padding masks that broadcast"
      f" from [batch, 1, 1, kv_len]; got mask.shape={jnp.shape(mask)}."
    )
  return jnp.broadcast_to(mask.reshape(shape)[:, 0, 0, :], (b, s))


def _block_q(q_len: int) -> int:
  return min(128, max(16, 1 << (q_len - 1).bit_length()))


def pallas_topk_attention(
  query, key, value, *, policy, mask, bias, is_causal, scale, values_bound
):
  """``topk_attention`` on the Pallas kernels (see module docstring)."""
  if bias is not None:
    raise NotImplementedError("implementation='pallas' does not take bias")
  eps = _eps(policy)
  block_k = getattr(policy, "block_size", 128)
  b, t, _, _ = query.shape
  s = key.shape[1]
  out, cert = _prefill.certified_sparse_attention(
    jnp.swapaxes(query, 1, 2),
    jnp.swapaxes(key, 1, 2),
    jnp.swapaxes(value, 1, 2),
    eps=eps,
    mask=_key_padding(mask, b, s),
    scale=scale,
    is_causal=is_causal,
    block_sizes=_sparse_flash.BlockSizes(_block_q(t), block_k),
    interpret=_interpret(),
  )
  cert = jax.tree.map(lambda x: jnp.swapaxes(x, 1, 2), cert)  # [b, t, h]
  if not values_bound:
    cert = cert.__class__(
      tv_bound=cert.tv_bound,
      log_tv_bound=cert.log_tv_bound,
      k_kept=cert.k_kept,
      keys_scored=cert.keys_scored,
      output_error_bound=None,
      valid=cert.valid,
    )
  return jnp.swapaxes(out, 1, 2), cert


def pallas_decode_attention(query, cache, rng, *, policy, scale):
  """``decode_attention`` on the Pallas decode kernel (see module docstring)."""
  del rng  # Delta-Search is deterministic.
  eps = _eps(policy)
  b, _, h, _ = query.shape
  box = cache.box()
  out, cert = _decode.certified_decode(
    query[:, 0],
    cache.keys,
    cache.values,
    eps=eps,
    mask=cache.valid()[:, 0],
    scale=scale,
    summary=box,
    value_norms=cache.vnorm,
    block_sizes=_decode.BlockSizes(cache.block_size, _decode_splits(cache)),
    interpret=_interpret(),
  )
  out = out[:, None]  # [b, 1, h, dv]
  cert = jax.tree.map(lambda x: x[:, None], cert)  # [b, 1, h]
  return out, cert


def _decode_splits(cache) -> int:
  # Each split stops on its own share of the budget and scores at least its
  # first block, so splits only pay on long caches: at least 16 blocks each.
  return max(1, min(8, cache.num_blocks // 16))


def register() -> None:
  """Registers 'pallas' with ``topk_attention`` and ``decode_attention``."""
  attention.register_implementation("pallas", pallas_topk_attention)
  attention.register_decode_implementation("pallas", pallas_decode_attention)
