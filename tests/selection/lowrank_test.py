"""Low-rank key bounds for Delta-Search: sound vs float64, fewer keys."""

import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import strategies as st

import jaxtopk
from jaxtopk import selection
from jaxtopk.selection import internal
from tests import rand

R, N, D, BS = 3, 13, 5, 7  # rows, keys (ragged last block), dim, block


def _logits64(q, k, scale):
  q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
  return np.einsum("...d,...nd->...n", q64, k64) * scale


def _truth(q, k, keep, mask, scale):
  """float64 tau of the kept set, per row."""
  s = np.where(mask, _logits64(q, k, scale), -np.inf)
  e = np.exp(s - s.max(-1, keepdims=True))
  return (e * ~keep).sum(-1) / e.sum(-1)


def _low_rank_keys(seed, r, n, d, rank, noise=0.01):
  """Keys on a random rank-``rank`` subspace plus a little noise."""
  rng = rand.generator(seed)
  a = rng.standard_normal((r, n, rank))
  b = rng.standard_normal((r, rank, d))
  k = 2 * np.einsum("rnj,rjd->rnd", a, b)  # [r, n, d]
  k = k + noise * rng.standard_normal((r, n, d))
  return k.astype(np.float32)


_vals = st.one_of(
  st.floats(-4, 4, width=32),
  st.sampled_from([0.0, 1.0, -1.0, 20.0, -20.0, 1e3, -1e3]),
)


def _policy(eps, rank, bs=BS):
  return jaxtopk.Certified(
    eps, jaxtopk.DeltaSearch(block_size=bs, bound=jaxtopk.LowRank(rank))
  )


class LowRankBoundTest(parameterized.TestCase):
  @given(
    q=hnp.arrays(np.float32, (D,), elements=_vals),
    k=hnp.arrays(np.float32, (N, D), elements=_vals),
    p=hnp.arrays(np.float32, (D, 3), elements=st.floats(-2, 2, width=32)),
    own=st.booleans(),
  )
  def test_per_key_bound_sound_for_any_projection(self, q, k, p, own):
    # The bound holds for ANY P (own: the keys' eigenvectors; else random).
    if own:
      p = selection.key_projection(k, np.ones(N, bool), rank=3)
    u = internal.lowrank_upper_bound(q, k, p, scale=0.7)
    s = _logits64(q, k, 0.7)
    self.assertTrue(np.all(np.asarray(u, np.float64) >= s), (u, s))

  def test_bound_tight_when_rank_spans_the_keys(self):
    rank = 2
    k = _low_rank_keys(0, 1, 11, 7, rank, noise=0.0)[0]
    q = np.asarray(rand.normal(1, (7,)))
    p = selection.key_projection(k, np.ones(11, bool), rank=rank)
    u = internal.lowrank_upper_bound(q, k, p, scale=1.0)
    s = _logits64(q, k, 1.0)
    self.assertTrue(np.all(np.asarray(u, np.float64) >= s))
    np.testing.assert_allclose(u, s, atol=1e-3 * np.abs(s).max())


