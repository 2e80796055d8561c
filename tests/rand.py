"""Random test inputs drawn in numpy, returned as jax arrays.

``jax.random.normal(key, shape)`` compiles a threefry program for every new
shape (about a second each on a loaded 2-core CI machine), and the tests draw
inputs of hundreds of shapes. These helpers draw the same kinds of arrays
with numpy's ``default_rng`` and place them with ``jax.device_put`` (no
compilation; ``jnp.asarray`` compiles a small program per shape).

The seed is the key: any ``jax.random.key``/``PRNGKey`` (``split`` and
``fold_in`` results included) or a non-negative int. The same key gives the
same draw, different keys different draws; an int ``s`` seeds as
``jax.random.key(s)`` does. The draws differ from jax.random's, and unlike
jax.random's, two draws of different shapes from one key share their leading
values: give each draw its own key (or draw both from one ``generator``).

For an input built from several draws, ``generator(key)`` gives the numpy
generator itself: compose in numpy, then ``jax.device_put`` once.
"""

import jax
import numpy as np

_WORD = (1 << 32) - 1


def _entropy(key) -> list[int]:
  """The 32-bit words that seed numpy for ``key`` (a jax key or an int)."""
  if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
    if key < 0:
      raise ValueError(f"key: an int seed must be >= 0, got {key}")
    return [(int(key) >> 32) & _WORD, int(key) & _WORD]
  if isinstance(key, jax.core.Tracer):
    raise TypeError("key: drawn on the host, so not under jit/vmap/grad")
  data = key
  if jax.dtypes.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key):
    data = jax.random.key_data(key)  # no compilation: a view of the words
  data = np.asarray(data)
  if data.dtype != np.uint32 or data.ndim != 1:
    raise ValueError(
      "key: want one jax.random key, a uint32[2] PRNGKey or an int, got "
      f"{getattr(key, 'dtype', type(key))}{list(np.shape(key))}"
    )
  return data.tolist()


def generator(key) -> np.random.Generator:
  """numpy's generator seeded by ``key`` (a jax key or a non-negative int)."""
  return np.random.default_rng(_entropy(key))


def _put(x: np.ndarray, dtype) -> jax.Array:
  return jax.device_put(np.asarray(x).astype(np.dtype(dtype)))


def normal(key, shape=(), dtype=np.float32) -> jax.Array:
  """Standard normal ``shape`` array of ``dtype`` (``jax.random.normal``)."""
  return _put(generator(key).standard_normal(shape), dtype)


def uniform(
  key, shape=(), dtype=np.float32, minval=0.0, maxval=1.0
) -> jax.Array:
  """Uniform on [minval, maxval) in ``dtype`` (``jax.random.uniform``)."""
  x = generator(key).uniform(minval, maxval, shape).astype(np.dtype(dtype))
  top = np.nextafter(np.asarray(maxval, x.dtype), np.asarray(minval, x.dtype))
  return jax.device_put(np.minimum(x, top))  # rounding may reach maxval


def randint(key, shape, minval, maxval, dtype=np.int32) -> jax.Array:
  """Integers in [minval, maxval) (``jax.random.randint``)."""
  return _put(generator(key).integers(minval, maxval, shape), dtype)


def bernoulli(key, p=0.5, shape=None) -> jax.Array:
  """Booleans, True with probability ``p`` (``jax.random.bernoulli``)."""
  shape = np.shape(p) if shape is None else shape
  return _put(generator(key).random(shape) < np.asarray(p), bool)
