"""THEORY 2 identities for tail_mass / log_tail_mass / kl_truncated."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import strategies as st
from jax import test_util

from jaxtopk import theory
from tests import tolerances
from tests.theory import strategies
from tests.theory import truth

_log_tau = jax.jit(theory.log_tail_mass)
_kl = jax.jit(theory.kl_truncated)


def _random(shape, key=0, scale=2.0, dtype=jnp.float32):
  return strategies.normal(shape, key, scale, dtype)


class IdentitiesTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("f32_row", (7,), False),
    ("f32_batch", (3, 5, 11), False),
    ("f64_row", (13,), True),
    ("f64_batch", (5, 7), True),
  )
  def test_tv_equals_tau_and_kl_and_odds(self, shape, x64):
    with jax.enable_x64(x64):
      dtype = jnp.float64 if x64 else jnp.float32
      s = _random(shape, dtype=dtype)
      keep = strategies.bernoulli(shape, 0.5, 1)
      mask = strategies.bernoulli(shape, 0.8, 2)
      mask = mask.at[..., 0].set(True)
      tau = theory.tail_mass(s, keep, mask)
      kl = theory.kl_truncated(s, keep, mask)
      self.assertEqual(tau.dtype, dtype)
      s64, k64, m64 = (np.asarray(a, np.float64) for a in (s, keep, mask))
      m64, k64 = m64.astype(bool), k64.astype(bool)
      tv, odds = np.zeros(shape[:-1]), np.zeros(shape[:-1])
      for idx in np.ndindex(shape[:-1]):
        p = truth.probs(s64[idx], m64[idx])
        hk = k64[idx] & m64[idx]
        p_hat = truth.truncated(p, hk) if hk.any() else np.zeros_like(p)
        tv[idx] = 0.5 * np.abs(p - p_hat).sum()  # THEORY 2.1, directly
        z = np.exp(s64[idx]) * m64[idx]
        odds[idx] = z[~k64[idx]].sum() / z[k64[idx]].sum()  # THEORY 2.3
      tol = tolerances.tol(dtype)
      np.testing.assert_allclose(tau, tv, **tol)
      # THEORY 2.2: TV = 1 - exp(-KL(P_hat || P)).
      np.testing.assert_allclose(tau, -np.expm1(-np.asarray(kl)), **tol)
      # THEORY 2.3: tau / (1 - tau) = Z_T / Z_H, with 1 - tau = exp(-KL).
      np.testing.assert_allclose(
        np.exp(np.asarray(theory.log_tail_mass(s, keep, mask)) + kl),
        odds,
        **tol,
      )

  @given(strategies.rows(), strategies.keeps(), st.sampled_from([0, 1, 2]))
  def test_log_tau_matches_float64(self, row, keep, dt):
    dtype = strategies.DTYPES[dt]
    logits, valid = row
    s, s64 = strategies.cast(logits, dtype)
    got = float(_log_tau(s, keep, valid))
    want = truth.log_tau(s64, keep, valid)
    if want == -np.inf:
      self.assertEqual(got, -np.inf)
    else:
      # Accurate in log space even for logits of size 1e4 (no shift back).
      self.assertAlmostEqual(got, want, delta=1e-5 * (1 + abs(want)))

  def test_x64_is_float64_and_exact(self):
    with jax.enable_x64(True):
      s = jnp.array([1e4, 1e4 - 30.0, -1e4], jnp.float64)
      keep = jnp.array([True, False, False])
      got = theory.log_tail_mass(s, keep)
      self.assertEqual(got.dtype, jnp.float64)
      self.assertAlmostEqual(float(got), -30.0, delta=1e-12)


class TransformsTest(parameterized.TestCase):
  def test_jit_and_vmap_agree(self):
    s = _random((3, 5, 7))
    keep = strategies.bernoulli((3, 5, 7), 0.5, 1)
    eager = theory.tail_mass(s, keep)
    jitted = jax.jit(theory.tail_mass)(s, keep)
    vmapped = jax.vmap(theory.tail_mass)(s, keep)
    np.testing.assert_allclose(jitted, eager, **tolerances.tol(jnp.float32))
    np.testing.assert_allclose(vmapped, eager, **tolerances.tol(jnp.float32))
    self.assertEqual(eager.shape, (3, 5))

  @parameterized.named_parameters(
    ("plain", False, False), ("masked", True, False), ("ties", False, True)
  )
  def test_grad_finite_and_correct(self, masked, ties):
    s = _random((11,))
    if ties:
      s = jnp.round(s)
    keep = jnp.arange(11) < 5
    mask = jnp.arange(11) % 3 != 2 if masked else None
    if masked:
      s = jnp.where(mask, s, 1e4)  # huge padded logits must not leak
    g = jax.grad(lambda x: theory.tail_mass(x, keep, mask))(s)
    self.assertTrue(np.all(np.isfinite(g)))
    if masked:
      np.testing.assert_array_equal(np.asarray(g)[~np.asarray(mask)], 0.0)
    # d tau / d s_i = P_i (1{i in T} - tau).
    valid = np.ones(11, bool) if mask is None else np.asarray(mask)
    p = truth.probs(np.asarray(s, np.float64), valid)
    tau = p[~np.asarray(keep)].sum()
    want = p * ((~np.asarray(keep)).astype(float) - tau)
    np.testing.assert_allclose(g, want, atol=1e-6)

  def test_check_grads_x64(self):
    with jax.enable_x64(True):
      s = _random((7,), dtype=jnp.float64)
      keep = jnp.arange(7) < 3
      test_util.check_grads(
        lambda x: theory.log_tail_mass(x, keep), (s,), order=1
      )


class EdgeCasesTest(parameterized.TestCase):
  def test_documented_nonfinite_behaviour(self):
    keep = jnp.array([True, False, False])
    nan = theory.tail_mass(jnp.array([0.0, jnp.nan, 1.0]), keep)
    pinf = theory.tail_mass(jnp.array([0.0, jnp.inf, 1.0]), keep)
    ninf = theory.tail_mass(jnp.array([0.0, -jnp.inf, 0.0]), keep)
    no_key = theory.tail_mass(
      jnp.zeros(3), keep, jnp.array([False, False, False])
    )
    all_ninf = theory.tail_mass(jnp.full(3, -jnp.inf), keep)
    self.assertTrue(np.isnan(nan))
    self.assertTrue(np.isnan(pinf))
    self.assertAlmostEqual(float(ninf), 0.5, places=6)  # zero-mass key
    self.assertTrue(np.isnan(no_key))
    self.assertTrue(np.isnan(all_ninf))

  def test_single_key_and_all_kept(self):
    self.assertEqual(float(theory.tail_mass(jnp.ones(1), jnp.ones(1, bool))), 0)
    self.assertEqual(
      float(theory.kl_truncated(jnp.ones(1), jnp.zeros(1, bool))), np.inf
    )

  @parameterized.named_parameters(
    ("keep", dict(keep=jnp.ones(5, bool)), "keep"),
    ("mask", dict(mask=jnp.ones(5, bool)), "mask"),
  )
  def test_shape_mismatch_names_array(self, bad, name):
    args = dict(keep=jnp.ones(7, bool), mask=None) | bad
    with self.assertRaisesRegex(ValueError, name):
      theory.tail_mass(jnp.zeros(7), **args)

  def test_scalar_logits_rejected(self):
    with self.assertRaisesRegex(ValueError, "key axis"):
      theory.tail_mass(jnp.zeros(()), jnp.ones((), bool))


if __name__ == "__main__":
  absltest.main()
