"""Output-level identity and bounds (THEORY 4.1-4.4)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import strategies as st

from jaxtopk import theory
from tests import tolerances
from tests.theory import strategies
from tests.theory import truth

N, DV = strategies.N, 3


@st.composite
def value_rows(draw):
  """[N, DV] float32 values: normal, all equal, opposite pairs, huge."""
  seed = draw(st.integers(0, 2**31 - 1))
  kind = draw(st.sampled_from(["normal", "equal", "opposite", "huge"]))
  rng = np.random.default_rng(seed)
  v = rng.normal(size=(N, DV))
  if kind == "equal":
    v = np.broadcast_to(v[:1], (N, DV))
  elif kind == "opposite":  # two antipodal values: the diameter is tight
    v = np.where(rng.random((N, 1)) < 0.5, 1.0, -1.0) * v[:1]
  elif kind == "huge":
    v = v * 1e3
  return np.asarray(v, np.float32)


def _value_norm_inputs(tau, s64, keep, v64, valid):
  """Upper bounds (float32, rounded up) on ``tau``, ||mu_head|| and the tail's
  largest value norm, from the extended-precision truth: the arguments
  ``value_norm_bound`` requires. (float32 means of a row whose head sits
  hundreds of logits below its max carry ~1e-5 relative error, which the
  library's own bounds account for through ``LogMass.err``.)"""
  up = lambda x: np.nextafter(np.float32(x), np.float32(np.inf))  # noqa: E731
  head = valid & keep
  mu = truth.probs(s64, head) @ v64 if head.any() else np.zeros(v64.shape[1])
  tail = valid & ~keep
  norms = np.linalg.norm(v64[tail], axis=-1)
  max_tail = float(norms.max()) if norms.size else 0.0
  return min(up(tau), np.float32(1.0)), up(np.linalg.norm(mu)), up(max_tail)


def _all_bounds(logits, keep, values, valid, tv, value_norm_inputs):
  return {
    "diameter": theory.diameter_bound(logits, keep, values, valid),
    "variance": theory.variance_bound(logits, keep, values, valid),
    "value_norm": theory.value_norm_bound(*value_norm_inputs),
    "diameter_t": theory.diameter_bound(
      logits, keep, values, valid, tv_bound=tv
    ),
    "variance_t": theory.variance_bound(
      logits, keep, values, valid, tv_bound=tv
    ),
    "error_t": theory.head_tail_error(logits, keep, values, valid, tv_bound=tv),
  }


_BOUNDS = jax.jit(_all_bounds)


class IdentityTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("f32", (5, 11), False),
    ("f32_3d", (3, 5, 7), False),
    ("f64", (7, 13), True),
  )
  def test_decomposition_matches_direct(self, shape, x64):
    with jax.enable_x64(x64):
      dtype = jnp.float64 if x64 else jnp.float32
      s = strategies.normal(shape, seed=1, scale=2.0, dtype=dtype)
      v = strategies.normal((*shape, 3), seed=2, dtype=dtype)
      keep = strategies.bernoulli(shape, 0.5, 3)
      keep = keep.at[..., 0].set(True).at[..., 1].set(False)
      ht = theory.head_tail_means(s, keep, v)
      err = theory.head_tail_error(s, keep, v)
      self.assertEqual(err.dtype, dtype)
      tol = tolerances.tol(dtype)
      s64, v64, k64 = (np.asarray(a, np.float64) for a in (s, v, keep))
      for idx in np.ndindex(shape[:-1]):
        p = truth.probs(s64[idx], np.ones(shape[-1], bool))
        attn = p @ v64[idx]
        attn_k = truth.truncated(p, k64[idx].astype(bool)) @ v64[idx]
        tau = p[~k64[idx].astype(bool)].sum()
        np.testing.assert_allclose(ht.mu_head[idx], attn_k, **tol)
        np.testing.assert_allclose(ht.tau[idx], tau, **tol)
        # THEORY 4.1: Attn = (1 - tau) mu_head + tau mu_tail, and so
        # Attn - Attn_k = tau (mu_tail - mu_head).
        np.testing.assert_allclose(
          (1 - tau) * np.asarray(ht.mu_head[idx])
          + tau * np.asarray(ht.mu_tail[idx]),
          attn,
          **tol,
        )
        np.testing.assert_allclose(
          tau * (np.asarray(ht.mu_tail[idx]) - np.asarray(ht.mu_head[idx])),
          attn - attn_k,
          **tol,
        )
        np.testing.assert_allclose(
          err[idx], np.linalg.norm(attn - attn_k), **tol
        )

  def test_conventions_empty_head_and_tail(self):
    s = jnp.array([0.0, 1.0, 2.0])
    v = jnp.array([[1.0], [2.0], [3.0]])
    all_kept = jnp.ones(3, bool)
    self.assertEqual(float(theory.head_tail_error(s, all_kept, v)), 0.0)
    self.assertEqual(float(theory.diameter_bound(s, all_kept, v)), 0.0)
    self.assertEqual(float(theory.variance_bound(s, all_kept, v)), 0.0)
    none = jnp.zeros(3, bool)
    attn = float(truth.probs(np.asarray(s), np.ones(3, bool)) @ [1, 2, 3])
    self.assertAlmostEqual(
      float(theory.head_tail_error(s, none, v)), attn, places=5
    )
    self.assertGreaterEqual(float(theory.diameter_bound(s, none, v)), attn)
    self.assertEqual(float(theory.variance_bound(s, none, v)), np.inf)


