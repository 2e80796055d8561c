"""Policies: validation names the bad value; behaviour lives on the object."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

import jaxtopk
from jaxtopk.selection import Auto
from jaxtopk.selection import Box
from jaxtopk.selection import Codes
from jaxtopk.selection import DeltaSearch
from jaxtopk.selection import Exact
from jaxtopk.selection import LowRank
from jaxtopk.selection import MCSearch
from jaxtopk.selection import internal
from jaxtopk.selection.internal import capabilities


class ValidationTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("fixedk_zero", lambda: jaxtopk.FixedK(0), "topk=0"),
    ("fixedk_float", lambda: jaxtopk.FixedK(2.5), "2.5"),
    ("fixedk_bool", lambda: jaxtopk.FixedK(True), "FixedK.topk=True"),
    ("fixedk_np_bool", lambda: jaxtopk.FixedK(np.bool_(True)), "topk"),
    ("fixedk_array", lambda: jaxtopk.FixedK(np.array([3])), "scalar"),
    ("ratio_zero", lambda: jaxtopk.Ratio(0.0), "rho=0.0"),
    ("ratio_big", lambda: jaxtopk.Ratio(1.5), "rho=1.5"),
    ("ratio_nan", lambda: jaxtopk.Ratio(float("nan")), "rho=nan"),
    ("ratio_str", lambda: jaxtopk.Ratio("0.5"), "rho='0.5'"),
    ("ratio_complex", lambda: jaxtopk.Ratio(0.5j), "rho=0.5j"),
    ("powerlaw_c", lambda: jaxtopk.PowerLaw(1.0, 1.5), "c=1.5"),
    ("powerlaw_alpha", lambda: jaxtopk.PowerLaw(-1.0, 0.5), "alpha=-1.0"),
    # Audit finding: PowerLaw(inf, 0.5) was accepted, then crashed.
    ("powerlaw_inf", lambda: jaxtopk.PowerLaw(float("inf"), 0.5), "inf"),
    ("powerlaw_np_inf", lambda: jaxtopk.PowerLaw(np.inf, 0.5), "alpha=inf"),
    ("certified_eps", lambda: jaxtopk.Certified(1.0), "eps=1.0"),
    ("certified_eps_nan", lambda: jaxtopk.Certified(np.nan), "eps=nan"),
    ("certified_search", lambda: jaxtopk.Certified(0.1, "bogus"), "bogus"),
    ("certified_search_type", lambda: jaxtopk.Certified(0.1, 3), "search=3"),
    ("mc_failure_prob", lambda: MCSearch(failure_prob=0.0), "failure_prob=0"),
    ("mc_samples", lambda: MCSearch(num_samples=0), "num_samples=0"),
    ("block_size", lambda: DeltaSearch(block_size=0), "block_size=0"),
    ("rank", lambda: LowRank(0), "LowRank.rank=0"),
    ("max_topk", lambda: jaxtopk.Certified(0.1, max_topk=0), "max_topk=0"),
    ("max_topk_bool", lambda: jaxtopk.Certified(0.1, max_topk=True), "True"),
    (
      "dense_above_zero",
      lambda: jaxtopk.Certified(0.1, dense_above=0),
      r"Certified.dense_above=0.0 must be in \(0, 1\]",
    ),
    (
      "dense_above_big",
      lambda: jaxtopk.Certified(0.1, dense_above=1.5),
      "dense_above=1.5",
    ),
    (
      "dense_above_bool",
      lambda: jaxtopk.Certified(0.1, dense_above=True),
      "dense_above=True",
    ),
    ("bound", lambda: jaxtopk.Certified(0.1, "delta", bound="x"), "'x'"),
    # A field the search does not read is refused by name.
    ("delta_on_exact", lambda: jaxtopk.Certified(0.1, delta=0.05), "delta"),
    (
      "samples_on_delta",
      lambda: jaxtopk.Certified(0.1, "delta", num_samples=3),
      "Certified.num_samples=3 is not read by search='delta'",
    ),
    (
      "lowrank_on_mc",
      lambda: jaxtopk.Certified(0.1, "mc", bound="lowrank"),
      "Certified.bound='lowrank'",
    ),
    (
      "rank_on_box",
      lambda: jaxtopk.Certified(0.1, "delta", rank=3),
      "Certified.rank=3",
    ),
    (
      "keyword_with_strategy",
      lambda: jaxtopk.Certified(0.1, DeltaSearch(), block_size=8),
      "conflicts",
    ),
  )
  def test_bad_values_are_named(self, make, fragment):
    with self.assertRaisesRegex((ValueError, TypeError), fragment):
      make()

  def test_numpy_and_jax_scalars_are_normalised(self):
    # Audit finding: these were rejected with a misleading message.
    cases = [
      (jaxtopk.Ratio(np.float32(0.5)).rho, 0.5, float),
      (jaxtopk.Certified(np.float32(0.1)).eps, float(np.float32(0.1)), float),
      (jaxtopk.FixedK(np.int64(3)).topk, 3, int),
      (jaxtopk.FixedK(jnp.int32(3)).topk, 3, int),
      (jaxtopk.Certified(jnp.float32(0.25)).eps, 0.25, float),
      (jaxtopk.PowerLaw(np.int32(2), np.float64(0.5)).alpha, 2.0, float),
      (jaxtopk.Certified(0.1, max_topk=np.int16(4)).max_topk, 4, int),
      (jaxtopk.Ratio(1).rho, 1.0, float),
    ]
    for got, want, typ in cases:
      self.assertEqual(got, want)
      self.assertIs(type(got), typ)
    self.assertEqual(jaxtopk.FixedK(np.int64(3)), jaxtopk.FixedK(3))
    self.assertEqual(hash(jaxtopk.FixedK(np.int64(3))), hash(jaxtopk.FixedK(3)))

  def test_traced_values_refused(self):
    with self.assertRaisesRegex(TypeError, "concrete"):
      jax.jit(lambda x: jaxtopk.FixedK(x).topk)(3)


class StrategyTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("default", lambda: jaxtopk.Certified(0.05), Auto()),
    (
      "delta",
      lambda: jaxtopk.Certified(0.05, search="delta", block_size=32),
      DeltaSearch(32, Box()),
    ),
    (
      "delta_positional",
      lambda: jaxtopk.Certified(0.05, "delta", 32),
      DeltaSearch(32),
    ),
    (
      "lowrank",
      lambda: jaxtopk.Certified(0.05, "delta", bound="lowrank", rank=16),
      DeltaSearch(64, LowRank(16)),
    ),
    (
      "mc",
      lambda: jaxtopk.Certified(0.01, search="mc", delta=0.05, num_samples=4),
      MCSearch(64, 0.05, 4),
    ),
    (
      "auto_block",
      lambda: jaxtopk.Certified(0.05, block_size=16),
      Auto(16),
    ),
    (
      "exact_block",
      lambda: jaxtopk.Certified(0.05, "exact", block_size=16),
      Exact(16),
    ),
    (
      "codes",
      lambda: jaxtopk.Certified(0.05, "delta", bound="codes"),
      DeltaSearch(64, Codes()),
    ),
    (
      "object",
      lambda: jaxtopk.Certified(0.05, DeltaSearch(8, LowRank(3))),
      DeltaSearch(8, LowRank(3)),
    ),
  )
  def test_strings_are_normalised_to_strategies(self, make, want):
    policy = make()
    self.assertEqual(policy.search, want)
    self.assertEqual(policy.block_size, want.block_size)

  def test_attribute_views(self):
    mc = jaxtopk.Certified(0.01, MCSearch(16, failure_prob=0.05, num_samples=4))
    self.assertEqual((mc.num_samples, mc.failure_prob), (4, 0.05))
    self.assertIsNone(mc.bound)
    self.assertTrue(mc.search.needs_rng)
    low = jaxtopk.Certified(0.1, DeltaSearch(bound=LowRank(8)))
    self.assertEqual((low.bound, low.rank), (LowRank(8), 8))
    self.assertEqual(low.failure_prob, 0.0)
    ex = jaxtopk.Certified(0.1)
    self.assertTrue(ex.search.scores_all)  # exact where nothing cheaper
    self.assertEqual(ex.search.feature, "search=exact")
    self.assertIsNone(ex.num_samples)

  @parameterized.named_parameters(
    ("dense", jaxtopk.Dense(), "dense", False, True),
    ("fixed_k", jaxtopk.FixedK(3), "count", False, True),
    ("ratio", jaxtopk.Ratio(0.5), "count", False, True),
    ("power_law", jaxtopk.PowerLaw(1.0, 0.5), "count", False, True),
    ("auto", jaxtopk.Certified(0.1), "certified", False, True),
    ("exact", jaxtopk.Certified(0.1, "exact"), "certified", False, True),
    ("delta", jaxtopk.Certified(0.1, "delta"), "certified", False, False),
    ("mc", jaxtopk.Certified(0.1, "mc"), "certified", True, False),
  )
  def test_behaviour_is_declared_on_the_policy(
    self, policy, kind, needs_rng, scores_all
  ):
    """Backends dispatch on these (no isinstance outside the package)."""
    self.assertEqual(
      (policy.kind, policy.needs_rng, policy.scores_all),
      (kind, needs_rng, scores_all),
    )

  @parameterized.named_parameters(("str", "dense"), ("float", 0.5))
  def test_check_policy_names_the_bad_value(self, value):
    with self.assertRaisesRegex(TypeError, f"policy={value!r}"):
      internal.check_policy(value)
    ok = jaxtopk.Dense()
    self.assertIs(internal.check_policy(ok), ok)

  def test_strategy_keywords_are_deprecated_and_name_the_strategy(self):
    with self.assertWarnsRegex(
      DeprecationWarning, r"Certified\(0\.01, MCSearch\(block_size=16"
    ):
      old = jaxtopk.Certified(0.01, "mc", 16, delta=0.05, num_samples=4)
    self.assertEqual(
      old,
      jaxtopk.Certified(0.01, MCSearch(16, failure_prob=0.05, num_samples=4)),
    )
    with self.assertWarnsRegex(DeprecationWarning, "failure_prob"):
      self.assertEqual(MCSearch(delta=0.2), MCSearch(failure_prob=0.2))
    with self.assertWarnsRegex(DeprecationWarning, "failure_prob"):
      self.assertEqual(old.delta, 0.05)
    with self.assertRaisesRegex(ValueError, "failure_prob=0.1.*delta=0.2"):
      MCSearch(failure_prob=0.1, delta=0.2)

  def test_rng_is_the_prng_argument_and_key_is_deprecated(self):
    logits = jnp.array([3.0, 0.0, 2.0])
    with self.assertWarnsRegex(DeprecationWarning, r"select\(key=.*rng="):
      jaxtopk.select(logits, jaxtopk.FixedK(2), key=jax.random.key(0))
    with self.assertRaisesRegex(ValueError, "rng= and its deprecated"):
      jaxtopk.select(
        logits, jaxtopk.FixedK(2), rng=jax.random.key(0), key=jax.random.key(0)
      )
    mc = jaxtopk.Certified(0.1, "mc")
    with self.assertRaisesRegex(ValueError, "pass rng="):
      jaxtopk.certified_search(jnp.ones(2), jnp.ones((3, 2)), policy=mc)

  def test_equal_policies_hash_alike_and_replace(self):
    a = jaxtopk.Certified(0.1, "delta", 32)
    b = jaxtopk.Certified(0.1, DeltaSearch(block_size=32))
    self.assertEqual(a, b)
    self.assertEqual(hash(a), hash(b))
    c = dataclasses.replace(a, eps=0.2)
    self.assertEqual((c.eps, c.search), (0.2, a.search))
    self.assertIn("DeltaSearch(block_size=32", repr(a))


class CountTest(parameterized.TestCase):
  def test_num_kept(self):
    self.assertEqual(jaxtopk.FixedK(5).num_kept(3), 3)
    self.assertEqual(jaxtopk.FixedK(5).num_kept(11), 5)
    self.assertEqual(jaxtopk.Ratio(1 / 64).num_kept(4096), 64)
    self.assertEqual(jaxtopk.Ratio(0.3).num_kept(7), 3)
    self.assertEqual(jaxtopk.Ratio(1e-4).num_kept(13), 1)
    self.assertEqual(jaxtopk.PowerLaw(2.0, 0.5).num_kept(100), 20)
    self.assertEqual(jaxtopk.Dense().num_kept(13), 13)
    self.assertIsNone(jaxtopk.Certified(0.1).num_kept(13))

  @parameterized.named_parameters(
    ("dense", jaxtopk.Dense()),
    ("fixedk", jaxtopk.FixedK(5)),
    ("ratio", jaxtopk.Ratio(0.3)),
    ("ratio_thin", jaxtopk.Ratio(1 / 64)),
    ("powerlaw", jaxtopk.PowerLaw(1.5, 0.5)),
  )
  def test_row_num_kept_equals_num_kept(self, policy):
    n = 300
    n_real = jnp.arange(n + 1)
    got = jax.jit(lambda r: policy.row_num_kept(r, n))(n_real)
    want = [0] + [policy.num_kept(j) for j in range(1, n + 1)]
    np.testing.assert_array_equal(got, want)

  def test_row_num_kept_beyond_the_table(self):
    n = (1 << 16) + 5
    n_real = jnp.array([1, 1000, 40_000, n - 1, n])
    for policy in (jaxtopk.Ratio(0.3), jaxtopk.PowerLaw(1.5, 0.5)):
      got = np.asarray(policy.row_num_kept(n_real, n))
      want = np.array([policy.num_kept(int(j)) for j in n_real])
      self.assertTrue(np.all(np.abs(got - want) <= 1), (got, want))
      self.assertEqual(got[-1], want[-1])

  def test_policies_are_static_jit_arguments(self):
    traces = []

    def f(x, policy):
      traces.append(policy)
      return x * policy.num_kept(x.shape[-1])

    g = jax.jit(f, static_argnames="policy")
    x = jnp.ones(7)
    g(x, policy=jaxtopk.FixedK(3))
    g(x, policy=jaxtopk.FixedK(np.int64(3)))
    g(x, policy=jaxtopk.FixedK(4))
    self.assertLen(traces, 2)


class CapabilityTest(parameterized.TestCase):
  @parameterized.named_parameters(
    (
      "max_topk",
      jaxtopk.Certified(0.01, max_topk=4),
      "Certified.max_topk=4 is not supported by decode_attention",
    ),
    (
      "search",
      jaxtopk.Certified(0.01, "mc"),
      r"Certified.search=MCSearch\(.*\) is not supported",
    ),
    (
      "bound",
      jaxtopk.Certified(0.01, "delta", bound="lowrank"),
      r"Certified.bound=LowRank\(rank=16\) is not supported",
    ),
    ("policy", jaxtopk.FixedK(3), r"FixedK\(topk=3\) is not supported"),
    (
      "dense_above",
      jaxtopk.Certified(0.01, dense_above=0.5),
      r"Certified.dense_above=0.5 is not supported",
    ),
  )
  def test_require_names_field_and_value(self, policy, fragment):
    caps = capabilities(
      "policy=Dense",
      "policy=Certified",
      "search=exact",
      "search=delta",
      "bound=box",
    )
    backend = "decode_attention(implementation='pallas')"
    with self.assertRaisesRegex(jaxtopk.UnsupportedPolicyError, fragment):
      policy.require(backend, caps)
    # Catchable as either kind of error.
    with self.assertRaises(ValueError):
      policy.require(backend, caps)
    with self.assertRaises(NotImplementedError):
      policy.require(backend, caps)

  def test_every_feature_supported_passes(self):
    for policy in (
      jaxtopk.Dense(),
      jaxtopk.FixedK(2),
      jaxtopk.Ratio(0.5),
      jaxtopk.PowerLaw(1.0, 0.5),
      jaxtopk.Certified(0.1, "delta", bound="lowrank", max_topk=3),
      jaxtopk.Certified(0.1, "mc"),
    ):
      policy.require("test", internal.FEATURES)
      for _, _, feature in policy.features():
        self.assertIn(feature, internal.FEATURES)

  def test_unknown_feature_refused(self):
    with self.assertRaisesRegex(ValueError, "bogus"):
      capabilities("policy=Dense", "bogus")


if __name__ == "__main__":
  absltest.main()
