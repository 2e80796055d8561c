"""n^C quantities (THEORY 7) and attention entropy (THEORY 8.4)."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import strategies as st

import jaxtopk
from jaxtopk import theory
from tests.theory import strategies
from tests.theory import truth


def _all(logits, keep, valid, eps):
  return (
    theory.effective_entries(logits, eps, valid),
    theory.ineffective_fraction(logits, eps, valid),
    theory.row_l2_error(logits, keep, valid),
    theory.attention_entropy(logits, valid),
  )


_ALL = jax.jit(_all)


class AgainstFloat64Test(parameterized.TestCase):
  @given(
    strategies.rows(max_abs=1e3),
    strategies.keeps(),
    st.sampled_from([0.01, 0.2]),
  )
  def test_matches_definitions(self, row, keep, eps):
    logits, valid = row
    n_eff, frac, l2, ent = _ALL(logits, keep, valid, eps)
    p = truth.probs(logits, valid)
    # THEORY 7.3: #{P_i >= eps}; rows within rounding of eps may differ.
    near = np.abs(p[valid] - eps) < 1e-5 * eps
    want = int(np.sum(p[valid] >= eps))
    self.assertLessEqual(abs(int(n_eff) - want), int(near.sum()))
    self.assertAlmostEqual(float(frac), 1 - int(n_eff) / valid.sum(), 6)
    # THEORY 7.2: ||P - P_hat||_2 (P_hat undefined when nothing is kept).
    hk = keep & valid
    if hk.any():
      p_hat = truth.probs(logits, hk)  # from logits: P_H may underflow
      want_l2 = np.linalg.norm(p - p_hat)
      self.assertAlmostEqual(float(l2), want_l2, delta=1e-5)
    elif p[valid & ~keep].sum() > 0:
      self.assertEqual(float(l2), np.inf)
    # THEORY 8.4: H(P) = -sum P log P, with 0 log 0 = 0.
    pv = p[valid][p[valid] > 0]
    self.assertAlmostEqual(float(ent), -np.sum(pv * np.log(pv)), delta=1e-4)

  def test_entropy_extremes(self):
    s = jnp.array([[0.0] * 7, [0.0, -jnp.inf, -jnp.inf, 0, 0, 0, 0]])
    np.testing.assert_allclose(
      theory.attention_entropy(s), [np.log(7), np.log(5)], rtol=1e-6
    )
    one_hot = jnp.array([1e4, 0.0, 0.0])
    self.assertEqual(float(theory.attention_entropy(one_hot)), 0.0)
    self.assertTrue(np.isnan(theory.attention_entropy(jnp.array([jnp.nan]))))


class NcTest(parameterized.TestCase):
  def test_powerlaw_window_matches_policy(self):
    for n in (1, 3, 5, 7, 11, 13, 4096, 131072):
      for alpha, c in ((1.0, 0.5), (2.0, 0.7), (0.3, 0.9)):
        self.assertEqual(
          int(theory.powerlaw_window(n, alpha, c)),
          jaxtopk.PowerLaw(alpha, c).num_kept(n),
          msg=(n, alpha, c),
        )

  def test_weight_scale_r(self):
    rng = np.random.default_rng(0)
    wq, wk = rng.normal(size=(2, 3, 11, 5))
    got = theory.weight_scale_R(wq, wk, 2.0)
    want = [4 * np.linalg.norm(wq[h] @ wk[h].T) for h in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    with self.assertRaisesRegex(ValueError, "w_k.shape"):
      theory.weight_scale_R(wq, wk[:, :7], 1.0)
    with self.assertRaisesRegex(ValueError, "input_bound=-1"):
      theory.weight_scale_R(wq, wk, -1.0)

  def test_sigma_link(self):
    # THEORY 7.5: sigma = sqrt(2 a ln n), k = n^C: tau -> 0 iff C > 1 - a.
    a = 0.5
    taus = {}
    for c in (0.3, 0.8):
      taus[c] = [
        float(
          theory.gaussian_tail_mass(n ** (c - 1.0), theory.powerlaw_sigma(n, a))
        )
        for n in (1e4, 1e8, 1e16)
      ]
    self.assertTrue(np.all(np.diff(taus[0.8]) < 0))  # C > 1 - a: falls
    self.assertLess(taus[0.8][-1], 0.05)
    self.assertTrue(np.all(np.diff(taus[0.3]) > 0))  # C < 1 - a: rises
    self.assertGreater(taus[0.3][-1], 0.7)  # slowly: 0.76 at n = 1e16

  def test_effective_entries_collapse(self):
    # A one-hot-like row has a single effective entry; a flat row has all.
    s = jnp.array([[20.0, 0, 0, 0, 0], [0.0] * 5])
    np.testing.assert_array_equal(theory.effective_entries(s, 0.1), [1, 5])

  @parameterized.named_parameters(
    ("eff", lambda: theory.effective_entries(jnp.zeros(3), 1.0), "eps=1.0"),
    ("frac", lambda: theory.ineffective_fraction(jnp.zeros(3), 0.0), "eps=0.0"),
    (
      "l2",
      lambda: theory.row_l2_error(jnp.zeros(3), jnp.ones(2, bool)),
      "keep",
    ),
    ("c", lambda: theory.powerlaw_window(10, 1.0, 1.0), "c=1.0"),
    ("alpha", lambda: theory.powerlaw_window(10, 0.0, 0.5), "alpha=0.0"),
  )
  def test_bad_input(self, call, fragment):
    with self.assertRaisesRegex(ValueError, fragment):
      call()


if __name__ == "__main__":
  absltest.main()
