"""The blockwise XLA prefill (attention._prefill): soundness across tiles.

Small tiles (``BlockSizes(block_q=2, max_bands=2, first_round=1)``) and key
blocks of 3 so that every path of the engine runs on tiny inputs: several
query tiles, causal bands, Delta-Search rounds that stop early, unscored
blocks merged into the tail, GQA, masks and -inf bias.
"""

import os

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import jaxtopk
from jaxtopk.attention import _prefill
from jaxtopk.attention import _topk
from tests import rand

# CI draws 20 examples (compile-bound); HYPOTHESIS_PROFILE=soak draws 500.
_CI_EXAMPLES = (
  settings.default.max_examples
  if os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci"
  else 20
)

# 7 rows: four tiles of 2, so two causal bands (a band holds >= 2 tiles).
T, S, H, HKV, D = 7, 13, 2, 1, 3  # query rows, keys, heads, kv heads, dim
# Flat search tiles score every key at once (``scan_all_share``: also on
# these few blocks); ROUNDS: the block search's rounds even there.
SMALL = _prefill.BlockSizes(
  block_q=2, max_bands=2, first_round=1, scan_all_share=0.75
)
ROUNDS = _prefill.BlockSizes(
  block_q=2, max_bands=2, first_round=1, scan_all_share=2.0
)

# Magnitudes from subnormal to near overflow (XLA CPU flushes subnormals).
_vals = st.one_of(
  st.floats(-4, 4, width=32),
  st.sampled_from(
    [0.0, 1.0, -1.0, 30.0, -30.0, 1e3, 1e-38, -3e-39, 1e-20, 1e19, 3e37]
  ),
)

# (Dense and fixed counts share the scan-all engine of Certified(0.05).)
# Policy and tiling.
POLICIES = (
  (jaxtopk.Certified(0.05), SMALL),
  (jaxtopk.Certified(0.2, jaxtopk.DeltaSearch(block_size=3)), SMALL),
  (
    jaxtopk.Certified(0.05, jaxtopk.DeltaSearch(block_size=3), max_topk=3),
    ROUNDS,
  ),
  (jaxtopk.Certified(0.1, dense_above=0.5), SMALL),
)


def _truth(q, k, v, real, bias):
  """float64 logits ``[H, T, S]`` (-inf off ``real``) and values."""
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
  g = H // HKV
  k64, v64 = np.repeat(k64, g, 2), np.repeat(v64, g, 2)
  s = np.einsum("bthd,bshd->bhts", q64, k64)[0] / np.sqrt(D)
  if bias is not None:
    s = s + np.asarray(bias, np.float64)[0]
  return np.where(real, s, -np.inf), v64[0]


class BlockwiseSoundnessTest(parameterized.TestCase):
  @settings(max_examples=_CI_EXAMPLES)
  @given(
    q=hnp.arrays(np.float32, (1, T, H, D), elements=_vals),
    k=hnp.arrays(np.float32, (1, S, HKV, D), elements=_vals),
    mask=hnp.arrays(np.bool_, (1, 1, T, S)),
    ninf=hnp.arrays(np.bool_, (1, 1, T, S)),
    which=st.integers(0, len(POLICIES) - 1),
    causal=st.booleans(),
    half=st.sampled_from([None, jnp.bfloat16]),
  )
  @pytest.mark.slow
  def test_sound_vs_float64(self, q, k, mask, ninf, which, causal, half):
    # One compile per (policy, causal, dtype): 4 x 2 x 2 = 16 in all.
    policy, tiling = POLICIES[which]
    if half is not None:
      q, k = (np.asarray(jnp.asarray(x, half)) for x in (q, k))
    q, k = jnp.asarray(q), jnp.asarray(k)
    v = jnp.flip(k, -1) * 0.5 + 1.0
    bias = np.where(ninf, -np.inf, 0.5).astype(np.float32)
    out, cert, keep = _topk.xla_topk_attention_with_keep(
      q,
      k,
      v,
      policy=policy,
      mask=mask,
      bias=bias,
      is_causal=causal,
      block_sizes=tiling,
    )
    real = np.broadcast_to(mask[0], (H, T, S))
    if causal:
      real = real & np.tril(np.ones((T, S), bool))
    s, v64 = _truth(q, k, v, real, bias)
    for h in range(H):
      for t in range(T):
        c = jax.tree.map(lambda x, t=t, h=h: x[0, t, h], cert)
        row = s[h, t]
        if not np.any(row > -np.inf) or not np.all(np.isfinite(v64)):
          self.assertFalse(bool(c.valid))
          continue
        if not bool(c.valid):
          continue  # an invalid row promises nothing (advcheck counts them)
        kp = np.asarray(keep[0, h, t])
        self.assertFalse(np.any(kp & ~(row > -np.inf)), "kept a dead key")
        e = np.exp(row - row.max())
        tau = e[~kp].sum() / e.sum()
        self.assertGreaterEqual(float(c.tv_bound), tau, (h, t, policy))
        attn = e @ v64[:, h] / e.sum()
        attn_k = (e * kp) @ v64[:, h] / (e * kp).sum()
        err = np.linalg.norm(attn - attn_k)
        self.assertGreaterEqual(float(c.output_error_bound), err)
        moderate = max(np.abs(q).max(), np.abs(k).max()) <= 1e3
        if policy.max_topk is None and moderate:
          # (Huge inputs get a rounding bound that certifies nothing: a
          # trivial but sound tv_bound up to 1.)
          self.assertLessEqual(float(c.tv_bound), policy.eps)


