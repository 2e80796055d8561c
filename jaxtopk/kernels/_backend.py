"""``implementation='pallas'`` for ``topk_attention`` and ``decode_attention``.

Two ops of the attention registry (``attention.registry``), 'pallas_prefill'
and 'pallas_decode' (``PREFILL_OP``, ``DECODE_OP``), registered when
``jaxtopk.kernels`` is imported (``jaxtopk`` imports it). Every policy field
is honoured or refused by name (``Policy.require`` with the capabilities
below), and so is every argument (the ops' declarations):

- prefill (``PREFILL_SUPPORTS``): ``Dense()`` and ``Certified(eps)`` with
  the exact search: every logit is scored by ``block_stats`` and whole key
  blocks of ``Certified.block_size`` keys are kept by exact mass (the kept
  set is the fewest BLOCKS meeting eps, a superset-by-blocks of the XLA
  path's minimal key set: both certify tau <= eps); ``max_topk`` keeps at
  most ``max_topk // block_size`` blocks per query (a ``max_topk`` below
  ``block_size`` cannot be met with whole blocks and is refused).
- decode (``DECODE_SUPPORTS``): ``Dense()`` and ``Certified(eps,
  search='delta')`` with the box bound (Delta-Search over the cache's block
  boxes; ``Certified.block_size`` must equal the cache's); ``max_topk``
  caps the scored blocks (one split; refused below the block size).
  'exact' (every logit scored, minimal key set) and 'mc' (sampling) are
  other searches than the kernel's and are refused by name, never mapped.
- Fixed-count policies (FixedK, Ratio, PowerLaw) are refused (a kernel
  that keeps whole blocks cannot keep exactly k keys).
- masks: key padding only (a mask that broadcasts from ``[batch, 1, 1,
  kv_len]``, and ``key_value_seq_lengths``, which is one) and
  ``is_causal``; no ``bias``, ``query_seq_lengths``, ``local_window_size``
  or ``return_residual``; a static scale. Anything else raises
  NotImplementedError naming the argument.
- On CPU the kernels run in interpret mode (correct, not fast).
"""

import dataclasses

import jax
import jax.numpy as jnp

from jaxtopk.attention import KVCache
from jaxtopk.attention import checks
from jaxtopk.attention import registry
from jaxtopk.kernels import _common
from jaxtopk.kernels import _decode
from jaxtopk.kernels import _prefill
from jaxtopk.kernels import _sparse_flash
from jaxtopk.selection import UnsupportedPolicyError
from jaxtopk.selection.internal import capabilities

PREFILL = "topk_attention(implementation='pallas')"
DECODE = "decode_attention(implementation='pallas')"
PREFILL_SUPPORTS = capabilities(
  "policy=Dense", "policy=Certified", "search=exact", "max_topk"
)
DECODE_SUPPORTS = capabilities(
  "policy=Dense", "policy=Certified", "search=delta", "bound=box", "max_topk"
)
_DENSE_BLOCK = 128


def _prefill_supports(policy) -> frozenset[str]:
  """``PREFILL_SUPPORTS``, less Certified where the compiled GPU kernels
  cannot tile its ``block_size`` (Triton: powers of 2 >= 16)."""
  if (
    policy.kind == "certified"
    and _common.resolve_backend(None) == "gpu"
    and not _common.triton_block_ok(policy.block_size)
  ):
    return PREFILL_SUPPORTS - {"policy=Certified"}
  return PREFILL_SUPPORTS


def _interpret() -> bool:
  return jax.default_backend() == "cpu"


def _static_scale(scale, head_dim, backend) -> float:
  scale = checks.check_scale(scale, head_dim)
  if not isinstance(scale, float):
    raise NotImplementedError(
      f"{backend} needs a static (Python number) scale; got a"
      f" {type(scale).__name__}. Use implementation='xla' for a traced scale."
    )
  return scale


def _max_blocks(policy, block_size, backend) -> int | None:
  """``Certified.max_topk`` as a cap on whole blocks, or a refusal."""
  cap = getattr(policy, "max_topk", None)
  if cap is None:
    return None
  if cap < block_size:
    raise UnsupportedPolicyError(
      f"Certified.max_topk={cap} is not supported by {backend} with"
      f" block_size={block_size}: it keeps whole blocks, so max_topk must be"
      " >= the block size"
    )
  return cap // block_size


def _key_padding(mask, b, s):
  """``[b, s]`` key mask from a key-padding mask (``PREFILL_OP.masks``)
  broadcastable to [b, h, t, s]."""
  if mask is None:
    return None
  mask = jnp.asarray(mask, bool)
  shape = (1,) * (4 - mask.ndim) + mask.shape
  return jnp.broadcast_to(mask.reshape(shape)[:, 0, 0, :], (b, s))


def _block_q(q_len: int) -> int:
  return min(128, max(16, 1 << (q_len - 1).bit_length()))


