"""Key codes (THEORY 3.5): encoding error and logit bounds vs exact truth.

Truth is exact rational arithmetic (``fractions.Fraction`` of the float
inputs as stored, subnormals included). Adversarial families of
``core_test.vectors``: magnitudes 1e-45..3e38, subnormal bit patterns,
huge and tiny components mixed, ties, zeros; plus keys below 1e-19 with
tiny queries, near-max keys and non-finite keys; float32, bfloat16, float16
storage; both forms of the code products (the CPU loop and the einsum used
on accelerators).
"""

import fractions
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import strategies as st

from jaxtopk.selection import key_codes as kc
from tests.selection.core_test import vectors

N, G, D = 6, 2, 5  # keys, queries sharing them, head dim
DTYPES = (np.float32, ml_dtypes.bfloat16, np.float16)
SCALES = (1.0, 0.37, 1e-20, 1e20, 2.0**-126)


def _frac(x):
  return fractions.Fraction(float(x))


@functools.partial(jax.jit, static_argnames=("loop",))
def _bounds(q, codes_t, e, scale, loop):
  return kc.code_bounds(q, codes_t, e, scale=scale, loop=loop)


class EncodeTest(parameterized.TestCase):
  @given(data=st.data())
  def test_error_within_half_step(self, data):
    dt = data.draw(st.sampled_from(DTYPES))
    k = data.draw(vectors((N, D), dt))
    codes, e = jax.jit(kc.encode_keys)(k)
    codes, e = np.asarray(codes, np.int64), np.asarray(e, np.int64)
    self.assertTrue(np.all(np.abs(codes) <= kc.QMAX))
    for i in range(N):
      half = fractions.Fraction(2) ** int(e[i] - 1)
      for c in range(D):
        err = abs(_frac(k[i, c]) - codes[i, c] * 2 * half)
        self.assertLessEqual(err, half, (k[i], codes[i], e[i]))

  def test_non_finite_key_is_marked(self):
    k = np.array([[1.0, np.inf], [np.nan, 0.0], [2.0, 3.0]], np.float32)
    codes, e = kc.encode_keys(k)
    bad = kc.nonfinite_exponent(np.float32)
    np.testing.assert_array_equal(np.asarray(e)[:2], [bad, bad])
    self.assertNotEqual(int(e[2]), bad)
    q = jnp.ones((1, 2), jnp.float32)
    u, lo = kc.code_bounds(q, jnp.swapaxes(codes, 0, 1), e, scale=1.0)
    np.testing.assert_array_equal(np.asarray(u)[0, :2], [np.inf, np.inf])
    np.testing.assert_array_equal(np.asarray(lo)[0, :2], [-np.inf, -np.inf])

  def test_code_cost_is_byte_share(self):
    # float32, d = 32: (32 + 1) / 128 of a key; bfloat16: (32 + 1) / 64.
    self.assertAlmostEqual(kc.code_share(32, jnp.float32), 33 / 128)
    self.assertAlmostEqual(kc.code_share(32, jnp.bfloat16), 33 / 64)
    self.assertEqual(int(kc.code_cost(128, 32, jnp.float32)), 33)
    self.assertEqual(int(kc.code_cost(129, 32, jnp.float32)), 34)
    big = 2**30 + 3  # n (d + 1) overflows int32
    want = -(-big * 33 // 128)
    self.assertEqual(int(kc.code_cost(big, 32, jnp.float32)), want)


class BoundTest(parameterized.TestCase):
  def _check(self, q, k, scale, loop):
    codes, e = kc.encode_keys(k)
    u, lo = _bounds(q, jnp.swapaxes(codes, -1, -2), e, scale, loop)
    u, lo = np.asarray(u, np.float64), np.asarray(lo, np.float64)
    self.assertFalse(np.any(np.isnan(u)) or np.any(np.isnan(lo)))
    self.assertFalse(np.any(u == -np.inf), u)
    sc = _frac(scale)
    for j in range(q.shape[0]):
      for i in range(k.shape[0]):
        s = sc * sum(_frac(q[j, c]) * _frac(k[i, c]) for c in range(D))
        if u[j, i] < np.inf:
          self.assertGreaterEqual(_frac(u[j, i]), s, (q[j], k[i], scale))
        if lo[j, i] > -np.inf:
          self.assertLessEqual(_frac(lo[j, i]), s, (q[j], k[i], scale))

  @given(data=st.data())
  def test_sound(self, data):
    dt = data.draw(st.sampled_from(DTYPES))
    q = data.draw(vectors((G, D), np.float32))
    k = data.draw(vectors((N, D), dt))
    scale = data.draw(st.sampled_from(SCALES))
    self._check(q, k, scale, data.draw(st.booleans()))

  @parameterized.product(loop=(True, False), scale=SCALES)
  def test_sound_on_extremes(self, loop, scale):
    rng = np.random.default_rng(0)
    z = rng.normal(size=(N, D))
    fams = {
      "tiny_keys": (rng.normal(size=(G, D)), z * 1e-19),
      "tiny_query": (rng.normal(size=(G, D)) * 1e-30, z),
      "subnormal_keys": (rng.normal(size=(G, D)), z * 1e-42),
      "near_max": (rng.normal(size=(G, D)) * 1e-30, z * 1e38),
      "huge_both": (rng.normal(size=(G, D)) * 1e30, z * 1e30),
      "flushed_query": (np.array([[1e-39, 1, 0, 0, 0], [0, 0, 0, 0, 1]]), z),
      # A subnormal q_c (read as 0 on CPU) against keys near the largest
      # float: the term it loses is O(1).
      "flushed_query_huge_keys": (
        np.array([[1.1e-38, 0, 0, 0, 0], [-1e-38, 0, 0, 0, 0]]),
        np.concatenate([np.full((N, 1), 3e38), np.abs(z[:, 1:]) * 1e38], 1),
      ),
      "ties": (np.ones((G, D)), np.ones((N, D)) * 0.1),
    }
    for name, (q, k) in fams.items():
      with self.subTest(name):
        with np.errstate(over="ignore"):
          q32, k32 = q.astype(np.float32), k.astype(np.float32)
        k32 = np.where(np.isfinite(k32), k32, 3e38).astype(np.float32)
        self._check(q32, k32, scale, loop)

  @parameterized.parameters(True, False)
  def test_sound_at_half_step_ties_with_cancellation(self, loop):
    # Every component exactly half a step from its code, the error aligned
    # with q (round half to even), and q.c cancelling: the true logit sits
    # at the edge of the half-step interval and only the dot product's
    # rounding term keeps the bound above it.
    k = np.array([[126.5, -125.5, 124.5, -123.5, 0.5]], np.float32)
    k = np.repeat(k, N, 0) * np.float32(2.0 ** np.arange(N))[:, None]
    rng = np.random.default_rng(2)
    for _ in range(20):
      q = (1 + rng.uniform(-1e-3, 1e-3, size=(G, D))).astype(np.float32)
      self._check(q, k, 1.0, loop)

  def test_tight_on_gaussian_keys(self):
    # The point of the codes: a fraction of a logit on ordinary keys.
    rng = np.random.default_rng(1)
    q = rng.normal(size=(4, 32)).astype(np.float32)
    k = rng.normal(size=(256, 32)).astype(np.float32)
    codes, e = kc.encode_keys(k)
    u, lo = kc.code_bounds(q, codes.T, e, scale=32**-0.5)
    s = (q @ k.T) * 32**-0.5
    self.assertTrue(np.all(np.asarray(u) >= s) and np.all(np.asarray(lo) <= s))
    self.assertLess(float(np.median(np.asarray(u) - s)), 0.1)


if __name__ == "__main__":
  absltest.main()