class LowRankSearchTest(parameterized.TestCase):
  @given(
    q=hnp.arrays(np.float32, (R, D), elements=_vals),
    k=hnp.arrays(np.float32, (R, N, D), elements=_vals),
    mask=hnp.arrays(np.bool_, (R, N)),
    rank=st.sampled_from([1, D]),
  )
  def test_sound_vs_float64(self, q, k, mask, rank):
    eps = 0.05  # one eps and two ranks: few compilations
    sel = jaxtopk.certified_search(
      q, k, policy=_policy(eps, rank), mask=mask, values=k
    )
    cert = sel.certificate
    keep = np.asarray(sel.keep)
    with np.errstate(invalid="ignore"):  # all-masked rows: NaN, unused
      tau = _truth(q, k, keep, mask, D**-0.5)
    for r in range(R):
      if not mask[r].any():
        self.assertFalse(bool(cert.valid[r]))
        continue
      self.assertTrue(bool(cert.valid[r]))
      self.assertFalse(np.any(keep[r] & ~mask[r]))
      self.assertGreaterEqual(float(cert.tv_bound[r]), tau[r])
      self.assertLessEqual(float(cert.tv_bound[r]), eps)
      cost = -(-int(mask[r].sum()) * rank // D)  # ceil(n_real r / d)
      self.assertGreaterEqual(int(cert.keys_scored[r]), cost)
      self.assertLessEqual(int(cert.k_kept[r]), int(cert.keys_scored[r]))

  @parameterized.named_parameters(
    ("ties", "ties"),
    ("single_key", "single"),
    ("huge_range", "huge"),
    ("far_below", "far"),
    ("bf16", "bf16"),
  )
  def test_adversarial_rows(self, kind):
    n, d = 11, 7
    q = np.array(rand.normal(0, (3, d)))
    k = np.array(rand.normal(1, (3, n, d)))
    mask = np.ones((3, n), bool)
    if kind == "ties":
      k[:] = k[:, :1]  # every key the same: all logits tie
    elif kind == "single":
      mask[:, 1:] = False
    elif kind == "huge":
      k[:, 0] *= 1e4
      k[:, 1] *= -1e4
    elif kind == "far":
      q[:] = 0.0
      q[:, 0] = -20.0
      k[:] = 20.0
      k[:, 0, 0] = 0.0
    if kind == "bf16":
      q, k = jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16)
    sel = jaxtopk.certified_search(
      q, k, policy=_policy(0.05, 2, bs=3), mask=mask, values=k
    )
    cert = sel.certificate
    tau = _truth(q, k, np.asarray(sel.keep), mask, d**-0.5)
    self.assertTrue(np.all(cert.valid))
    self.assertTrue(np.all(np.asarray(cert.tv_bound, np.float64) >= tau))
    self.assertTrue(np.all(cert.tv_bound <= 0.05))
    self.assertTrue(np.all(np.isfinite(cert.output_error_bound)))

  @pytest.mark.slow
  def test_scores_fewer_keys_than_box_on_low_rank_rows(self):
    eps, bs = 0.05, 16
    # Keys on a 3-dim subspace of 13 dims: boxes are loose, rank 3 is tight.
    k = _low_rank_keys(2, 4, 512, 13, 3)
    q = np.asarray(rand.normal(3, (4, 13)))
    box = jaxtopk.Certified(eps, jaxtopk.DeltaSearch(block_size=bs))
    low = _policy(eps, 3, bs=bs)
    n_box = jaxtopk.certified_search(q, k, policy=box).certificate
    sel = jaxtopk.certified_search(q, k, policy=low)
    n_low = sel.certificate
    cost = -(-512 * 3 // 13)
    self.assertTrue(np.all(n_low.keys_scored >= cost))
    # Fewer keys on average, projection cost included (measured 0.45).
    self.assertLess(
      float(np.mean(n_low.keys_scored)), 0.6 * float(np.mean(n_box.keys_scored))
    )
    self.assertTrue(np.all(n_low.tv_bound <= eps))
    tau = _truth(q, k, np.asarray(sel.keep), np.ones((4, 512), bool), 13**-0.5)
    self.assertTrue(np.all(np.asarray(n_low.tv_bound, np.float64) >= tau))
    # A caller's useless P (zeros, shared by the rows) stays sound and
    # scores more: every bound is then scale ||q|| ||k|| (1 + gamma).
    zero = jaxtopk.certified_search(
      q, k, policy=low, projection=np.zeros((13, 3))
    )
    tau = _truth(q, k, np.asarray(zero.keep), np.ones((4, 512), bool), 13**-0.5)
    self.assertTrue(np.all(np.asarray(zero.certificate.tv_bound) >= tau))
    self.assertTrue(np.all(zero.certificate.keys_scored > n_low.keys_scored))

  @parameterized.named_parameters(
    ("bound", dict(bound="ball"), "bound"),
    ("search", dict(search="mc", bound="lowrank"), "lowrank"),
    ("rank", dict(search="delta", bound="lowrank", rank=0), "rank"),
  )
  def test_bad_policy(self, kwargs, fragment):
    with self.assertRaisesRegex(ValueError, fragment):
      jaxtopk.Certified(0.1, **kwargs)

  @parameterized.named_parameters(
    ("box_policy", jaxtopk.Certified(0.1, "delta"), (D, 2), "lowrank"),
    ("shape", _policy(0.1, 2), (D + 1, 2), "head_dim"),
    ("lead", _policy(0.1, 2), (R + 1, D, 2), "broadcast"),
  )
  def test_bad_projection(self, policy, shape, fragment):
    with self.assertRaisesRegex(ValueError, fragment):
      jaxtopk.certified_search(
        np.ones((R, D)),
        np.ones((R, N, D)),
        policy=policy,
        projection=np.ones(shape),
      )


if __name__ == "__main__":
  absltest.main()
