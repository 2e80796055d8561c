"""Policies: validation names the bad value; num_kept; hashable for jit."""

import jax
import jax.numpy as jnp
from absl.testing import absltest
from absl.testing import parameterized

import jaxtopk


class PoliciesTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("fixedk_zero", lambda: jaxtopk.FixedK(0), "topk=0"),
    ("fixedk_float", lambda: jaxtopk.FixedK(2.5), "2.5"),
    ("ratio_zero", lambda: jaxtopk.Ratio(0.0), "rho=0.0"),
    ("ratio_big", lambda: jaxtopk.Ratio(1.5), "rho=1.5"),
    ("powerlaw_c", lambda: jaxtopk.PowerLaw(1.0, 1.5), "c=1.5"),
    ("powerlaw_alpha", lambda: jaxtopk.PowerLaw(-1.0, 0.5), "alpha=-1.0"),
    ("certified_eps", lambda: jaxtopk.Certified(1.0), "eps=1.0"),
    ("certified_search", lambda: jaxtopk.Certified(0.1, "bogus"), "bogus"),
    ("certified_delta", lambda: jaxtopk.Certified(0.1, delta=0.0), "delta"),
  )
  def test_bad_values_are_named(self, make, fragment):
    with self.assertRaisesRegex((ValueError, TypeError), fragment):
      make()

  def test_num_kept(self):
    self.assertEqual(jaxtopk.FixedK(5).num_kept(3), 3)
    self.assertEqual(jaxtopk.FixedK(5).num_kept(11), 5)
    self.assertEqual(jaxtopk.Ratio(1 / 64).num_kept(4096), 64)
    self.assertEqual(jaxtopk.Ratio(0.3).num_kept(7), 3)
    self.assertEqual(jaxtopk.Ratio(1e-4).num_kept(13), 1)
    self.assertEqual(jaxtopk.PowerLaw(2.0, 0.5).num_kept(100), 20)
    self.assertEqual(jaxtopk.Dense().num_kept(13), 13)
    self.assertIsNone(jaxtopk.Certified(0.1).num_kept(13))

  def test_policies_are_static_jit_arguments(self):
    traces = []

    def f(x, policy):
      traces.append(policy)
      return x * policy.num_kept(x.shape[-1])

    g = jax.jit(f, static_argnames="policy")
    x = jnp.ones(7)
    g(x, policy=jaxtopk.FixedK(3))
    g(x, policy=jaxtopk.FixedK(3))
    g(x, policy=jaxtopk.FixedK(4))
    self.assertLen(traces, 2)


if __name__ == "__main__":
  absltest.main()
