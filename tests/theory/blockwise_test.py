"""Blockwise bound with box / ball block bounds (THEORY 3.3): soundness."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import strategies as st

from jaxtopk import theory
from jaxtopk.selection import core
from tests.theory import strategies
from tests.theory import truth

N, D = strategies.N, 5
_KINDS = ("normal", "repeated", "integer", "wide")


@st.composite
def qk_rows(draw):
  """(q [D], keys [N, D] float32, valid [N], scale): adversarial keys."""
  seed = draw(st.integers(0, 2**31 - 1))
  kind = draw(st.sampled_from(_KINDS))
  mag = draw(st.sampled_from([0.1, 1.0, 30.0]))
  n_real = draw(st.integers(1, 13))
  rng = np.random.default_rng(seed)
  q = rng.normal(size=D) * mag
  k = rng.normal(size=(N, D)) * mag
  if kind == "repeated":  # runs of identical keys (ties inside blocks)
    k = np.repeat(k[: N // 4], 4, axis=0)
  elif kind == "integer":  # many exactly tied logits
    q, k = np.round(q), np.round(k)
  elif kind == "wide":  # per-key magnitudes over 4 decades
    k = k * 10.0 ** rng.integers(-2, 2, size=(N, 1))
  valid = np.zeros(N, bool)
  valid[np.sort(rng.permutation(N)[:n_real])] = True
  scale = 1 / np.sqrt(D)
  return q.astype(np.float32), k.astype(np.float32), valid, scale


def _bounds(q, k, valid, scored_blocks, topk, *, block_size):
  """The 3.3 bound for keys whose blocks are scored; rest bounded by u_b.

  Returns every variant at once (one compilation per block size): a dict
  {(which, exact): log bound}, the float32 logits and the kept set (the
  ``topk`` largest scored logits, ties by lowest index).
  """
  scale = 1 / np.sqrt(D)
  logits = jnp.einsum("d,nd->n", q, k) * scale  # [n] float32
  n_blocks = -(-N // block_size)
  blk = jnp.arange(N) // block_size
  scored = scored_blocks[blk] & valid
  order = jnp.argsort(jnp.where(scored, -logits, jnp.inf), stable=True)
  rank = jnp.zeros(N, jnp.int32).at[order].set(jnp.arange(N))
  keep = (rank < topk) & scored
  box = theory.box_summary(k, block_size=block_size, mask=valid)
  ball = theory.ball_summary(k, block_size=block_size, mask=valid)
  u_box = theory.box_upper_bound(q, box, scale=scale)
  u_ball = theory.ball_upper_bound(q, ball, scale=scale)
  us = {"box": u_box, "ball": u_ball, "min": jnp.minimum(u_box, u_ball)}
  count = jnp.where(scored_blocks[:n_blocks], 0, box.count)
  err = core.logit_error_of(q, k, valid, scale=scale)
  out = {}
  for which, u in us.items():
    for exact in (False, True):
      out[which, exact] = theory.blockwise_log_bound(
        logits,
        keep,
        scored,
        u,
        count,
        valid,
        logit_error=err if exact else None,
      )
  return out, logits, keep


_JIT = {bs: jax.jit(functools.partial(_bounds, block_size=bs)) for bs in (3, 4)}


@functools.partial(jax.jit, static_argnames=("bs",))
def _block_uppers(q, kk, valid, *, bs):
  scale = 1 / np.sqrt(D)
  box = theory.box_summary(kk, block_size=bs, mask=valid)
  ball = theory.ball_summary(kk, block_size=bs, mask=valid)
  f32 = jnp.einsum("d,nd->n", q, kk.astype(jnp.float32)) * scale
  return (
    theory.box_upper_bound(q, box, scale=scale),
    theory.ball_upper_bound(q, ball, scale=scale),
    box.count,
    f32,
  )


class SoundnessTest(parameterized.TestCase):
  @pytest.mark.slow
  @given(
    qk_rows(),
    st.lists(st.booleans(), min_size=6, max_size=6),
    st.integers(1, 5),
    st.sampled_from([3, 4]),
  )
  def test_bound_above_truth(self, row, scored_blocks, topk, bs):
    q, k, valid, scale = row
    sb = np.asarray(scored_blocks)
    got, logits, keep = _JIT[bs](q, k, valid, sb, topk)
    keep = np.asarray(keep)
    # exact: against the exact logits of the float32 q and k (with
    # logit_error); else against the logits as given (computed in float32).
    s_exact = (k.astype(np.float64) @ q.astype(np.float64)) * scale
    s_given = np.asarray(logits, np.float64)
    for (which, exact), b in got.items():
      want = truth.log_tau(s_exact if exact else s_given, keep, valid)
      self.assertLessEqual(float(b), 0.0)
      self.assertGreaterEqual(float(b), want, msg=(which, exact))

  @pytest.mark.slow
  @given(qk_rows(), st.sampled_from([3, 4]), st.sampled_from([0, 2]))
  def test_block_upper_bounds_cover_every_logit(self, row, bs, dt):
    q, k, valid, scale = row
    dtype = strategies.DTYPES[dt]  # float32 or bfloat16 keys
    kk = jnp.asarray(k, dtype)
    k64 = np.asarray(kk.astype(jnp.float32), np.float64)
    exact = (k64 @ q.astype(np.float64)) * scale
    u_box, u_ball, count, f32 = _block_uppers(q, kk, valid, bs=bs)
    for u in (u_box, u_ball):
      u = np.asarray(u, np.float64)
      for i in np.flatnonzero(valid):
        self.assertGreaterEqual(u[i // bs], exact[i])
        self.assertGreaterEqual(u[i // bs], f32[i])
      self.assertTrue(np.all(u[np.asarray(count) == 0] == -np.inf))


class BallMagnitudeTest(parameterized.TestCase):
  """Ball summaries and bounds at magnitudes where squares under/overflow."""

  def _check(self, q, k, scale):
    ball = theory.ball_summary(k, block_size=4)
    kk = truth.as64(k).reshape(-1, 4, k.shape[-1])
    cen = truth.as64(ball.centre)
    dist = np.linalg.norm(
      (kk - cen[:, None]).astype(np.longdouble), axis=-1
    ).max(-1)
    r = np.asarray(ball.radius, np.longdouble)
    self.assertTrue(np.all(r >= dist), (r, dist))
    u = np.asarray(theory.ball_upper_bound(q, ball, scale=scale))
    s = (kk.astype(np.longdouble) @ truth.as64(q).astype(np.longdouble)) * scale
    self.assertTrue(np.all(u.astype(np.longdouble) >= s.max(-1)), (u, s))
    return u, s.max(-1)

  def test_keys_whose_squares_underflow(self):
    # |k_c| = 1e-19: k_c^2 = 1e-38 reads 0 when the norm is not scaled,
    # so every radius was 0 and certified_search skipped blocks of mass.
    k = np.zeros((8, 4), np.float32)
    k[0::2, 0], k[1::2, 0] = 1e-19, -1e-19
    q = np.full(4, 0.9e19, np.float32)
    u, smax = self._check(q, k, 0.5)
    self.assertTrue(np.all(u < 1.0))  # the ball bound 0.9, not trivial

  def test_tiny_query_and_wide_ball(self):
    # ||q|| = 1.5e-38: scale ||q|| is subnormal, the ball term is ~1.9.
    k = np.zeros((4, 4), np.float32)
    k[:, 0] = [2.5e38, -2.5e38, 1e38, -1e38]
    q = np.array([1.5e-38, 0, 0, 0], np.float32)
    u, smax = self._check(q, k, 0.5)
    self.assertLess(float(u[0]), 4.0)


class BlockwiseTest(parameterized.TestCase):
  def test_all_scored_is_tight(self):
    s = strategies.normal((3, 5, 11), seed=5, scale=2.0)
    keep = theory.topk_mask(s, 4)
    nb = jnp.zeros((3, 5, 2))
    got = theory.blockwise_bound(
      s, keep, jnp.ones_like(keep), nb, nb.astype(jnp.int32)
    )
    tau = theory.tail_mass(s, keep)
    np.testing.assert_allclose(got, tau, rtol=1e-5)
    self.assertTrue(np.all(got >= tau))

  def test_ragged_last_block_counts(self):
    k = strategies.normal((11, 3), seed=6)
    box = theory.box_summary(k, block_size=4)
    ball = theory.ball_summary(k, block_size=4)
    np.testing.assert_array_equal(box.count, [4, 4, 3])
    np.testing.assert_array_equal(ball.count, [4, 4, 3])
    np.testing.assert_allclose(box.kmax[2], np.max(np.asarray(k)[8:], 0))

  def test_nothing_kept_and_nan(self):
    s = jnp.array([1.0, 2.0, 3.0])
    f = jnp.zeros(3, bool)
    u = jnp.array([5.0])
    c = jnp.array([2])
    self.assertEqual(float(theory.blockwise_bound(s, f, ~f, u, c)), 1.0)
    s_nan = s.at[1].set(jnp.nan)
    self.assertTrue(np.isnan(theory.blockwise_bound(s_nan, ~f, ~f, u, c)))

  def test_bad_input(self):
    with self.assertRaisesRegex(ValueError, "block_size=0"):
      theory.box_summary(jnp.zeros((5, 3)), block_size=0)
    with self.assertRaisesRegex(ValueError, "block_count"):
      theory.blockwise_bound(
        jnp.zeros(5),
        jnp.ones(5, bool),
        jnp.ones(5, bool),
        jnp.zeros(2),
        jnp.zeros(3, jnp.int32),
      )
    with self.assertRaisesRegex(ValueError, "scored"):
      theory.blockwise_bound(
        jnp.zeros(5),
        jnp.ones(5, bool),
        jnp.ones(4, bool),
        jnp.zeros(2),
        jnp.zeros(2, jnp.int32),
      )


if __name__ == "__main__":
  absltest.main()