class BlockwiseBehaviourTest(parameterized.TestCase):
  def test_causal_bands_hold_at_least_two_tiles(self):
    for nt in range(1, 40):
      for most in (1, 2, 3, 8):
        bands = _prefill._bands(nt, most)
        self.assertLessEqual(len(bands), most, (nt, most))
        self.assertEqual(bands[0][0], 0)
        self.assertEqual(bands[-1][1], nt)
        for (_, a1), (b0, _) in zip(bands[:-1], bands[1:], strict=True):
          self.assertEqual(a1, b0)  # consecutive, no gap
        sizes = [i1 - i0 for i0, i1 in bands]
        self.assertGreaterEqual(min(sizes), min(2, nt), (nt, most, bands))
    self.assertEqual(_prefill._bands(4, 8), [(0, 2), (2, 4)])

  @pytest.mark.slow
  def test_tiles_agree_with_one_tile(self):
    # Tiling and bands change nothing for fixed-count policies.
    ks = jax.random.split(jax.random.key(0), 3)
    q = rand.normal(ks[0], (2, 7, 4, 5))
    k = rand.normal(ks[1], (2, 11, 2, 5))
    v = rand.normal(ks[2], (2, 11, 2, 6))
    for policy in (jaxtopk.Dense(), jaxtopk.FixedK(3), jaxtopk.Certified(0.1)):
      outs = [
        _topk.xla_topk_attention_with_keep(
          q, k, v, policy=policy, is_causal=True, block_sizes=b
        )
        for b in (SMALL, _prefill.BlockSizes(block_q=64))
      ]
      np.testing.assert_array_equal(outs[0][2], outs[1][2])
      np.testing.assert_allclose(outs[0][0], outs[1][0], atol=1e-6)

  def test_kept_set_with_empty_round_slots(self):
    # Soak regression: a round slot with no block left repeated a scored
    # block index and erased its kept keys from the returned kept set.
    q = jnp.zeros((1, T, H, D))
    k = jnp.zeros((1, S, HKV, D))
    mask = np.zeros((1, 1, T, S), bool)
    mask[0, 0, 4, [0, 3, 6]] = True
    policy = jaxtopk.Certified(0.2, jaxtopk.DeltaSearch(block_size=3))
    _, cert, keep = _topk.xla_topk_attention_with_keep(
      q, k, k, policy=policy, mask=mask, block_sizes=SMALL
    )
    np.testing.assert_array_equal(np.nonzero(keep[0, 0, 4])[0], [0, 3, 6])
    self.assertEqual(int(cert.k_kept[0, 4, 0]), 3)

  def test_flat_tiles_need_at_most_what_a_search_scores(self):
    # _flat's count is a lower bound on the blocks a tile's search scores:
    # for one row, the fewest blocks whose bounds add up to (1 - eps) of
    # all (its greedy set); for a tile, at most the union of its rows'
    # greedy sets (one set that certifies every row).
    rng = np.random.default_rng(0)
    eps = 0.05
    for rows in (1, 5):
      for spread in (0.1, 1.0, 3.0, 10.0):
        log_mass = spread * rng.normal(size=(2, 3, 2, rows, 40))
        log_mass[0, 0, 0, 0, 7] = -np.inf  # a block the row does not see
        u = np.exp(log_mass - log_mass.max(-1, keepdims=True))
        order = np.argsort(-u, -1)
        c = np.cumsum(np.take_along_axis(u, order, -1), -1)
        fewest = np.sum(c < (1 - eps) * c[..., -1:], -1) + 1
        greedy = np.arange(40) < fewest[..., None]  # in sorted order
        chosen = np.zeros_like(greedy)
        np.put_along_axis(chosen, order, greedy, -1)
        union = np.sum(np.any(chosen, (2, 3)), -1)  # [2, 3]
        most = float(union.max())
        lm = jnp.asarray(log_mass, jnp.float32)
        self.assertFalse(bool(_prefill._flat(lm, eps, most + 1)), spread)
        self.assertTrue(bool(_prefill._flat(lm, eps, 1.0)), spread)
    flat = jnp.zeros((1, 2, 2, 4, 40))  # equal bounds: 38 of 40 needed
    self.assertTrue(bool(_prefill._flat(flat, eps, 0.9 * 40)))
    # Rows that each need their own block: the union counts.
    own = np.full((1, 1, 1, 32, 40), -30.0)
    own[0, 0, 0, np.arange(32), np.arange(32)] = 0.0
    self.assertTrue(bool(_prefill._flat(jnp.asarray(own), eps, 32)))
    self.assertFalse(bool(_prefill._flat(jnp.asarray(own), eps, 33)))

  def test_delta_search_skips_blocks_of_a_peaked_row(self):
    # Keys in 16 topic blocks of 4; every query seeks topic 1: Delta-Search
    # (first round: 4 blocks) scores a quarter of the keys the row sees,
    # and the bound still holds.
    rng = np.random.default_rng(0)
    c = rng.normal(size=(16, 16))
    c /= np.linalg.norm(c, axis=-1, keepdims=True)
    k = 8.0 * np.repeat(c, 4, 0)[None, :, None] + 0.01 * rng.normal(
      size=(1, 64, 1, 16)
    )
    q = 8.0 * np.broadcast_to(c[1], (1, 6, 1, 16))
    policy = jaxtopk.Certified(0.05, jaxtopk.DeltaSearch(block_size=4))
    out, cert = jaxtopk.topk_attention(
      jnp.asarray(q, jnp.float32),
      jnp.asarray(k, jnp.float32),
      jnp.asarray(k, jnp.float32),
      policy=policy,
    )
    self.assertTrue(bool(jnp.all(cert.valid)))
    # At most 16 of the 64 keys scored, plus the boxes of the 16 blocks
    # read to bound them (2 key-equivalents each, THEORY 6.4).
    self.assertLessEqual(float(jnp.max(cert.keys_scored)), 16 + 2 * 16)
    self.assertLessEqual(float(jnp.max(cert.tv_bound)), 0.05)

  @parameterized.parameters("exact", "delta")
  @pytest.mark.slow
  def test_compiled_memory_grows_linearly(self, search):
    # Never [q_len, kv_len] for the whole call: doubling T must
    # not quadruple XLA's temporary buffers.
    policy = jaxtopk.Certified(0.05, search=search)

    def temp(t):
      x = jax.ShapeDtypeStruct((1, t, 1, 16), jnp.float32)
      f = jax.jit(
        lambda q, k, v: jaxtopk.topk_attention(
          q, k, v, policy=policy, is_causal=True
        )
      )
      return f.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes

    small, large = temp(2048), temp(4096)
    # 4x if it were [T, T]; linear growth measures 2.0-2.54x between 1K
    # and 8K (the causal bands group the tiles differently per size).
    self.assertLess(large, 3 * small)
    self.assertLess(large, 4096 * 4096 * 4)  # below one [T, T] float32


if __name__ == "__main__":
  absltest.main()
