"""Helpers shared by the Pallas kernels: backends, padding, masks, summaries.

Two grid styles are used, one per target (DESIGN.md, "kernels"):

- ``'tpu'``: the key-block axis is a grid axis; the list of kept blocks
  reaches the kernel as scalar-prefetched indices (``PrefetchScalarGridSpec``)
  read by the BlockSpec index maps, so only kept blocks are DMA'd to VMEM;
  softmax statistics live in VMEM scratch across that axis (splash attention's
  pattern). Block shapes respect the (8, 128) tiling of the last two dims.
- ``'gpu'``: the grid covers (batch*heads, query tiles) only; the kernel loops
  over an index array of kept blocks and loads each key block with a dynamic
  ``pl.ds`` slice of the full key ref (Triton). Block shapes must be powers
  of 2 and at least 16 for ``dot``.

Both run in interpret mode on CPU, which is what the tests check.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from jaxtopk.selection import core

BACKENDS = ("tpu", "gpu")

# One finite mask value inside kernels (never -inf), as jax's Pallas ops do.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Every in-kernel dot at full float32 precision: the certificate's logit
# rounding bound assumes it (a TPU's default bf16 passes or a GPU's TF32
# would break it).
PRECISION = core.PRECISION


def resolve_backend(backend: str | None) -> str:
  """'gpu' on a GPU default backend, else 'tpu' (also used on CPU)."""
  if backend is None:
    return "gpu" if jax.default_backend() == "gpu" else "tpu"
  if backend not in BACKENDS:
    raise ValueError(f"{backend=} must be one of {BACKENDS} or None")
  return backend


def compiler_params(backend: str, semantics: tuple[str, ...]):
  """Compiler parameters for ``backend``."""
  if backend == "tpu":
    return pltpu.CompilerParams(dimension_semantics=semantics)
  return plgpu.CompilerParams(num_warps=4, num_stages=2)


def kv_row(i, heads: int, kv_heads: int):
  """Row of the flattened [b * kv_heads] K/V for flattened query head ``i``.

  Uses lax.div/rem (truncating; i >= 0): Mosaic TPU lowers ``//`` through
  ``sign``, which needs a TPU to be present.
  """
  g = heads // kv_heads
  return lax.div(i, heads) * kv_heads + lax.div(lax.rem(i, heads), g)


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def pad_to(x: jax.Array, axis: int, multiple: int, value=0) -> jax.Array:
  """Pads ``axis`` of ``x`` up to a multiple of ``multiple``."""
  n = x.shape[axis]
  pad = cdiv(n, multiple) * multiple - n
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


# Triton's smallest dot operand width (16-bit dot instructions are k16) and,
# rounded up to a power of 2, the width every GPU kernel array dim must have.
TRITON_MIN_WIDTH = 16


def triton_width(n: int) -> int:
  """Smallest power of 2 that is >= ``n`` and >= ``TRITON_MIN_WIDTH``."""
  return max(TRITON_MIN_WIDTH, 1 << max(n - 1, 0).bit_length())


def triton_block_ok(value: int, minimum: int = TRITON_MIN_WIDTH) -> bool:
  """Whether Triton lowers a tile of ``value`` (a power of 2 >= ``minimum``).

  Tiles are array dims inside the kernel, so they must be powers of 2 (the
  head dims are padded instead); a tile that is a ``dot`` operand's row
  count must also be at least 16.
  """
  return value >= minimum and not value & (value - 1)


def check_gpu_block(name: str, value: int, minimum: int = TRITON_MIN_WIDTH):
  """Refuses a ``'gpu'`` tile size Triton cannot lower, by name."""
  if not triton_block_ok(value, minimum):
    raise ValueError(
      f"{name}={value} must be a power of 2 >= {minimum} on the 'gpu'"
      " backend (the Pallas Triton lowering needs power-of-2 arrays)"
    )


def pad_last_for_triton(x: jax.Array) -> jax.Array:
  """Zero-pads the last axis of ``x`` to ``triton_width`` (GPU kernels).

  The Pallas Triton lowering needs power-of-2 array sizes, and a 16-bit
  ``dot`` with a contraction narrower than 16 computes wrong values. Zero
  columns change no dot product (each added term is an exact 0, so the
  rounding of the real terms and its bound are those of the unpadded head
  dim) and give zero output columns, which the callers slice off.
  """
  n = x.shape[-1]
  pad = triton_width(n) - n
  if pad == 0:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def check_head_major(query, key, value=None):
  """Validates ``[b, h, q, d]`` query and ``[b, h_kv, s, d]`` key/value."""
  if query.ndim != 4 or key.ndim != 4:
    raise ValueError(
      f"query and key must be head-major [batch, heads, len, head_dim];"
      f" got {query.shape=} {key.shape=}"
    )
  b, h, _, d = query.shape
  kb, hkv, _, kd = key.shape
  if kb != b or kd != d:
    raise ValueError(f"{query.shape=} and {key.shape=} disagree")
  if h % hkv:
    raise ValueError(f"num_heads={h} must be a multiple of kv_heads={hkv}")
  if value is not None and value.shape[:3] != key.shape[:3]:
    raise ValueError(f"{value.shape=} must match {key.shape=} on [b, h, s]")


def kv_mask_array(mask, batch: int, n_keys: int) -> jax.Array:
  """``[batch, 1, n_keys]`` int32 key-validity (1 = real key)."""
  if mask is None:
    return jnp.ones((batch, 1, n_keys), jnp.int32)
  mask = jnp.asarray(mask)
  if mask.shape != (batch, n_keys):
    raise ValueError(f"{mask.shape=} must be (batch, n_keys)={batch, n_keys}")
  return mask.astype(jnp.int32)[:, None, :]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeySummary:
  """Per-block key summaries for the logit rounding bound (THEORY 3.4).

  Attributes:
    absmax: ``[b, h_kv, n_blocks, d]`` max |k_c| over each block's real keys
      (box form: for every key i of block b, sum_c |q_c k_ic| <= sum_c |q_c|
      absmax_bc).
    norm: ``[b, h_kv, n_blocks]`` max ||k_i|| over the block's real keys,
      rounded up (``core.norms_up``).
    flushed: ``[b, h_kv, n_blocks]`` bool, some real key of the block has
      subnormal components (``core.flushed``).
    count: ``[b, h_kv, n_blocks]`` int32 real keys.
  """

  absmax: jax.Array
  norm: jax.Array
  flushed: jax.Array
  count: jax.Array


def key_summary(key, *, block_size: int, mask=None) -> KeySummary:
  """``KeySummary`` of ``[b, h_kv, n, d]`` keys in blocks of ``block_size``.

  Args:
    key: ``[b, h_kv, n, d]``.
    block_size: keys per block.
    mask: optional ``[b, n]`` bool, True for a real key.
  """
  b, hkv, n, d = key.shape
  k = pad_to(key, 2, block_size)
  nb = k.shape[2] // block_size
  real = jnp.ones((b, n), bool) if mask is None else jnp.asarray(mask, bool)
  real = pad_to(real, 1, block_size, False).reshape(b, 1, nb, block_size)
  kb = k.reshape(b, hkv, nb, block_size, d)
  dt = core.compute_dtype(key.dtype)
  absmax = jnp.max(
    jnp.where(real[..., None], jnp.abs(kb.astype(dt)), 0.0), axis=3
  )
  norms = core.norms_up(k).reshape(b, hkv, nb, block_size)
  norm = jnp.max(jnp.where(real, norms, 0.0), axis=3)
  fl = core.flushed(k).reshape(b, hkv, nb, block_size)
  flushed = jnp.any(real & fl, axis=3)
  count = jnp.broadcast_to(jnp.sum(real, axis=3, dtype=jnp.int32), norm.shape)
  return KeySummary(absmax=absmax, norm=norm, flushed=flushed, count=count)


def logit_error(query, summary: KeySummary, *, scale, where=None):
  """``[b, h, q]`` bound on |computed - exact| of every logit of each row.

  ``core.logit_error_bound`` with the box form per block (the smaller of
  Cauchy-Schwarz and sum_c |q_c| absmax_c), maximised over the blocks with
  real keys (and ``where``, e.g. visible to the query).

  Args:
    query: ``[b, h, q, d]``.
    summary: the keys' ``KeySummary`` (``h_kv`` heads, GQA repeated here).
    scale: the logit scale.
    where: optional ``[b, h, q, n_blocks]`` bool blocks that count.

  Returns:
    ``[b, h, q]`` delta (compute dtype).
  """
  h = query.shape[1]
  g = h // summary.absmax.shape[1]
  rep = lambda x: jnp.repeat(x, g, axis=1)  # noqa: E731
  q = jax.lax.stop_gradient(query)
  abs_dot = core.abs_dot_box(q, rep(summary.absmax))  # [b, h, q, nb]
  delta = core.logit_error_bound(
    q_norm=core.norms_up(q)[..., None],
    k_norm=rep(summary.norm)[:, :, None, :],
    head_dim=query.shape[-1],
    scale=scale,
    abs_dot=abs_dot,
    q_flushed=core.flushed(q)[..., None],
    k_flushed=rep(summary.flushed)[:, :, None, :],
    q_absmax=jnp.max(jnp.abs(q), -1)[..., None],
    k_absmax=jnp.max(rep(summary.absmax), -1)[:, :, None, :],
  )  # [b, h, q, nb]
  use = rep(summary.count)[:, :, None, :] > 0
  if where is not None:
    use = use & where
  return jnp.max(jnp.where(use, delta, 0.0), axis=-1)
