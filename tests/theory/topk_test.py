"""topk_mask (ties by lowest index) and the exact k_eps (THEORY 6.1)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import strategies as st

from jaxtopk import theory
from tests.theory import strategies
from tests.theory import truth

_TOPKS = (1, 2, 5, 13)
_MASKS = {
  t: jax.jit(functools.partial(theory.topk_mask, topk=t)) for t in _TOPKS
}
_K_EPS = jax.jit(theory.k_eps)


class TopkMaskTest(parameterized.TestCase):
  @given(strategies.rows(), st.sampled_from(_TOPKS))
  def test_matches_stable_sort(self, row, topk):
    logits, valid = row
    got = np.asarray(_MASKS[topk](logits, mask=valid))
    want = truth.topk_keep(logits, topk, valid)
    np.testing.assert_array_equal(got, want)

  def test_ties_broken_by_lowest_index(self):
    s = jnp.array([[1.0, 2.0, 2.0, 2.0, 0.0], [5.0, 5.0, 5.0, 5.0, 5.0]])
    got = theory.topk_mask(s, 2)
    np.testing.assert_array_equal(
      got,
      [[False, True, True, False, False], [True, True, False] + [False] * 2],
    )

  def test_fewer_real_keys_than_topk_keeps_all_real(self):
    s = jnp.array([3.0, 1.0, 2.0])
    mask = jnp.array([True, False, True])
    got = theory.topk_mask(s, 3, mask)
    np.testing.assert_array_equal(got, [True, False, True])

  def test_nan_ranks_first(self):
    # Documented: NaN ranks above every number (lax.top_k order).
    got = theory.topk_mask(jnp.array([1.0, jnp.nan, 3.0]), 1)
    np.testing.assert_array_equal(got, [False, True, False])

  def test_batched_dtype(self):
    s = strategies.normal((3, 5, 7), seed=2).astype(jnp.bfloat16)
    got = theory.topk_mask(s, 3)
    self.assertEqual(got.shape, (3, 5, 7))
    np.testing.assert_array_equal(np.sum(got, -1), 3)

  @parameterized.parameters(0, 8)
  def test_bad_topk(self, topk):
    with self.assertRaisesRegex(ValueError, f"topk={topk}"):
      theory.topk_mask(jnp.zeros(7), topk)


class KEpsTest(parameterized.TestCase):
  @given(strategies.rows(), st.sampled_from([1e-3, 0.05, 0.5]))
  def test_minimal_and_sufficient(self, row, eps):
    logits, valid = row
    got = int(_K_EPS(logits, eps, valid))
    s64 = np.asarray(logits, np.float64)
    self.assertBetween(got, 1, int(valid.sum()))

    def log_tail(k):
      return truth.log_tau(s64, truth.topk_keep(s64, k, valid), valid)

    # Sufficient: tau_k <= eps; minimal: tau_{k-1} > eps (float32 rounding
    # of the row sums may decide rows within 1e-5 relative of eps).
    self.assertLessEqual(log_tail(got), np.log(eps) + 1e-5)
    if got > 1:
      self.assertGreater(log_tail(got - 1), np.log(eps) - 1e-5)

  def test_exact_in_x64(self):
    with jax.enable_x64(True):
      s = strategies.normal((5, 11), seed=4, scale=3.0, dtype=np.float64)
      got = theory.k_eps(s, 0.1)
      want = [truth.k_eps(r, 0.1, np.ones(11, bool)) for r in np.asarray(s)]
      np.testing.assert_array_equal(got, want)

  def test_per_row_eps_and_nan(self):
    s = jnp.array([[0.0, 0.0, 0.0, 0.0], [0.0, jnp.nan, 0.0, 0.0]])
    np.testing.assert_array_equal(
      theory.k_eps(s, jnp.array([0.3, 0.3])), [3, 0]
    )

  @parameterized.parameters(0.0, 1.0, -0.5)
  def test_bad_eps(self, eps):
    with self.assertRaisesRegex(ValueError, "eps="):
      theory.k_eps(jnp.zeros(7), eps)


if __name__ == "__main__":
  absltest.main()
