"""Gaussian score model (THEORY 5): closed forms against Monte Carlo."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from scipy.special import logsumexp

from jaxtopk import theory

_SIGMAS = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
_EPS = np.array([0.01, 0.05, 0.10])
# THEORY 5.3 as printed (k_eps / n).
_TABLE = np.array(
  [
    [0.908, 0.741, 0.611],
    [0.628, 0.361, 0.236],
    [0.250, 0.088, 0.043],
    [0.047, 0.0093, 0.0033],
    [0.0038, 0.0004, 0.0001],
  ]
)


def _np_k_eps_fraction(rng, n, sigma, eps, rows):
  """Independent numpy float64 simulation of E[k_eps / n]."""
  out = []
  for _ in range(rows):
    s = np.sort(rng.normal(size=n) * sigma)[::-1]
    w = np.exp(s - s[0])
    tails = np.cumsum(w[::-1])[::-1] / w.sum()
    out.append(np.sum(tails > eps) / n)
  return np.mean(out), np.std(out, ddof=1) / np.sqrt(rows)


class RuleTest(parameterized.TestCase):
  def test_rule_reproduces_printed_table(self):
    got = np.asarray(theory.gaussian_k_eps_rule(_SIGMAS[:, None], _EPS))
    # The table prints 2-3 significant digits.
    np.testing.assert_allclose(got, _TABLE, rtol=0.02, atol=6e-5)

  def test_tail_mass_inverts_rule(self):
    rho = theory.gaussian_k_eps_rule(_SIGMAS[:, None], _EPS)
    tau = theory.gaussian_tail_mass(rho, _SIGMAS[:, None])
    np.testing.assert_allclose(tau, np.broadcast_to(_EPS, tau.shape), rtol=1e-4)

  def test_tail_mass_matches_a_large_row(self):
    # THEORY 5.2 against one numpy row of 200,000 N(0, 2^2) logits.
    s = np.sort(np.random.default_rng(0).normal(size=200_000) * 2.0)[::-1]
    for rho in (0.02, 0.1, 0.5):
      k = int(rho * s.size)
      tau = np.exp(logsumexp(s[k:]) - logsumexp(s))
      self.assertAlmostEqual(
        float(theory.gaussian_tail_mass(rho, 2.0)), tau, delta=0.01
      )

  @pytest.mark.slow
  def test_table_against_monte_carlo_at_n_200000(self):
    # THEORY 5.3 claims an n = 200,000 simulation agrees within 0.01.
    est = theory.gaussian_k_eps_finite_n(
      jax.random.key(0),
      200_000,
      _SIGMAS[:, None],
      _EPS,
      num_samples=8,
      confidence=0.99,
    )
    rule = np.asarray(theory.gaussian_k_eps_rule(_SIGMAS[:, None], _EPS))
    # Well inside the validity range (sigma <= 2, sqrt(2 ln n) = 4.9) the
    # mean itself is within 0.01 (measured: within 0.001):
    np.testing.assert_array_less(np.abs(est.mean - rule)[:2], 0.01)
    # Everywhere, the claim is not rejected at 99%: the interval meets
    # rule +- 0.01 (8 rows only; at sigma = 4, eps = 0.01 the mean over 40
    # numpy rows is 0.054 vs the rule's 0.047).
    self.assertTrue(np.all(est.ci_low <= rule + 0.01))
    self.assertTrue(np.all(est.ci_high >= rule - 0.01))


class FiniteNTest(parameterized.TestCase):
  def test_ci_covers_independent_simulation(self):
    n, sigma, eps = 4096, 3.0, 0.05
    est = theory.gaussian_k_eps_finite_n(
      jax.random.key(0), n, sigma, eps, num_samples=64
    )
    self.assertLess(est.ci_low, est.mean)
    self.assertLess(est.mean, est.ci_high)
    mean, se = _np_k_eps_fraction(np.random.default_rng(1), n, sigma, eps, 64)
    # Two independent estimates of one expectation: a 3-sigma z test.
    self.assertLess(
      abs(float(est.mean) - mean), 3 * np.hypot(float(est.std_error), se)
    )

  def test_rule_understates_k_beyond_validity(self):
    # THEORY 5.4: sigma = 4 > sqrt(2 ln 512) = 3.5. Measured: the finite-n
    # k_eps / n is ~0.12, far ABOVE the rule's 0.047 (the rule keeps too few).
    est = theory.gaussian_k_eps_finite_n(
      jax.random.key(0), 512, 4.0, 0.01, num_samples=64
    )
    self.assertGreater(
      float(est.ci_low), 2 * theory.gaussian_k_eps_rule(4.0, 0.01)
    )
    self.assertAlmostEqual(float(theory.gaussian_sigma_limit(512)), 3.53, 2)

  def test_large_n_is_memory_safe(self):
    est = theory.gaussian_k_eps_finite_n(
      jax.random.key(0), 131_072, 1.0, 0.1, num_samples=2
    )
    self.assertAlmostEqual(float(est.mean), 0.611, delta=0.01)

  @parameterized.named_parameters(
    ("n", dict(n=0), "n=0"),
    ("samples", dict(num_samples=1), "num_samples=1"),
    ("sigma", dict(sigma=-1.0), "sigma=-1.0"),
    ("eps", dict(eps=1.0), "eps=1.0"),
    ("confidence", dict(confidence=1.0), "confidence=1.0"),
  )
  def test_bad_input(self, bad, fragment):
    args = dict(n=7, sigma=1.0, eps=0.1, num_samples=3) | bad
    with self.assertRaisesRegex(ValueError, fragment):
      theory.gaussian_k_eps_finite_n(jax.random.key(0), **args)

  def test_rule_bad_eps(self):
    with self.assertRaisesRegex(ValueError, "eps="):
      theory.gaussian_k_eps_rule(1.0, jnp.array([0.1, 0.0]))


if __name__ == "__main__":
  absltest.main()
