"""Certified block-sparse prefill: certificate soundness and budget."""

import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized

from jaxtopk import kernels
from tests.contract import reference
from tests.kernels import base
from tests.tolerances import tol

BQ, BK = 16, 32


def _run(test, q, k, v, mask, eps, causal=False, **kw):
  out, cert = kernels.certified_sparse_attention(
    q,
    k,
    v,
    eps=eps,
    mask=mask,
    is_causal=causal,
    block_sizes=kernels.sparse_flash.BlockSizes(BQ, BK),
    interpret=test.INTERPRET,
    **kw,
  )
  st = kernels.block_stats_reference(
    q, k, mask=mask, is_causal=causal, block_k=BK
  )
  sel = kernels.select_blocks(
    st.lse, eps=eps, block_q=BQ, max_blocks=kw.get("max_blocks")
  )
  keep = kernels.sparse_flash.kept_key_mask(
    sel.block_idx,
    sel.block_count,
    q_len=q.shape[2],
    kv_len=k.shape[2],
    block_q=BQ,
    block_k=BK,
  )
  vis = np.asarray(
    kernels.stats.visible_mask(q.shape[0], q.shape[2], k.shape[2], mask, causal)
  )
  tau, err, n_vis = reference.kept_truth(
    q, k, v, keep, vis, q.shape[-1] ** -0.5
  )
  return out, cert, tau, err, n_vis, np.asarray(keep) & vis


class PrefillCertificateTest(base.KernelTestCase):
  @parameterized.named_parameters(
    ("f32_padded", jnp.float32, False), ("bf16_causal", jnp.bfloat16, True)
  )
  def test_sound_and_within_budget(self, dtype, causal):
    q, k, v, mask = base.planted(
      1, 4, 2, 37, 201, 8, 5, dtype, block_k=BK, block_q=BQ
    )
    eps = 0.05
    out, cert, tau, err, n_vis, keep = _run(self, q, k, v, mask, eps, causal)
    self.assertEqual(cert.shape, (1, 4, 37))
    self.assertTrue(bool(jnp.all(cert.valid)))
    tv = np.asarray(cert.tv_bound, np.float64)
    self.assertTrue(np.all(tv >= tau), f"{np.min(tv - tau)=}")
    self.assertTrue(np.all(tv <= eps * 1.001), f"{tv.max()=}")
    self.assertGreater(tv.max(), 0.0)  # something really was dropped
    eb = np.asarray(cert.output_error_bound, np.float64)
    self.assertTrue(np.all(err <= eb + 1e-9), f"{np.max(err - eb)=}")
    np.testing.assert_array_equal(cert.k_kept, keep.sum(-1))
    np.testing.assert_array_equal(cert.keys_scored, n_vis + keep.sum(-1))
    if not causal:  # causal rows of 37 queries see at most 2 blocks
      self.assertLess(float(np.mean(cert.k_kept)), 0.7 * float(np.mean(n_vis)))
    # Same as the pure-jnp pipeline (reference kernels, same selection).
    ro, rc = kernels.certified_sparse_attention_reference(
      q,
      k,
      v,
      eps=eps,
      mask=mask,
      is_causal=causal,
      block_sizes=kernels.sparse_flash.BlockSizes(BQ, BK),
    )
    np.testing.assert_allclose(
      np.asarray(out, np.float32), np.asarray(ro, np.float32), **tol(dtype)
    )
    np.testing.assert_array_equal(cert.k_kept, rc.k_kept)
    np.testing.assert_array_equal(cert.keys_scored, rc.keys_scored)
    np.testing.assert_allclose(cert.tv_bound, rc.tv_bound, rtol=1e-4)
    # The output-error bound uses |out|, rounded to the input dtype.
    np.testing.assert_allclose(
      cert.output_error_bound, rc.output_error_bound, **tol(dtype)
    )

  def test_eps_zero_keeps_everything(self):
    q, k, v, mask = self.inputs(1, 3, 3, 13, 70, 8, 7, jnp.float32)
    out, cert, tau, _, n_vis, _ = _run(self, q, k, v, mask, 0.0)
    np.testing.assert_array_equal(tau, 0.0)
    np.testing.assert_array_equal(cert.tv_bound, 0.0)
    np.testing.assert_array_equal(cert.k_kept, n_vis)

  def test_max_blocks_reports_real_loss(self):
    q, k, v, mask = self.inputs(1, 2, 1, 16, 160, 8, 5, jnp.float32, seed=2)
    out, cert, tau, err, _, _ = _run(self, q, k, v, mask, 0.001, max_blocks=1)
    tv = np.asarray(cert.tv_bound, np.float64)
    self.assertTrue(np.all(tv >= tau))
    self.assertGreater(tv.max(), 0.001)  # the cap broke the budget: said so

  @pytest.mark.slow
  def test_adversarial_rows(self):
    # One batch row per case: ties, repeated keys, huge logits, a single real
    # key, and no real key at all (invalid certificate).
    q, k, v, mask = self.inputs(5, 2, 2, 11, 70, 8, 3, jnp.float32, seed=4)
    q = q.at[0].set(jnp.round(q[0]))
    k = k.at[0].set(jnp.round(k[0]))
    k = k.at[1].set(jnp.broadcast_to(k[1, :, :1], k[1].shape))
    q = q.at[2].multiply(40.0)
    mask = mask.at[3].set(False).at[3, 37].set(True)
    mask = mask.at[4].set(False)
    out, cert, tau, err, _, _ = _run(self, q, k, v, mask, 0.1)
    valid = np.asarray(cert.valid)
    self.assertTrue(np.all(valid[:4]))
    self.assertFalse(np.any(valid[4]))
    self.assertTrue(np.all(np.isnan(np.asarray(cert.tv_bound[4]))))
    tv = np.asarray(cert.tv_bound, np.float64)[:4]
    self.assertTrue(np.all(tv >= tau[:4]), f"{np.min(tv - tau[:4])=}")
    eb = np.asarray(cert.output_error_bound, np.float64)[:4]
    self.assertTrue(np.all(err[:4] <= eb + 1e-9))


class PrefillCertificateCompiledTest(PrefillCertificateTest):
  """The same tests on compiled kernels (skipped without a TPU or GPU)."""

  INTERPRET = False


if __name__ == "__main__":
  absltest.main()