class SoundnessTest(parameterized.TestCase):
  @pytest.mark.slow
  @given(
    strategies.rows(max_abs=1e3),
    strategies.keeps(),
    value_rows(),
    st.floats(0.0, 0.5),
    st.sampled_from([0, 1, 2]),
  )
  def test_bounds_above_true_error(self, row, keep, values, extra, dt):
    logits, valid = row
    values = np.where(valid[:, None], values, 1e3).astype(np.float32)
    dtype = strategies.DTYPES[dt]  # float32, float16 or bfloat16 inputs
    logits, s64 = strategies.cast(logits, dtype)
    values, v64 = strategies.cast(values, dtype)
    want = truth.output_error(s64, keep, v64, valid)
    log_tau = truth.log_tau(s64, keep, valid)
    tau = float(np.exp(log_tau))
    tv = np.float32(min(1.0, tau * (1 + 1e-5) + extra))  # any t >= tau
    inputs = _value_norm_inputs(tau, s64, keep, v64, valid)
    got = _BOUNDS(logits, keep, values, valid, tv, inputs)
    # The extended-precision reference is itself off by ~1e-19 |v| (e.g.
    # when all values are equal and the true error is 0).
    ref_err = 1e-15 * np.abs(v64[valid]).max()
    for name, b in got.items():
      self.assertGreaterEqual(float(b), want - ref_err, msg=name)

  def test_tight_two_keys(self):
    # One head key, one tail key: diameter and variance bounds are equalities
    # in exact arithmetic; rounded up they must still be >= the truth.
    s = jnp.array([0.3, -0.2])
    keep = jnp.array([True, False])
    v = jnp.array([[1.0, -2.0, 0.5], [-1.0, 2.0, -0.5]])
    want = truth.output_error(
      np.asarray(s), np.asarray(keep), np.asarray(v), np.ones(2, bool)
    )
    for f in (theory.diameter_bound, theory.variance_bound):
      got = float(f(s, keep, v))
      self.assertGreaterEqual(got, want)
      self.assertLess(got, want * (1 + 1e-5))

  def test_bounds_increase_with_tv_bound(self):
    s = strategies.normal((3, 7), seed=7)
    v = strategies.normal((3, 7, 5), seed=8)
    keep = theory.topk_mask(s, 2)
    f = functools.partial(theory.variance_bound, s, keep, v)
    lo, hi = f(tv_bound=0.2), f(tv_bound=0.4)
    self.assertTrue(np.all(lo < hi))


class ApiTest(parameterized.TestCase):
  def test_bad_values_shape(self):
    with self.assertRaisesRegex(ValueError, "values"):
      theory.head_tail_error(jnp.zeros(5), jnp.ones(5, bool), jnp.zeros((4, 2)))

  def test_bad_tv_bound(self):
    with self.assertRaisesRegex(ValueError, "tv_bound=1.5"):
      theory.diameter_bound(
        jnp.zeros(5), jnp.ones(5, bool), jnp.zeros((5, 2)), tv_bound=1.5
      )

  def test_nan_logit_gives_nan(self):
    s = jnp.array([0.0, jnp.nan])
    k = jnp.array([True, False])
    v = jnp.ones((2, 3))
    for f in (
      theory.head_tail_error,
      theory.diameter_bound,
      theory.variance_bound,
    ):
      self.assertTrue(np.isnan(f(s, k, v)))


if __name__ == "__main__":
  absltest.main()
