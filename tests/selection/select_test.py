"""select: kept sets, tie-breaking, counts, certificates sound vs float64."""

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import strategies as st

import jaxtopk
from tests import rand
from tests.theory import truth

N = 13  # key axis used by the property tests (masks vary the real count)

POLICIES = (
  jaxtopk.Dense(),
  jaxtopk.FixedK(1),
  jaxtopk.FixedK(5),
  jaxtopk.Ratio(0.3),
  jaxtopk.PowerLaw(1.5, 0.5),
  jaxtopk.Certified(0.01),
  jaxtopk.Certified(0.2),
  jaxtopk.Certified(0.6, max_topk=3),
)


@functools.partial(jax.jit, static_argnames="policy")
def _select(logits, mask, values, policy):
  return jaxtopk.select(logits, policy, mask=mask, values=values)


def _truth(logits, keep, mask, values=None):
  """Tail mass and ||Attn - Attn_k|| of one row (extended precision)."""
  tau = float(np.exp(truth.log_tau(logits, keep, mask)))
  if values is None:
    return tau, None
  return tau, truth.output_error(logits, keep, values, mask)


# Adversarial rows: ties, repeated values, huge ranges, tiny spreads.
_floats = st.one_of(
  st.floats(-30, 30, width=32),
  st.sampled_from([0.0, 1.0, -1.0, 2.5, 1e4, -1e4, 88.0, 3e4]),
)
_rows = hnp.arrays(np.float32, (3, N), elements=_floats)
_masks = hnp.arrays(np.bool_, (3, N))


