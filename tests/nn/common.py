"""Shared test inputs for tests/nn: one jax.random draw, sliced in numpy.

Eager tests compile every jax op once per new shape; drawing all random
inputs from one array (seeded by jax.random.key(0)) and slicing it in numpy
keeps that to a single compilation per process.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

# Every test dimension a different size, so a transposed axis cannot pass.
BATCH, Q_LEN, KV_LEN, FEATURES = 3, 5, 7, 11


@functools.cache
def _pool() -> np.ndarray:
  return np.asarray(jax.random.normal(jax.random.key(0), (1 << 14,)))


def normal(shape, dtype=jnp.float32, *, offset=0) -> jax.Array:
  """Standard normal array of ``shape``; ``offset`` picks another draw."""
  size = math.prod(shape)
  pool = _pool()
  start = (offset * 1009) % (pool.size - size)
  return jnp.asarray(pool[start : start + size].reshape(shape), dtype)
