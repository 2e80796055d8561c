"""Hypothesis strategies for adversarial attention rows.

Every row is padded to a fixed width ``N`` with masked keys whose logits are
huge (so a masking bug shows), so jitted functions compile once per dtype.
"""

import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

N = 16
MAX_REAL = 13
DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
_PAD_LOGIT = 9.0e3


@st.composite
def rows(draw, min_real=1, max_real=MAX_REAL, max_abs=1e4):
  """(logits [N] float32, valid [N] bool): random and adversarial rows.

  Kinds: arbitrary floats up to ``max_abs`` (hypothesis favours edge values:
  0, +-max_abs, tiny numbers), ties from a few values, a huge range (1e4
  apart), smooth normal rows of several scales, and one repeated value.
  """
  n = draw(st.integers(min_real, max_real))
  kind = draw(st.sampled_from(["floats", "ties", "huge", "normal", "same"]))
  if kind == "floats":
    vals = draw(
      st.lists(st.floats(-max_abs, max_abs, width=32), min_size=n, max_size=n)
    )
  elif kind == "ties":
    vals = draw(
      st.lists(st.sampled_from([0.0, 1.0, 2.0, -3.0]), min_size=n, max_size=n)
    )
  elif kind == "huge":
    vals = draw(
      st.lists(
        st.sampled_from([-max_abs, 0.0, max_abs / 2, max_abs]),
        min_size=n,
        max_size=n,
      )
    )
  elif kind == "same":
    vals = [draw(st.sampled_from([0.0, -7.5, 1e3]))] * n
  else:
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.1, 1.0, 3.0, 30.0]))
    vals = np.random.default_rng(seed).normal(size=n) * scale
  seed = draw(st.integers(0, 2**31 - 1))
  pos = np.sort(np.random.default_rng(seed).permutation(N)[:n])
  logits = np.full(N, _PAD_LOGIT, np.float32)
  logits[pos] = np.asarray(vals, np.float32)
  valid = np.zeros(N, bool)
  valid[pos] = True
  return logits, valid


def keeps(width=N):
  """Arbitrary kept sets of the padded width."""
  return st.lists(st.booleans(), min_size=width, max_size=width).map(
    lambda b: np.asarray(b, bool)
  )


def cast(x, dtype):
  """jnp array in ``dtype`` and its float64 numpy value."""
  a = jnp.asarray(x, dtype)
  return a, np.asarray(a.astype(jnp.float32), np.float64)


def normal(shape, seed=0, scale=1.0, dtype=np.float32):
  """Seeded normal test data (numpy: no XLA compile per shape)."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.normal(size=shape) * scale, dtype)


def bernoulli(shape, p=0.5, seed=0):
  """Seeded boolean test data."""
  return jnp.asarray(np.random.default_rng(seed).random(shape) < p)
