"""Helpers shared by the Pallas kernels: backends, padding, masks, slack.

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

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

BACKENDS = ("tpu", "gpu")

# One finite mask value inside kernels (never -inf), as jax's Pallas ops do.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


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


def block_abs_max(key, *, block_size: int, mask=None) -> jax.Array:
  """``[b, h_kv, n_blocks, d]`` max |k_c| over each block's real keys.

  Used for the logit rounding slack: for every key i of block b,
  sum_c |q_c k_ic| <= sum_c |q_c| absmax_bc.
  """
  b, hkv, n, d = key.shape
  k = pad_to(key.astype(jnp.float32), 2, block_size)
  nb = k.shape[2] // block_size
  k = jnp.abs(k).reshape(b, hkv, nb, block_size, d)  # [b, hkv, nb, bs, d]
  if mask is not None:
    m = pad_to(jnp.asarray(mask, bool), 1, block_size)
    m = m.reshape(b, 1, nb, block_size, 1)
    k = jnp.where(m, k, 0.0)
  return jnp.max(k, axis=3)  # [b, hkv, nb, d]


def logit_slack(query, absmax, *, scale: float) -> jax.Array:
  """Bound on the float32 rounding error of every logit of a block.

  A float32 dot product of d terms is off by at most (d + 2) eps32
  sum_c |q_c k_c| (DESIGN "certificate"; THEORY 3.4).

  Args:
    query: ``[b, h, q, d]``.
    absmax: ``[b, h_kv, n_blocks, d]`` from ``block_abs_max``.
    scale: positive logit scale.

  Returns:
    ``[b, h, q, n_blocks]`` float32 slack, >= 0.
  """
  b, h, _, d = query.shape
  g = h // absmax.shape[1]
  a = jnp.repeat(absmax, g, axis=1)  # [b, h, nb, d]
  qa = jnp.abs(query.astype(jnp.float32))
  terms = jnp.einsum("bhqd,bhnd->bhqn", qa, a)  # [b, h, q, nb]
  eps = float(jnp.finfo(jnp.float32).eps)
  # (d + 3): the dot product's d + 2 plus the multiplication by scale; the
  # einsum above rounds too, so its result is rounded up by (d + 2) eps.
  return ((d + 3) * eps * scale) * terms * (1 + (d + 2) * eps)
