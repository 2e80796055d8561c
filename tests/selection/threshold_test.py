"""selection.threshold: exact Top-k thresholds, budget thresholds, compaction.

Checked against numpy (sorts) on random and adversarial rows: ties, -0.0,
masks, n = 1, empty rows, huge ranges; sharded (vmap with an axis name) equals
single-device; float64.
"""

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import strategies as st

from jaxtopk.selection import threshold
from tests import rand

N = 13

_floats = st.one_of(
  st.floats(-40, 40, width=32),
  st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, 1e4, -1e4, 88.0, 3e38, -3e38]),
)
_rows = hnp.arrays(np.float32, (3, N), elements=_floats)
_masks = hnp.arrays(np.bool_, (3, N))


def _min_kept(v, frac):
  """Fewest top keys of ``v`` (float64) whose dropped mass is <= frac Z."""
  o = np.sort(v)[::-1]
  e = np.exp(o - o[0])
  tails = np.concatenate([1 - np.cumsum(e) / e.sum(), [0.0]])
  return int(np.argmax(tails <= frac)) + (0 if tails[0] <= frac else 1)


def _flush(x):
  """``x`` as XLA:CPU reads it: subnormals as 0."""
  return np.where(np.abs(x) < np.finfo(np.float32).tiny, 0.0, x)