class SelectTest(parameterized.TestCase):
  def test_fixedk_keeps_largest_with_index_tie_break(self):
    s = jnp.array([1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0])
    keep = jaxtopk.select(s, jaxtopk.FixedK(4)).keep
    # 3, 3 above the threshold 2; two of the three tied 2s, lowest index.
    np.testing.assert_array_equal(keep, [0, 1, 1, 1, 1, 0, 0])

  def test_certified_keeps_all_ties_at_threshold(self):
    s = jnp.array([3.0, 0.0, 2.0, 2.0, -1.0])
    sel = jaxtopk.select(s, jaxtopk.Certified(0.1))
    np.testing.assert_array_equal(sel.keep, [1, 0, 1, 1, 0])

  @parameterized.named_parameters(
    ("fixedk", jaxtopk.FixedK(5)),
    ("ratio", jaxtopk.Ratio(0.3)),
    ("powerlaw", jaxtopk.PowerLaw(1.5, 0.5)),
    ("dense", jaxtopk.Dense()),
  )
  def test_counts_match_num_kept_and_sorted_top(self, policy):
    s = rand.normal(0, (7, 11, 37))
    sel = jaxtopk.select(s, policy)
    topk = policy.num_kept(37)
    np.testing.assert_array_equal(sel.k_kept, topk)
    thresh = np.sort(np.asarray(s), -1)[..., -topk]
    np.testing.assert_array_equal(sel.keep, np.asarray(s) >= thresh[..., None])

  def test_counts_with_mask_use_real_keys(self):
    s = rand.normal(0, (5, 11))
    n_real = np.array([11, 7, 3, 1, 5])
    mask = np.arange(11)[None, :] < n_real[:, None]
    for policy in (jaxtopk.Ratio(0.3), jaxtopk.PowerLaw(1.5, 0.5)):
      sel = jaxtopk.select(s, policy, mask=mask)
      want = [policy.num_kept(int(n)) for n in n_real]
      np.testing.assert_array_equal(sel.k_kept, want)
      self.assertFalse(np.any(np.asarray(sel.keep) & ~mask))

  @parameterized.parameters(0.01, 0.05, 0.3)
  def test_certified_exact_is_minimal(self, eps):
    s = 3.0 * rand.normal(0, (13, 101))
    sel = jaxtopk.select(s, jaxtopk.Certified(eps))
    s64 = np.sort(np.asarray(s, np.float64), -1)[:, ::-1]
    p = np.exp(s64 - s64[:, :1])
    p /= p.sum(-1, keepdims=True)
    tail = 1 - np.cumsum(p, -1)  # tail after keeping the top j+1
    k_min = np.argmax(tail <= eps, axis=-1) + 1
    k_loose = np.argmax(tail <= eps * (1 - 1e-4), axis=-1) + 1
    k = np.asarray(sel.k_kept)
    self.assertTrue(np.all(k >= k_min), (k, k_min))
    self.assertTrue(np.all(k <= k_loose), (k, k_loose))
    self.assertTrue(np.all(sel.certificate.tv_bound <= eps))

  def test_max_topk_caps_and_reports_true_bound(self):
    s = jnp.zeros((3, 11))  # flat rows need every key for small eps
    sel = jaxtopk.select(s, jaxtopk.Certified(0.01, max_topk=4))
    np.testing.assert_array_equal(sel.k_kept, 4)
    np.testing.assert_allclose(sel.certificate.tv_bound, 7 / 11, rtol=1e-4)
    self.assertTrue(np.all(sel.certificate.tv_bound >= 7 / 11))

  def test_fully_masked_row_is_invalid(self):
    s = jnp.ones((2, 5))
    mask = jnp.array([[True] * 5, [False] * 5])
    sel = jaxtopk.select(s, jaxtopk.FixedK(2), mask=mask)
    np.testing.assert_array_equal(sel.certificate.valid, [True, False])
    self.assertFalse(np.any(sel.keep[1]))
    self.assertTrue(np.isnan(sel.certificate.tv_bound[1]))

  def test_non_finite_logits_are_invalid(self):
    s = jnp.array([[1.0, jnp.nan, 0.0], [1.0, jnp.inf, 0.0]])
    sel = jaxtopk.select(s, jaxtopk.FixedK(2))
    np.testing.assert_array_equal(sel.certificate.valid, [False, False])

  def test_n1_and_bf16(self):
    sel = jaxtopk.select(jnp.ones((3, 1), jnp.bfloat16), jaxtopk.FixedK(4))
    np.testing.assert_array_equal(sel.k_kept, 1)
    np.testing.assert_array_equal(sel.certificate.tv_bound, 0.0)
    self.assertEqual(sel.certificate.tv_bound.dtype, jnp.float32)

  def test_vmap_and_jit_agree(self):
    s = rand.normal(0, (5, 7, 11))
    pol = jaxtopk.Certified(0.1)
    a = jaxtopk.select(s, pol)
    b = jax.vmap(lambda x: jaxtopk.select(x, pol))(s)
    c = jax.jit(lambda x: jaxtopk.select(x, pol))(s)
    for other in (b, c):
      np.testing.assert_array_equal(a.keep, other.keep)
      np.testing.assert_allclose(
        a.certificate.tv_bound, other.certificate.tv_bound, rtol=1e-6
      )

  @parameterized.named_parameters(
    ("not_policy", dict(policy="topk"), TypeError, "policy"),
    ("mask", dict(mask=np.ones((3, 4), bool)), ValueError, "mask"),
    ("mask_float", dict(mask=np.ones((2, 7))), TypeError, "mask.dtype"),
    ("values", dict(values=np.ones((2, 5, 3))), ValueError, "values"),
    ("int_logits", dict(logits=np.ones((2, 7), np.int32)), TypeError, "int32"),
    ("bool_logits", dict(logits=np.ones((2, 7), bool)), TypeError, "bool"),
    ("complex", dict(logits=np.ones((2, 7), np.complex64)), TypeError, "real"),
  )
  def test_bad_input(self, kwargs, exc, fragment):
    args = dict(policy=jaxtopk.FixedK(1), logits=jnp.ones((2, 7)))
    args.update(kwargs)
    policy, logits = args.pop("policy"), args.pop("logits")
    with self.assertRaisesRegex(exc, fragment):
      jaxtopk.select(logits, policy, **args)

  @parameterized.named_parameters(
    ("fixedk", jaxtopk.FixedK(2)),
    ("certified", jaxtopk.Certified(0.1)),
  )
  def test_no_keys_gives_invalid_rows(self, policy):
    # Audit finding: n = 0 crashed with an obscure message.
    sel = jaxtopk.select(jnp.ones((3, 0)), policy, values=np.ones((3, 0, 2)))
    self.assertEqual(sel.keep.shape, (3, 0))
    np.testing.assert_array_equal(sel.certificate.valid, False)
    self.assertTrue(np.all(np.isnan(sel.certificate.output_error_bound)))

  def test_minus_inf_logit_is_a_key_of_zero_mass(self):
    # Audit finding: bias = -inf made the whole row invalid; it is a key of zero
    # mass (never kept, not counted), as in jax.nn.dot_product_attention.
    s = jnp.array([[2.0, -jnp.inf, 1.0, 0.0], [-jnp.inf] * 4])
    for policy in (jaxtopk.FixedK(3), jaxtopk.Dense(), jaxtopk.Certified(0.5)):
      sel = jaxtopk.select(s, policy)
      self.assertTrue(bool(sel.certificate.valid[0]))
      self.assertFalse(bool(sel.keep[0, 1]))
      self.assertFalse(bool(sel.certificate.valid[1]))  # no key of mass
    sel = jaxtopk.select(s, jaxtopk.Ratio(0.5))
    self.assertEqual(int(sel.k_kept[0]), 2)  # ceil(0.5 * 3 real keys)

  def test_nan_value_of_a_real_key_makes_the_row_invalid(self):
    v = np.ones((2, 4, 3), np.float32)
    v[0, 3, 1] = np.nan
    v[1, 3, 1] = np.inf
    sel = jaxtopk.select(jnp.zeros((2, 4)), jaxtopk.FixedK(2), values=v)
    np.testing.assert_array_equal(sel.certificate.valid, [False, False])
    sel = jaxtopk.select(
      jnp.zeros((2, 4)),
      jaxtopk.FixedK(2),
      values=v,
      mask=np.array([True, True, True, False]),
    )
    np.testing.assert_array_equal(sel.certificate.valid, [True, True])

  @parameterized.named_parameters(
    (
      "delta",
      jaxtopk.Certified(0.01, jaxtopk.DeltaSearch(block_size=4), max_topk=4),
    ),
    ("mc", jaxtopk.Certified(0.01, jaxtopk.MCSearch(block_size=4), max_topk=4)),
  )
  def test_search_strategies_honoured_as_exact(self, policy):
    # Given logits every key is scored: Delta/MC run the exact search (a
    # deterministic certificate) and max_topk caps as on the exact path.
    sel = jaxtopk.select(jnp.zeros((3, 11)), policy)
    np.testing.assert_array_equal(sel.k_kept, 4)
    np.testing.assert_array_equal(sel.certificate.keys_scored, 11)
    self.assertEqual(sel.certificate.failure_prob, 0.0)

  def test_output_bound_sound_for_tiny_and_huge_values(self):
    # ||v|| of v ~ 1e-30 underflowed to 0 in float32 (squares flush), so
    # the output bound was 0 below a positive truth (CI found it).
    logits = jnp.asarray([[0.0, 0.0, -1.0, -2.0]])
    for scale in (1e-30, 1e30, 2.7e-44):  # the last is subnormal
      values = scale * np.ones((1, 4, 3), np.float32)
      values[0, 2:] *= -1.0
      sel = jaxtopk.select(logits, jaxtopk.FixedK(2), values=values)
      _, err = _truth(
        np.asarray(logits[0]),
        np.asarray(sel.keep[0]),
        np.ones(4, bool),
        values[0],
      )
      bound = float(sel.certificate.output_error_bound[0])
      self.assertTrue(np.isfinite(bound))
      self.assertGreaterEqual(bound, err)
      self.assertGreater(bound, 0.0)

  @given(
    rows=_rows,
    masks=_masks,
    values=hnp.arrays(np.float32, (3, N, 3), elements=st.floats(-5, 5)),
    which=st.integers(0, len(POLICIES) - 1),
    bf16=st.booleans(),
  )
  def test_certificates_sound_vs_float64(
    self, rows, masks, values, which, bf16
  ):
    policy = POLICIES[which]
    logits = jnp.asarray(rows, jnp.bfloat16 if bf16 else jnp.float32)
    sel = _select(logits, masks, values, policy)
    cert = sel.certificate
    exact = np.asarray(logits.astype(jnp.float32))
    for r in range(3):
      keep = np.asarray(sel.keep[r])
      if not masks[r].any():
        self.assertFalse(bool(cert.valid[r]))
        self.assertFalse(keep.any())
        continue
      self.assertTrue(bool(cert.valid[r]))
      self.assertFalse(np.any(keep & ~masks[r]))
      tau, err = _truth(exact[r], keep, masks[r], values[r])
      self.assertGreaterEqual(float(cert.tv_bound[r]), tau)
      self.assertLessEqual(float(cert.tv_bound[r]), 1.0)
      self.assertGreaterEqual(float(cert.output_error_bound[r]), err)
      # Kept keys are the largest: every kept logit >= every dropped one.
      kept, dropped = exact[r][keep], exact[r][masks[r] & ~keep]
      if dropped.size:
        self.assertGreaterEqual(kept.min(), dropped.max())
      if isinstance(policy, jaxtopk.Certified) and policy.max_topk is None:
        self.assertLessEqual(float(cert.tv_bound[r]), policy.eps)


if __name__ == "__main__":
  absltest.main()