def pallas_topk_attention(
  query,
  key,
  value,
  *,
  policy,
  mask,
  bias,
  is_causal,
  scale,
  values_bound,
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  local_window_size=None,
  return_residual=False,
):
  """``topk_attention`` on the Pallas kernels (see module docstring).

  Returns:
    ``(output, certificate)`` (the log-sum-exp residual is refused).
  """
  query, key, value, dims = checks.check_qkv(query, key, value)
  checks.check_policy(policy, PREFILL, PREFILL_SUPPORTS)
  is_causal = checks.check_is_causal(is_causal)
  mask = checks.check_mask(mask, dims.logits_shape)
  scale = checks.check_scale(scale, dims.head_dim)
  given = registry.prefill_arguments(
    bias=bias,
    mask=mask,
    is_causal=is_causal,
    query_seq_lengths=query_seq_lengths,
    key_value_seq_lengths=key_value_seq_lengths,
    local_window_size=local_window_size,
    return_residual=bool(return_residual),
    scale=scale,
  )
  PREFILL_OP.require(
    policy, given=given, mask_shape=None if mask is None else mask.shape
  )
  certified = policy.kind == "certified"
  block_k = policy.block_size if certified else _DENSE_BLOCK
  max_blocks = _max_blocks(policy, block_k, PREFILL)
  b, t, _, _ = query.shape
  s = key.shape[1]
  mask = _key_padding(mask, b, s)
  if key_value_seq_lengths is not None:  # a key-padding mask
    lens = checks.check_seq_lengths(
      key_value_seq_lengths, "key_value_seq_lengths", dims
    )
    pad = jnp.arange(s, dtype=jnp.int32)[None, :] < lens[:, None]  # [b, s]
    mask = pad if mask is None else mask & pad
  if dims.empty:
    out, cert = checks.empty_result(
      dims, query.dtype, values_bound=values_bound
    )
    return out, cert
  out, cert = _prefill.certified_sparse_attention(
    jnp.swapaxes(query, 1, 2),
    jnp.swapaxes(key, 1, 2),
    jnp.swapaxes(value, 1, 2),
    eps=float(policy.eps) if certified else 0.0,
    mask=mask,
    scale=scale,
    is_causal=is_causal,
    max_blocks=max_blocks,
    block_sizes=_sparse_flash.BlockSizes(_block_q(t), block_k),
    interpret=_interpret(),
  )
  cert = jax.tree.map(lambda x: jnp.swapaxes(x, 1, 2), cert)  # [b, t, h]
  if not values_bound:
    cert = dataclasses.replace(cert, output_error_bound=None)
  return jnp.swapaxes(out, 1, 2), cert


def _registered_prefill(*args, **kwargs):
  """``pallas_topk_attention`` as ``register_implementation`` calls it."""
  return (*pallas_topk_attention(*args, **kwargs), None)


def pallas_decode_attention(query, cache, rng, *, policy, scale):
  """``decode_attention`` on the Pallas decode kernel (see module docstring)."""
  del rng  # Delta-Search is deterministic.
  query = checks.check_array(query, "query")
  checks.check_policy(policy, DECODE, DECODE_SUPPORTS)
  bs = cache.block_size
  certified = policy.kind == "certified"
  if certified and policy.block_size != bs:
    raise UnsupportedPolicyError(
      f"Certified.block_size={policy.block_size} is not supported by {DECODE}"
      f" on a cache of block_size={bs}: Delta-Search scores the cache's"
      " blocks; they must be equal"
    )
  max_blocks = _max_blocks(policy, bs, DECODE)
  d = query.shape[-1]
  scale = _static_scale(scale, d, DECODE)
  splits = 1 if max_blocks is not None else _decode_splits(cache)
  out, cert = _decode.certified_decode(
    query[:, 0],
    cache.keys,
    cache.values,
    eps=float(policy.eps) if certified else 0.0,
    mask=cache.valid()[:, 0],
    scale=scale,
    summary=cache.box(),
    value_norms=cache.vnorm,
    max_blocks=max_blocks,
    block_sizes=_decode.BlockSizes(bs, splits),
    interpret=_interpret(),
  )
  out = out[:, None]  # [b, 1, h, dv]
  cert = jax.tree.map(lambda x: x[:, None], cert)  # [b, 1, h]
  return out, cert


def _decode_splits(cache) -> int:
  # Each split stops on its own share of the budget (its scored mass plus a
  # share of the heaviest block's, ``_decode.split_levels``), so splits only
  # pay on long caches: at least 16 blocks each.
  return max(1, min(8, cache.num_blocks // 16))


def _decode_op(query, cache, *, policy, scale, rng):
  """``pallas_decode_attention`` as the registry calls it (unchecked)."""
  scale, rng = checks.check_decode_call(query, cache, policy, scale, rng)
  return pallas_decode_attention(query, cache, rng, policy=policy, scale=scale)


PREFILL_OP = registry.AttentionOp(
  name="pallas_prefill",
  implementation="pallas",
  kind="prefill",
  fn=_registered_prefill,
  label=PREFILL,
  supports_fn=_prefill_supports,
  arguments=frozenset({"mask", "is_causal", "key_value_seq_lengths"}),
  masks="padding",
)
DECODE_OP = registry.AttentionOp(
  name="pallas_decode",
  implementation="pallas",
  kind="decode",
  fn=_decode_op,
  label=DECODE,
  supports=DECODE_SUPPORTS,
  cache_types=(KVCache,),  # a static scale only: no 'traced_scale'
)


def register() -> None:
  """Registers 'pallas' with ``topk_attention`` and ``decode_attention``."""
  registry.register(PREFILL_OP)
  registry.register(DECODE_OP)