def _split(x, d):
  """``[r, n]`` -> ``[d, r, n / d]`` (d simulated shards of the key axis)."""
  r, n = x.shape
  return jnp.moveaxis(x.reshape(r, d, n // d), 1, 0)


class SortableBitsTest(absltest.TestCase):
  def test_order_and_round_trip(self):
    x = np.array(
      [-np.inf, -3e38, -1.0, -1e-40, -0.0, 0.0, 1e-40, 1.0, 3e38, np.inf],
      np.float32,
    )
    u = np.asarray(threshold.sortable_bits(jnp.asarray(x)))
    self.assertTrue(np.all(np.diff(u.astype(np.int64)) > 0))
    back = threshold.from_sortable_bits(jnp.asarray(u), jnp.float32)
    np.testing.assert_array_equal(
      np.asarray(back).view(np.uint32), x.view(np.uint32)
    )

  def test_rejects_other_dtypes(self):
    with self.assertRaisesRegex(ValueError, "float32 or float64"):
      threshold.sortable_bits(jnp.ones(3, jnp.bfloat16))


class TopkThresholdTest(parameterized.TestCase):
  @given(_rows, _masks, st.integers(0, N + 2))
  def test_exact_kth_largest_and_count_above(self, s, valid, topk):
    t, n_above = jax.jit(threshold.topk_threshold)(s, topk, valid)
    for r in range(3):
      v = np.sort(s[r][valid[r]])[::-1]
      if not v.size:
        continue
      want = v[min(max(topk, 1), v.size) - 1]
      self.assertEqual(float(t[r]), float(want))
      # Counted as the CPU compares: subnormals read as 0.
      flat = _flush(v)
      self.assertEqual(int(n_above[r]), int(np.sum(flat > _flush(want))))

  @given(_rows, _masks, st.integers(0, N + 2))
  def test_topk_mask_keeps_exactly_topk_lowest_index_ties(self, s, valid, k):
    keep = np.asarray(jax.jit(threshold.topk_mask)(s, k, valid))
    for r in range(3):
      want = min(k, int(valid[r].sum()))
      self.assertEqual(int(keep[r].sum()), want)
      self.assertFalse(np.any(keep[r] & ~valid[r]))
      if 0 < want:
        idx = np.nonzero(valid[r])[0]
        # Reference: stable sort by value descending, then index.
        key = -_flush(s[r][idx].astype(np.float64))
        order = idx[np.lexsort((idx, key))]
        np.testing.assert_array_equal(
          np.sort(np.nonzero(keep[r])[0]), np.sort(order[:want])
        )

  @parameterized.parameters(8, 11, 16)
  def test_digit_widths_agree(self, digit_bits):
    s = rand.normal(0, (5, 301)) * 3
    valid = rand.bernoulli(1, 0.7, s.shape)
    k = jnp.array([1, 7, 50, 200, 400])
    t, _ = threshold.topk_threshold(s, k, valid, digit_bits=digit_bits)
    ref = jnp.sort(jnp.where(valid, s, -jnp.inf), -1)[:, ::-1]
    n_valid = valid.sum(-1)
    want = ref[jnp.arange(5), jnp.minimum(k, n_valid) - 1]
    np.testing.assert_array_equal(t, want)

  def test_float64(self):
    with jax.enable_x64(True):
      s = jnp.asarray(
        np.random.default_rng(0).standard_normal((3, 29)), jnp.float64
      )
      s = s.at[0, :5].set(1.0 + 1e-12 * jnp.arange(5))  # below float32 ulp
      t, n_above = threshold.topk_threshold(s, 3, jnp.ones(s.shape, bool))
      want = np.sort(np.asarray(s), -1)[:, -3]
      np.testing.assert_array_equal(t, want)
      np.testing.assert_array_equal(n_above, 2)
      self.assertEqual(t.dtype, jnp.float64)

  def test_sharded_equals_single_device(self):
    s = jnp.round(rand.normal(2, (7, 60)) * 2)
    valid = rand.bernoulli(3, 0.8, s.shape)
    k = jnp.array([1, 3, 5, 9, 20, 45, 70])
    one = threshold.topk_threshold(s, k, valid)
    fn = jax.vmap(
      lambda a, b: threshold.topk_threshold(a, k, b, axis_name="kv"),
      axis_name="kv",
    )
    t, n_above = fn(_split(s, 4), _split(valid, 4))
    np.testing.assert_array_equal(t[0], one[0])
    np.testing.assert_array_equal(n_above[0], one[1])


class BudgetThresholdTest(parameterized.TestCase):
  @given(
    _rows,
    _masks,
    st.sampled_from([1e-6, 0.01, 0.05, 0.3, 0.9]),
    st.booleans(),
    st.booleans(),
  )
  def test_budget_met_and_minimal_up_to_one_fine_bin(
    self, s, valid, frac, relative, coarse
  ):
    # coarse: one pass of COARSE_BINS (budget_mask(coarse=True)), minimal
    # up to one of its bins.
    s64 = s.astype(np.float64)
    lse = np.array(
      [
        np.logaddexp.reduce(s64[r][valid[r]]) if valid[r].any() else 0.0
        for r in range(3)
      ]
    )
    log_budget = (np.log(frac) + (0.0 if relative else lse)).astype(np.float32)
    fn = jax.jit(
      threshold.budget_threshold,
      static_argnames=("relative", "num_bins", "levels"),
    )
    bins = dict(num_bins=threshold.COARSE_BINS, levels=1) if coarse else {}
    t = np.asarray(fn(s, log_budget, valid, relative=relative, **bins))
    for r in range(3):
      v = s64[r][valid[r]]
      keep = v >= t[r]
      if not v.size:
        self.assertEqual(t[r], np.inf)
        continue
      if not relative:  # the budget as given (float32 log at |s| ~ 3e38)
        frac = min(float(np.exp(np.float64(log_budget[r]) - lse[r])), 1.0)
      if frac >= 1.0:
        continue  # every key may be dropped
      m = v.max()
      e = np.exp(v - m)
      tail = e[~keep].sum() / e.sum()
      # Met up to the rounding of the histogram sums (relative 1e-5).
      self.assertLessEqual(tail, frac * (1 + 1e-5) + 1e-30)
      k_min = _min_kept(v, frac)
      self.assertGreaterEqual(keep.sum(), k_min)
      if keep.sum() > k_min:  # every extra key is within one finest bin
        span = np.log(N) - np.log(frac) + 2
        fine = (
          span / (threshold.COARSE_BINS - 1) if coarse else span / 63 / 64**2
        )
        cut = np.sort(v)[::-1][max(k_min - 1, 0)]
        extra = np.sort(v[keep])[: keep.sum() - k_min]
        self.assertLessEqual(
          cut - extra.min(), fine * 1.01 + 8e-7 * (abs(cut) + 1)
        )

  @given(_rows, _masks, st.sampled_from([0.0, 0.5, 0.99, 0.9999]))
  def test_budget_met_with_extra(self, s, valid, share):
    # The extra (e.g. unscored blocks' bounds) takes ``share`` of the
    # budget; the dropped keys must fit what is left, however far below
    # the max they sit (past the histogram's span included).
    frac = 0.01
    s64 = s.astype(np.float64)
    extra = np.zeros(3)
    for r in range(3):
      if valid[r].any():
        z = np.exp(s64[r][valid[r]] - s64[r][valid[r]].max()).sum()
        # extra / (z + extra) = share * frac
        extra[r] = share * frac * z / (1 - share * frac)
    m = np.where(valid.any(-1), np.where(valid, s64, -np.inf).max(-1), 0.0)
    log_extra = np.full(3, -np.inf)
    log_extra[extra > 0] = np.log(extra[extra > 0]) + m[extra > 0]
    fn = jax.jit(threshold.budget_threshold, static_argnames="relative")
    t = np.asarray(
      fn(
        s,
        np.float32(np.log(frac)),
        valid,
        relative=True,
        log_extra=log_extra.astype(np.float32),
      )
    )
    for r in range(3):
      v = s64[r][valid[r]]
      if not v.size:
        continue
      e = np.exp(v - v.max())
      dropped = e[v < t[r]].sum()
      allowed = frac * (e.sum() + extra[r]) - extra[r]
      # Up to the rounding of the histogram sums (relative 1e-5).
      self.assertLessEqual(dropped, allowed + 1e-5 * frac * e.sum() + 1e-30)

  def test_keys_past_the_span_kept_when_the_extra_leaves_no_room(self):
    # 30 keys 12.5 below the max (past the coarse histogram's span of
    # log(256) - log(0.01) + 2 = 12.15) hold 1.1e-4 of the mass; the extra
    # leaves 1.0e-4: dropping them would exceed the budget.
    s = np.full((1, 256), -np.inf, np.float32)
    s[0, 0], s[0, 1:31] = 0.0, -12.5
    valid = np.isfinite(s)
    t = threshold.budget_threshold(
      s, jnp.log(0.01), valid, relative=True, log_extra=jnp.log(0.01)
    )
    self.assertEqual(float(t[0]), -np.inf)

  def test_every_key_droppable_and_none(self):
    s = jnp.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    valid = jnp.array([[True] * 3, [True] * 3, [False] * 3])
    t = threshold.budget_threshold(
      s, jnp.array([10.0, -100.0, 0.0]), valid, log_extra=jnp.array(0.0)
    )
    # Budget e^10 covers the row; extra e^0 alone exceeds e^-100; empty row.
    np.testing.assert_array_equal(t, [np.inf, -np.inf, np.inf])

  def test_log_extra_counts_against_the_budget(self):
    s = jnp.log(jnp.array([[8.0, 4.0, 2.0, 1.0, 1.0]]))
    valid = jnp.ones(s.shape, bool)
    # Without extra, 16 * 0.2 = 3.2 allows dropping 2 + 1 (keys 2.0 and the
    # two 1.0s would be 4 > 3.2): keep 8, 4. With extra 1.5, 2 is too much.
    frac = jnp.log(0.2)
    t0 = threshold.budget_threshold(s, frac, valid, relative=True)
    t1 = threshold.budget_threshold(
      s, frac, valid, relative=True, log_extra=jnp.log(jnp.array([4.0]))
    )
    np.testing.assert_array_equal(s >= t0[:, None], [[1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(s >= t1[:, None], [[1, 1, 1, 1, 1]])

  def test_sharded_equals_single_device(self):
    s = 3 * rand.normal(4, (5, 120))
    valid = rand.bernoulli(5, 0.9, s.shape)
    one = threshold.budget_threshold(s, jnp.log(0.05), valid, relative=True)
    fn = jax.vmap(
      lambda a, b: threshold.budget_threshold(
        a, jnp.log(0.05), b, relative=True, axis_name="kv"
      ),
      axis_name="kv",
    )
    got = fn(_split(s, 3), _split(valid, 3))
    np.testing.assert_allclose(got[0], one, rtol=1e-6)

  def test_nan_row_keeps_all(self):
    s = jnp.array([[1.0, jnp.nan, 0.0], [1.0, jnp.inf, 0.0]])
    t = threshold.budget_threshold(s, jnp.log(0.1), jnp.ones(s.shape, bool))
    np.testing.assert_array_equal(t, [-np.inf, -np.inf])


class DenseAboveTest(parameterized.TestCase):
  """``budget_threshold(dense_above=...)``: rows that keep most keep all."""

  def _both(self, s, valid, frac=0.05, **kw):
    fn = jax.jit(
      threshold.budget_threshold,
      static_argnames=("relative", "dense_above"),
    )
    plain = np.asarray(fn(s, np.log(frac), valid, relative=True, **kw))
    dense = np.asarray(
      fn(s, np.log(frac), valid, relative=True, dense_above=0.5, **kw)
    )
    return plain, dense

  @given(_rows, _masks, st.sampled_from([0.01, 0.05, 0.3]))
  def test_keeps_all_or_the_plain_set(self, s, valid, frac):
    # Per row: every valid key (t = -inf), or the plain threshold's kept
    # set, up to keys at its edge (the passes may round differently inside
    # the skipping branch, e.g. at jax's default compile level).
    plain, dense = self._both(s, valid, frac)
    for r in range(3):
      if dense[r] == -np.inf or not valid[r].any():
        continue
      v = s[r][valid[r]].astype(np.float64)
      keep_p, keep_d = v >= plain[r], v >= dense[r]
      edge = np.abs(v - plain[r]) <= 1e-4 * (1 + np.abs(v))
      np.testing.assert_array_equal(
        keep_d[~edge], keep_p[~edge], str((s[r], valid[r]))
      )

  @parameterized.named_parameters(
    # Flat rows: the one-pass (Cauchy-Schwarz) test decides, no histogram.
    ("flat", 0.5, True),
    # Logit sd 1 (e^-1 n: too few for the one-pass test at 0.5): the first
    # histogram pass decides, the later ones are skipped.
    ("sd1", 1.0, True),
    # Peaked rows keep few keys: unchanged.
    ("peaked", 6.0, False),
  )
  def test_rows_by_spread(self, sd, all_kept):
    s = sd * rand.normal(0, (4, 1024))
    valid = np.ones(s.shape, bool)
    plain, dense = self._both(s, valid)
    if all_kept:
      np.testing.assert_array_equal(dense, -np.inf)
      self.assertTrue(np.all(plain > -np.inf))  # the plain set drops some
    else:  # (up to the rounding of a differently compiled branch)
      np.testing.assert_allclose(dense, plain, rtol=1e-6)

  def test_mixed_rows_decide_each_row(self):
    s = np.concatenate(
      [0.5 * rand.normal(0, (2, 512)), 6.0 * rand.normal(1, (2, 512))]
    )
    plain, dense = self._both(s, np.ones(s.shape, bool))
    np.testing.assert_array_equal(dense[:2], -np.inf)
    np.testing.assert_allclose(dense[2:], plain[2:], rtol=1e-6)

  def test_extra_and_empty_rows(self):
    # An extra too large for any kept set keeps all either way; an empty
    # row drops everything either way.
    s = rand.normal(2, (2, 64))
    valid = np.ones(s.shape, bool)
    valid[1] = False
    plain, dense = self._both(s, valid, log_extra=np.array([5.0, 0.0]))
    np.testing.assert_array_equal(plain, [-np.inf, np.inf])
    np.testing.assert_array_equal(dense, plain)

  def test_sharded_equals_single_device(self):
    s = np.concatenate(
      [0.5 * rand.normal(3, (2, 120)), 6.0 * rand.normal(4, (2, 120))]
    )
    valid = rand.bernoulli(5, 0.9, s.shape)
    kw = dict(relative=True, dense_above=0.5)
    one = threshold.budget_threshold(s, jnp.log(0.05), valid, **kw)
    fn = jax.vmap(
      lambda a, b: threshold.budget_threshold(
        a, jnp.log(0.05), b, axis_name="kv", **kw
      ),
      axis_name="kv",
    )
    got = fn(_split(s, 3), _split(valid, 3))
    np.testing.assert_allclose(got[0], one, rtol=1e-6)
    self.assertEqual(int(np.sum(np.isneginf(one))), 2)


class MaskIndicesTest(parameterized.TestCase):
  @parameterized.product(
    n=(1, 7, 96, 1024), size=(1, 5, 40, 1030), strided=(True, False)
  )
  def test_finds_the_true_positions(self, n, size, strided):
    rng = np.random.default_rng(n * size)
    m = rng.random((3, n)) < np.array([[0.0], [0.05], [0.7]])
    idx, ok, count = jax.jit(
      threshold.mask_indices, static_argnames=("size", "strided")
    )(m, size=size, strided=strided)
    np.testing.assert_array_equal(count, m.sum(-1))
    for r in range(3):
      ref = np.nonzero(m[r])[0]
      got = np.asarray(idx[r])[np.asarray(ok[r])]
      self.assertEqual(int(ok[r].sum()), min(size, ref.size))
      self.assertTrue(np.all(np.asarray(ok[r])[: ok[r].sum()]))
      self.assertEqual(len(set(got.tolist())), got.size)
      self.assertTrue(set(got.tolist()) <= set(ref.tolist()))
      if not strided:
        np.testing.assert_array_equal(got, ref[:size])

  def test_column_max(self):
    s = jnp.arange(12.0).reshape(1, 12)
    valid = jnp.ones((1, 12), bool).at[0, 11].set(False)
    # 4 strided columns of 3: {0, 4, 8}, {1, 5, 9}, {2, 6, 10}, {3, 7, 11}.
    np.testing.assert_array_equal(
      threshold.column_max(s, valid, group=3), [[8.0, 9.0, 10.0, 7.0]]
    )
    with self.assertRaisesRegex(ValueError, "group"):
      threshold.column_max(s, valid, group=5)


if __name__ == "__main__":
  absltest.main()
