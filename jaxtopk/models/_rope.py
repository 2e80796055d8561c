"""Rotary position embeddings (RoPE) with Llama-3 frequency scaling.

Su et al. 2021 (RoFormer): the pair of dimensions ``(i, i + d/2)`` of every
query and key at position ``t`` is rotated by the angle ``t * inv_freq[i]``,
``inv_freq[i] = theta ** (-2i / d)``, so ``q_t . k_u`` depends on positions
only through ``t - u``. The layout is the one Llama and Qwen3 checkpoints are
trained with (Hugging Face's ``rotate_half``: the first half of the head
dimensions pairs with the second half, not interleaved).

Frequency scalings (``RopeScaling``), as ``transformers``' rope utilities
define them:

- ``'linear'``: every frequency divided by ``factor`` (position
  interpolation, Chen et al. 2023);
- ``'llama3'``: Llama 3.1's rule. With ``L = original_max_position_embeddings``,
  frequencies whose wavelength ``2 pi / f`` is above ``L / low_freq_factor``
  are divided by ``factor``, those below ``L / high_freq_factor`` are kept,
  and those in between are interpolated with the smoothing weight
  ``(L / wavelength - low_freq_factor) / (high_freq_factor -
  low_freq_factor)``.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A rotary frequency scaling (``rope_scaling`` of a checkpoint config).

  Attributes:
    rope_type: ``'linear'`` or ``'llama3'`` (see the module docstring).
    factor: frequency divisor, > 0.
    low_freq_factor: llama3 only: wavelengths above
      ``original_max_position_embeddings / low_freq_factor`` are scaled.
    high_freq_factor: llama3 only: wavelengths below
      ``original_max_position_embeddings / high_freq_factor`` are kept;
      must exceed ``low_freq_factor``.
    original_max_position_embeddings: llama3 only: the pre-training context.
  """

  rope_type: str
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.rope_type not in ("linear", "llama3"):
      raise ValueError(
        f"RopeScaling.rope_type={self.rope_type!r} must be 'linear' or 'llama3'"
      )
    if not (math.isfinite(self.factor) and self.factor > 0):
      raise ValueError(f"RopeScaling.factor={self.factor!r} must be > 0")
    if self.rope_type == "llama3":
      if not 0 < self.low_freq_factor < self.high_freq_factor:
        raise ValueError(
          f"RopeScaling: need 0 < low_freq_factor={self.low_freq_factor!r}"
          f" < high_freq_factor={self.high_freq_factor!r}"
        )
      if not self.original_max_position_embeddings >= 1:
        raise ValueError(
          "RopeScaling.original_max_position_embeddings="
          f"{self.original_max_position_embeddings!r} must be >= 1"
        )


def rope_frequencies(
  head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> np.ndarray:
  """The ``head_dim // 2`` inverse frequencies of a rotary embedding.

  Args:
    head_dim: even head dimension.
    theta: the base (``rope_theta``), > 0.
    scaling: an optional frequency scaling.

  Returns:
    float32 numpy ``[head_dim // 2]``, computed in float64 and rounded once.

  Raises:
    ValueError: an odd ``head_dim`` or a bad ``theta``.
  """
  if head_dim % 2:
    raise ValueError(f"rotary embeddings need an even {head_dim=}")
  if not (math.isfinite(theta) and theta > 0):
    raise ValueError(f"rope_theta={theta!r} must be a finite number > 0")
  exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
  inv_freq = 1.0 / theta**exponents  # [d/2]
  if scaling is None:
    return inv_freq.astype(np.float32)
  if scaling.rope_type == "linear":
    return (inv_freq / scaling.factor).astype(np.float32)
  old = scaling.original_max_position_embeddings
  low, high = scaling.low_freq_factor, scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > old / low, inv_freq / scaling.factor, inv_freq)
  smooth = (old / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = (wavelen >= old / high) & (wavelen <= old / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(
  x: jax.Array, positions: jax.Array, inv_freq: np.ndarray
) -> jax.Array:
  """Rotates ``x`` ``[batch, seq, heads, head_dim]`` to its positions.

  Angles are ``positions * inv_freq`` in float32 (as the reference
  implementation computes them); the rotation is applied in float32 and
  cast back to ``x.dtype``.

  Args:
    x: queries or keys ``[batch, seq, heads, head_dim]``.
    positions: int ``[batch, seq]`` absolute positions.
    inv_freq: ``[head_dim // 2]`` from :func:`rope_frequencies`.

  Returns:
    ``x`` rotated, same shape and dtype.
  """
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None]  # [b,s,1,d]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  xf = x.astype(jnp.float32)
  half = xf.shape[-1] // 2
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  return (xf * cos + rotated * sin).astype(x.dtype)
