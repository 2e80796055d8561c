"""certified_search: Delta-/MC-Search sound vs float64, fewer scored keys."""

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import strategies as st

import jaxtopk
from jaxtopk import theory
from jaxtopk.selection import _search
from tests import rand

R, N, D, BS = 3, 40, 5, 8  # rows, keys (ragged last block), dim, block
_STRATEGY = {
  "exact": jaxtopk.Exact,
  "delta": jaxtopk.DeltaSearch,
  "mc": jaxtopk.MCSearch,
}


def _truth(q, k, keep, mask, scale):
  """float64 tau of the kept set, per row."""
  s = np.einsum("rd,rnd->rn", q.astype(np.float64), k.astype(np.float64))
  s = np.where(mask, s * scale, -np.inf)
  with np.errstate(invalid="ignore"):  # all-masked rows give NaN, unused
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e * ~keep).sum(-1) / e.sum(-1)


def _clustered(seed, r, n, d, spread=3.0):
  rng = rand.generator(seed)
  drift = np.cumsum(rng.standard_normal((r, n // 16 + 1, d)), 1)
  centres = np.repeat(drift, 16, 1)[:, :n]
  k = 0.2 * rng.standard_normal((r, n, d)) + spread * centres
  return k.astype(np.float32)


_vals = st.one_of(
  st.floats(-4, 4, width=32), st.sampled_from([0.0, 1.0, -1.0, 20.0, -20.0])
)


class SearchTest(parameterized.TestCase):
  @given(
    q=hnp.arrays(np.float32, (R, D), elements=_vals),
    k=hnp.arrays(np.float32, (R, N, D), elements=_vals),
    mask=hnp.arrays(np.bool_, (R, N)),
    search=st.sampled_from(["exact", "delta", "mc"]),
    eps=st.sampled_from([0.01, 0.2]),
  )
  def test_sound_vs_float64(self, q, k, mask, search, eps):
    policy = jaxtopk.Certified(eps, _STRATEGY[search](BS))
    sel = jaxtopk.certified_search(
      q, k, policy=policy, mask=mask, values=k, rng=jax.random.key(0)
    )
    cert = sel.certificate
    keep = np.asarray(sel.keep)
    tau = _truth(q, k, keep, mask, 1 / np.sqrt(D))
    for r in range(R):
      if not mask[r].any():
        self.assertFalse(bool(cert.valid[r]))
        continue
      self.assertTrue(bool(cert.valid[r]))
      self.assertFalse(np.any(keep[r] & ~mask[r]))
      # MC may fail with probability delta = 0.01; on these 60 x 3 rows a
      # failure would be a red flag worth reading, so none is tolerated.
      self.assertGreaterEqual(float(cert.tv_bound[r]), tau[r])
      self.assertLessEqual(float(cert.tv_bound[r]), eps)
      self.assertLessEqual(int(cert.k_kept[r]), int(cert.keys_scored[r]))

  @parameterized.parameters("exact", "delta", "mc")
  def test_blocks_far_below_the_best_stay_sound(self, search):
    # One key ~179 logits above the rest: e^{u_b - u_max} underflows in
    # float32 (CI once found MC returning NaN here). The bound must stay a
    # finite number >= the float64 truth (~1e-76), rounded up to tiny.
    # (R rows, eps 0.01, values: test_sound_vs_float64's programs.)
    q = np.zeros((R, D), np.float32)
    q[1, 0] = -20.0
    k = np.full((R, N, D), 20.0, np.float32)
    k[1, 0, 0] = 0.0
    policy = jaxtopk.Certified(0.01, _STRATEGY[search](BS))
    sel = jaxtopk.certified_search(
      q, k, policy=policy, values=k, rng=jax.random.key(0)
    )
    cert = sel.certificate
    tau = _truth(q, k, np.asarray(sel.keep), np.ones((R, N), bool), D**-0.5)
    self.assertTrue(np.all(np.isfinite(cert.tv_bound)))
    self.assertTrue(np.all(np.asarray(cert.tv_bound, np.float64) >= tau))
    self.assertTrue(np.all(np.isfinite(cert.output_error_bound)))
    self.assertEqual(int(cert.k_kept[1]), 1)

  # MC pays num_samples per non-empty block up front (counted), and every
  # search the box and ball read per block (3 key-equivalents): MC's blocks
  # are 32 keys so that its fixed cost stays below half the keys.
  @parameterized.parameters(
    ("delta", 0.05, 16), ("delta", 0.01, 16), ("mc", 0.05, 32)
  )
  def test_scores_fewer_keys_on_clustered_rows(self, search, eps, bs):
    k = _clustered(0, 4, 512, 8)
    q = 2 * np.asarray(rand.normal(1, (4, 8)))
    mc = dict(num_samples=4) if search == "mc" else {}
    policy = jaxtopk.Certified(eps, _STRATEGY[search](bs, **mc))
    sel = jaxtopk.certified_search(q, k, policy=policy, rng=jax.random.key(2))
    frac = np.asarray(sel.certificate.keys_scored) / 512
    self.assertLess(float(frac.mean()), 0.5)
    exact = jaxtopk.certified_search(
      q, k, policy=jaxtopk.Certified(eps, jaxtopk.Auto(block_size=bs))
    )
    np.testing.assert_array_equal(exact.certificate.keys_scored, 512)
    self.assertTrue(np.all(sel.certificate.tv_bound <= eps))

  def test_mc_empirical_failure_rate_below_delta(self):
    # Many rows, loose Hoeffding: count rows whose bound is below the truth.
    r, n = 64, 256
    k = _clustered(3, r, n, 8, spread=1.0)
    q = 2 * np.asarray(rand.normal(4, (r, 8)))
    policy = jaxtopk.Certified(
      0.05, jaxtopk.MCSearch(block_size=16, failure_prob=0.05, num_samples=4)
    )
    fails = 0
    for trial in range(3):
      sel = jaxtopk.certified_search(
        q, k, policy=policy, rng=jax.random.key(10 + trial)
      )
      tau = _truth(
        q, k, np.asarray(sel.keep), np.ones((r, n), bool), 1 / 8**0.5
      )
      fails += int(np.sum(np.asarray(sel.certificate.tv_bound) < tau))
      self.assertEqual(sel.certificate.failure_prob, 0.05)
    self.assertLessEqual(fails / (3 * r), 0.05)

  def test_dot_box_bound_matches_theory_box_bound(self):
    k = _clustered(5, 2, 64, 7)
    q = np.asarray(rand.normal(6, (2, 3, 7)))
    box = theory.box_summary(k, block_size=BS)
    sub = jax.tree.map(lambda x: x[:, None], box)  # broadcast over 3
    want = theory.box_upper_bound(q, sub, scale=0.4)  # [2, 3, nb]
    got = _search.box_upper_bound_dot(q, box, scale=0.4)
    # The same bound up to the two forms' rounding slacks: each at most a
    # few (d + 3) eps 0.4 ||q||_1 max|box| (the dot form's own slack term).
    amax = np.maximum(np.abs(box.kmin), np.abs(box.kmax)).max(-1)  # [2, nb]
    q1 = np.abs(q).sum(-1)  # [2, 3]
    slack = (
      (7 + 3) * np.finfo(np.float32).eps * 0.4 * q1[..., None] * amax[:, None]
    )
    np.testing.assert_array_less(np.abs(got - want), 4 * slack + 1e-6)
    s = np.einsum("rgd,rnd->rgn", q.astype(np.float64), k) * 0.4
    smax = s.reshape(2, 3, -1, BS).max(-1)
    self.assertTrue(np.all(np.asarray(got, np.float64) >= smax))
    absdot = _search.box_abs_dot(q, box, 0.4)
    want_abs = 0.4 * np.einsum("rgd,rnd->rgn", np.abs(q), np.abs(k)).max(-1)
    self.assertTrue(np.all(np.asarray(absdot, np.float64) >= want_abs))

  def test_dot_box_bound_overflow_is_inf_never_nan(self):
    # |q|_1 = 6e38 overflows while every logit is moderate: the slack reads
    # inf, and a block of zero keys (inf x 0) read NaN, which made the
    # searched row invalid. Now: +inf (sound) on the non-zero blocks, the
    # exact 0 on the zero block; NaN queries still give NaN.
    k = np.zeros((1, 3 * BS, 4), np.float32)
    k[0, :BS] = [2.0, 1e-30, 1.0, 0.0]  # moderate logits against q
    k[0, BS : 2 * BS] = [-1.0, 0.5, 0.0, 1e-38]
    box = theory.box_summary(k, block_size=BS)  # block 2: zero keys
    q = np.array([[[1e-20, 1e-38, 3e38, 3e38]]], np.float32)  # [1, 1, 4]
    u = np.asarray(_search.box_upper_bound_dot(q, box, scale=0.5))
    self.assertFalse(np.any(np.isnan(u)), u)
    self.assertEqual(u[0, 0, 2], 0.0)
    s = np.einsum("gd,nd->gn", q[0].astype(np.float64), k[0]) * 0.5
    smax = s.reshape(1, 3, BS).max(-1)
    self.assertTrue(np.all(u[0] >= smax), (u, smax))
    nan_q = np.array([[[np.nan, 1.0, 1.0, 1.0]]], np.float32)
    u = np.asarray(_search.box_upper_bound_dot(nan_q, box, scale=0.5))
    self.assertTrue(np.all(np.isnan(u)), u)

  def test_dot_box_bound_of_a_cache_needs_no_zeroed_boxes(self):
    # A KVCache's empty blocks keep their initial +-inf boxes; the bound
    # masks them by count, so the raw boxes give the zeroed boxes' bounds.
    cache = jaxtopk.KVCache.create(2, 64, 3, 7, block_size=8)
    cache = cache.append(
      rand.normal(7, (2, 20, 3, 7)), rand.normal(8, (2, 20, 3, 7))
    )
    q = np.asarray(rand.normal(9, (2, 3, 2, 7)))  # 2 queries per kv head
    raw = _search.box_upper_bound_dot(q, cache.box(zero_empty=False), scale=0.4)
    zeroed = _search.box_upper_bound_dot(q, cache.box(), scale=0.4)
    np.testing.assert_array_equal(raw, zeroed)
    self.assertTrue(np.all(np.isfinite(np.asarray(raw)[..., :3])))
    self.assertTrue(np.all(np.asarray(raw)[..., 3:] == -np.inf))

  @parameterized.named_parameters(
    ("policy", dict(policy=jaxtopk.FixedK(2)), TypeError, "Certified"),
    ("shape", dict(query=np.ones((R + 1, D))), ValueError, "leading"),
    ("mc_key", dict(policy=jaxtopk.Certified(0.1, "mc")), ValueError, "key"),
    ("int_query", dict(query=np.ones((R, D), np.int32)), TypeError, "query"),
    ("float_mask", dict(mask=np.ones((R, N))), TypeError, "mask"),
    ("scale_inf", dict(scale=np.inf), ValueError, "scale=inf"),
    ("scale_zero", dict(scale=0.0), ValueError, "scale=0.0"),
  )
  def test_bad_input(self, kwargs, exc, fragment):
    args = dict(query=np.ones((R, D)), policy=jaxtopk.Certified(0.1, "delta"))
    args.update(kwargs)
    with self.assertRaisesRegex(exc, fragment):
      jaxtopk.certified_search(args.pop("query"), jnp.ones((R, N, D)), **args)

  def test_no_keys_is_invalid(self):
    sel = jaxtopk.certified_search(
      np.ones((R, D)), np.ones((R, 0, D)), policy=jaxtopk.Certified(0.1)
    )
    self.assertEqual(sel.keep.shape, (R, 0))
    self.assertFalse(np.any(sel.certificate.valid))


def _tau_ld(q, k, keep, mask, scale):
  """Exact (80-bit) tau of the kept set of every row."""
  ld = np.longdouble
  s = np.einsum("rd,rnd->rn", q.astype(ld), k.astype(ld)) * ld(scale)
  out = []
  for r in range(s.shape[0]):
    real = s[r][mask[r]]
    e = np.exp(real - real.max())
    out.append(e[~keep[r][mask[r]]].sum() / e.sum())
  return np.asarray(out)


_SEARCHES = (
  ("exact", jaxtopk.Exact()),
  ("delta", jaxtopk.DeltaSearch(4)),
  ("mc", jaxtopk.MCSearch(4, num_samples=2)),
  ("lowrank", jaxtopk.DeltaSearch(4, jaxtopk.LowRank(2))),
)


class AdversarialSearchTest(parameterized.TestCase):
  @parameterized.named_parameters(*_SEARCHES)
  def test_flushed_query_component(self, search):
    # Audit finding: q_0 = 1e-38 is read as 0 by the CPU, so the first key's
    # logit reads 5 instead of 2; the bound was 0.15 against tau 0.73.
    q = np.array([[1e-38, 1.0, 0.0, 0.0]], np.float32)
    k = np.array([[[-3e38, 5.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0]]], np.float32)
    sel = jaxtopk.certified_search(
      q,
      k,
      policy=jaxtopk.Certified(0.45, search),
      scale=1.0,
      rng=jax.random.key(0),
    )
    cert = sel.certificate
    tau = _tau_ld(q, k, np.asarray(sel.keep), np.ones((1, 2), bool), 1.0)
    self.assertTrue(bool(cert.valid[0]))
    self.assertGreaterEqual(np.longdouble(float(cert.tv_bound[0])), tau[0])

  @parameterized.named_parameters(*_SEARCHES)
  def test_keys_whose_squares_underflow(self, search):
    # Second audit: keys +-1e-19 (squares underflow) got block radius 0, so
    # the ball bound read 0 for blocks whose keys reach logit 1.8, and
    # blocks of mass were skipped: tv 0.536 against tau 0.782.
    a = 1e-19
    q = np.full((2, 4), 0.9e19, np.float32)
    k = np.zeros((2, 32, 4), np.float32)
    k[:, :4] = a
    for b in range(1, 8):
      k[:, 4 * b : 4 * b + 2] = a
      k[:, 4 * b + 2 : 4 * b + 4] = -a
    policy = jaxtopk.Certified(0.6, search)
    sel = jaxtopk.certified_search(q, k, policy=policy, rng=jax.random.key(2))
    tau = _tau_ld(q, k, np.asarray(sel.keep), np.ones((2, 32), bool), 0.5)
    for r in range(2):
      self.assertTrue(bool(sel.certificate.valid[r]))
      self.assertGreaterEqual(
        np.longdouble(float(sel.certificate.tv_bound[r])), tau[r]
      )

  def test_subnormal_scale_refused(self):
    with self.assertRaisesRegex(ValueError, "scale"):
      jaxtopk.certified_search(
        np.ones((1, 4), np.float32),
        np.ones((1, 8, 4), np.float32),
        policy=jaxtopk.Certified(0.1, jaxtopk.DeltaSearch(block_size=4)),
        scale=1.1e-38,
      )

  @parameterized.named_parameters(*_SEARCHES)
  def test_max_topk_honoured(self, search):
    # Audit finding: Certified(0.01, max_topk=4) kept 4 keys on the exact path
    # but 253 through Delta-Search; every search now caps.
    k = np.zeros((R, 24, D), np.float32)  # flat rows need every key
    q = np.ones((R, D), np.float32)
    policy = jaxtopk.Certified(0.01, search, max_topk=4)
    sel = jaxtopk.certified_search(q, k, policy=policy, rng=jax.random.key(1))
    np.testing.assert_array_equal(sel.k_kept, 4)
    np.testing.assert_array_equal(np.sum(sel.keep, -1), 4)
    self.assertTrue(np.all(np.asarray(sel.certificate.tv_bound) >= 20 / 24))

  @parameterized.named_parameters(*_SEARCHES)
  def test_sound_on_extreme_magnitudes(self, search):
    policy = jaxtopk.Certified(0.1, search)

    @given(
      a=st.integers(-30, 30),
      seed=st.integers(0, 2**31 - 1),
      sub=st.booleans(),
      huge=st.booleans(),
    )
    def check(a, seed, sub, huge):
      rng = np.random.default_rng(seed)
      q = (rng.normal(size=(2, D)) * 10.0**a).astype(np.float32)
      k = (rng.normal(size=(2, 9, D)) * 10.0**-a).astype(np.float32)
      if sub:  # subnormal components, read as 0 by the CPU
        q[:, 0] = np.float32(3e-39)
        k[:, ::2, 1] = np.float32(-7e-40)
      if huge:  # one huge coordinate against a tiny one
        k[:, 1, 0] = np.float32(-2e38)
      sel = jaxtopk.certified_search(
        q, k, policy=policy, values=k, rng=jax.random.key(seed % 7)
      )
      cert = sel.certificate
      keep = np.asarray(sel.keep)
      tau = _tau_ld(q, k, keep, np.ones((2, 9), bool), D**-0.5)
      for r in range(2):
        if not bool(cert.valid[r]):
          continue
        self.assertGreaterEqual(np.longdouble(float(cert.tv_bound[r])), tau[r])

    check()


if __name__ == "__main__":
  absltest.main()
