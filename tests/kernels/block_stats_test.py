"""Tests for the block statistics kernel and certified block selection."""

import jax.numpy as jnp
import numpy as np
import scipy.special
from absl.testing import absltest
from absl.testing import parameterized

from jaxtopk import kernels
from tests import rand
from tests.contract import reference
from tests.kernels import base

# (name, backend, dtype, causal): both grid styles, dtypes and mask kinds
# (a padding mask is always on; causal on top in one case).
_CASES = [
  ("tpu_f32_causal", "tpu", jnp.float32, True),
  ("gpu_bf16_padded", "gpu", jnp.bfloat16, False),
]


class BlockStatsTest(base.KernelTestCase):
  @parameterized.named_parameters(*_CASES)
  def test_matches_reference(self, backend, dtype, causal):
    # kv_len = 101 is not a multiple of block_k = 32 (ragged last block);
    # q_len = 37 is not a multiple of block_q = 16; GQA 6 heads / 3 kv heads;
    # a random padding mask on top.
    q, k, _, mask = self.inputs(2, 6, 3, 37, 101, 8, 5, dtype)
    st = kernels.block_stats(
      q,
      k,
      mask=mask,
      is_causal=causal,
      block_sizes=kernels.stats.BlockSizes(16, 32),
      backend=self.grid(backend),
      interpret=self.INTERPRET,
    )
    ref = kernels.block_stats_reference(
      q, k, mask=mask, is_causal=causal, block_k=32
    )
    self.assertEqual(st.lse.shape, (2, 6, 37, 4))
    np.testing.assert_array_equal(st.count, ref.count)
    base.finite_close(self, st.lse, ref.lse, atol=2e-5, rtol=2e-5)
    base.finite_close(self, st.max_logit, ref.max_logit, atol=2e-5, rtol=2e-5)
    # The block masses add up to the row's mass (the float64 reference).
    vis = np.asarray(kernels.stats.visible_mask(2, 37, 101, mask, causal))
    s = reference.logits(q, reference.repeat_kv(k, 6), 8**-0.5)
    s = np.where(vis, np.asarray(s, np.float64), -np.inf)
    row = scipy.special.logsumexp(s, axis=-1)
    got = scipy.special.logsumexp(np.asarray(st.lse, np.float64), axis=-1)
    np.testing.assert_allclose(got, row, atol=1e-5, rtol=1e-5)


class SelectBlocksTest(parameterized.TestCase):
  @parameterized.parameters(0.0, 0.01, 0.1, 0.5)
  def test_dropped_mass_within_budget_and_minimal(self, eps):
    lse = 3.0 * rand.normal(0, (2, 3, 11, 7))
    lse = lse.at[0, 0, 0, 2].set(-jnp.inf)  # an empty block
    keep = np.asarray(kernels.per_query_kept(lse, eps=eps))
    p = scipy.special.softmax(np.asarray(lse, np.float64), axis=-1)
    dropped = np.sum(np.where(keep, 0.0, p), axis=-1)
    self.assertTrue(np.all(dropped <= eps * (1 + 1e-5) + 1e-7))
    self.assertFalse(keep[0, 0, 0, 2])
    # Minimal: dropping also the smallest kept block breaks the budget.
    smallest = np.min(np.where(keep, p, np.inf), axis=-1)
    self.assertTrue(np.all(dropped + smallest > eps * (1 - 1e-5)))

  def test_tile_union_and_lists(self):
    lse = 2.0 * rand.normal(1, (1, 2, 11, 7))
    sel = kernels.select_blocks(lse, eps=0.1, block_q=4)
    self.assertEqual(sel.block_idx.shape, (1, 2, 3, 7))
    per_q = kernels.per_query_kept(lse, eps=0.1)
    per_q = jnp.pad(per_q, ((0, 0), (0, 0), (0, 1), (0, 0)))
    union = jnp.any(per_q.reshape(1, 2, 3, 4, 7), axis=3)
    np.testing.assert_array_equal(sel.kept, union)
    np.testing.assert_array_equal(sel.block_count, jnp.sum(union, -1))
    for t in range(3):
      c = int(sel.block_count[0, 1, t])
      want = np.flatnonzero(np.asarray(union[0, 1, t]))
      np.testing.assert_array_equal(sel.block_idx[0, 1, t, :c], want)
      pad = np.asarray(sel.block_idx[0, 1, t, c:])
      self.assertTrue(np.all(pad == want[-1]))

  def test_max_blocks_caps_the_list(self):
    lse = rand.normal(2, (1, 1, 5, 13))
    sel = kernels.select_blocks(lse, eps=0.0, block_q=8, max_blocks=3)
    self.assertEqual(sel.block_idx.shape[-1], 3)
    self.assertTrue(bool(jnp.all(sel.block_count == 3)))

  def test_bad_arguments(self):
    with self.assertRaisesRegex(ValueError, "eps=1.5"):
      kernels.per_query_kept(jnp.zeros((3,)), eps=1.5)
    with self.assertRaisesRegex(ValueError, "max_blocks=0"):
      kernels.select_blocks(
        jnp.zeros((1, 1, 3, 5)), eps=0.1, block_q=8, max_blocks=0
      )


class BlockStatsCompiledTest(BlockStatsTest):
  """The same tests on compiled kernels (skipped without a TPU or GPU)."""

  INTERPRET = False


if __name__ == "__main__":
  absltest.main()
