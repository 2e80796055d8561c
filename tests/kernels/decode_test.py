"""Tests for the certified split-K decode kernel (Delta-Search)."""

import hypothesis
import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import strategies as st

from jaxtopk import kernels
from tests import tolerances
from tests.contract import reference
from tests.kernels import base

BK, SPLITS = 16, 3
SIZES = kernels.decode.BlockSizes(BK, SPLITS)


def _oracle(q, k, v, scored, mask):
  """Exact tau / output error of keeping the scored blocks, float64."""
  n = k.shape[2]
  keep = np.repeat(np.asarray(scored), BK, axis=-1)[..., :n]
  vis = np.ones((q.shape[0], 1, 1, n), bool)
  if mask is not None:
    vis = np.asarray(mask)[:, None, None, :]
  tau, err, n_vis = reference.kept_truth(
    q[:, :, None], k, v, keep[:, :, None], vis, q.shape[-1] ** -0.5
  )
  return tau[:, :, 0], err[:, :, 0], n_vis[:, :, 0], keep & vis[:, :, 0]


class DecodeTest(base.KernelTestCase):
  def _decode(self, q, k, v, mask, eps, backend=None):
    return kernels.certified_decode(
      q,
      k,
      v,
      eps=eps,
      mask=mask,
      block_sizes=SIZES,
      backend=None if backend is None else self.grid(backend),
      interpret=self.INTERPRET,
    )

  @parameterized.named_parameters(
    ("tpu_f32", "tpu", jnp.float32),
    ("gpu_bf16", "gpu", jnp.bfloat16),
  )
  def test_matches_reference_and_certifies(self, backend, dtype):
    # GQA 6 heads / 3 kv heads; kv_len 301 is not a multiple of BK = 16;
    # random padding mask; 19 blocks dealt to 3 splits (ragged too).
    q, k, v, mask = base.planted(
      2, 6, 3, 1, 301, 8, 5, dtype, block_k=BK, block_q=1
    )
    q = q[:, :, 0]
    eps = 0.05
    out, cert = self._decode(q, k, v, mask, eps, backend)
    ro, rlse, scored = kernels.certified_decode_reference(
      q, k, v, eps=eps, mask=mask, block_sizes=SIZES
    )
    self.assertEqual(out.shape, (2, 6, 5))
    self.assertEqual(out.dtype, dtype)
    self.assertEqual(cert.shape, (2, 6))
    np.testing.assert_allclose(
      np.asarray(out, np.float32),
      np.asarray(ro, np.float32),
      **tolerances.tol(dtype),
    )
    tau, err, n_vis, keep = _oracle(q, k, v, scored, mask)
    np.testing.assert_array_equal(cert.k_kept, keep.sum(-1))
    np.testing.assert_array_equal(cert.keys_scored, cert.k_kept)
    tv = np.asarray(cert.tv_bound, np.float64)
    self.assertTrue(np.all(tv >= tau), f"{np.min(tv - tau)=}")
    self.assertTrue(np.all(tv <= eps), f"{tv.max()=}")
    eb = np.asarray(cert.output_error_bound, np.float64)
    self.assertTrue(np.all(err <= eb + 1e-9))
    # Delta-Search stopped early: fewer keys scored than the cache holds.
    self.assertLess(float(np.mean(cert.keys_scored)), 0.6 * np.mean(n_vis))

  @parameterized.parameters("tpu", "gpu")
  def test_splits_without_a_heavy_block_stop_on_the_floor(self, backend):
    # One heavy block among 24 (3 splits of 8): the other splits compare
    # their bounds with a share of its mass and score nothing; each
    # comparing with its own scored mass alone scored at least a block.
    rng = np.random.default_rng(0)
    n, d = 24 * BK, 8
    k = 0.05 * rng.standard_normal((1, 1, n, d))
    qdir = rng.standard_normal(d)
    qdir /= np.linalg.norm(qdir)
    k[0, 0, 5 * BK : 6 * BK] = 4.0 * qdir + 0.05 * rng.standard_normal((BK, d))
    v = rng.standard_normal((1, 1, n, 3))
    q = (10.0 * qdir)[None, None]  # heavy logits ~14, light ones ~0
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    eps = 0.01
    out, cert = self._decode(q, k, v, None, eps, backend)
    _, _, scored = kernels.certified_decode_reference(
      q, k, v, eps=eps, block_sizes=SIZES
    )
    np.testing.assert_array_equal(cert.k_kept, [[BK]])
    np.testing.assert_array_equal(np.flatnonzero(scored[0, 0]), [5])
    tau, err, _, _ = _oracle(q, k, v, scored, None)
    self.assertGreaterEqual(float(cert.tv_bound[0, 0]), float(tau[0, 0]))
    self.assertLessEqual(float(cert.tv_bound[0, 0]), eps)
    self.assertLessEqual(float(err[0, 0]), float(cert.output_error_bound[0, 0]))

  def test_eps_zero_scores_everything(self):
    q, k, v, mask = self.inputs(1, 2, 2, 1, 90, 8, 7, jnp.float32)
    q = q[:, :, 0]
    out, cert = self._decode(q, k, v, mask, 0.0)
    np.testing.assert_array_equal(cert.tv_bound, 0.0)
    np.testing.assert_array_equal(cert.k_kept, [[np.sum(mask)] * 2])
    truth = reference.Truth(
      q[:, :, None],
      reference.repeat_kv(k, 2),
      reference.repeat_kv(v, 2),
      scale=8**-0.5,
      mask=np.asarray(mask)[:, None, None, :],
    )
    dense = np.asarray(truth.attn[:, :, 0], np.float64)
    np.testing.assert_allclose(out, dense, **tolerances.tol(jnp.float32))

  @pytest.mark.slow
  def test_adversarial_rows(self):
    # One batch row per case: ties, repeated keys, huge logits, a single real
    # key, and no real key at all (invalid certificate).
    q, k, v, mask = self.inputs(5, 2, 1, 1, 70, 8, 3, jnp.float32, seed=4)
    q = q[:, :, 0]
    q = q.at[0].set(jnp.round(q[0]))
    k = k.at[0].set(jnp.round(k[0]))
    k = k.at[1].set(jnp.broadcast_to(k[1, :, :1], k[1].shape))
    q = q.at[2].multiply(40.0)
    mask = mask.at[3].set(False).at[3, 37].set(True)
    mask = mask.at[4].set(False)
    out, cert = self._decode(q, k, v, mask, 0.1)
    _, _, scored = kernels.certified_decode_reference(
      q, k, v, eps=0.1, mask=mask, block_sizes=SIZES
    )
    tau, err, _, _ = _oracle(q, k, v, scored, mask)
    valid = np.asarray(cert.valid)
    np.testing.assert_array_equal(valid, [[1, 1]] * 4 + [[0, 0]])
    tv = np.asarray(cert.tv_bound, np.float64)
    self.assertTrue(np.all(tv[:4] >= tau[:4]), f"{tv - tau=}")
    self.assertTrue(np.all(np.isnan(tv[4])))
    eb = np.asarray(cert.output_error_bound, np.float64)[:4]
    self.assertTrue(np.all(err[:4] <= eb + 1e-9))
    np.testing.assert_array_equal(cert.k_kept[3], 1)

  @hypothesis.given(
    q=hnp.arrays(np.float32, (1, 2, 3), elements=st.floats(-8, 8, width=32)),
    k=hnp.arrays(
      np.float32, (1, 1, 50, 3), elements=st.floats(-4, 4, width=32)
    ),
    mask=hnp.arrays(np.bool_, (1, 50)),
    eps=st.sampled_from([0.01, 0.3]),
  )
  def test_property_sound_against_float64(self, q, k, mask, eps):
    mask[0, 0] = True
    v = np.linspace(-1, 1, 50 * 2, dtype=np.float32).reshape(1, 1, 50, 2)
    _, cert = self._decode(q, k, v, mask, eps)
    _, _, scored = kernels.certified_decode_reference(
      q, k, v, eps=eps, mask=mask, block_sizes=SIZES
    )
    tau, _, _, _ = _oracle(q, k, v, scored, mask)
    tv = np.asarray(cert.tv_bound, np.float64)
    self.assertTrue(np.all(tv >= tau), f"{tv=} {tau=}")

  def test_bad_arguments(self):
    q, k, v, _ = self.inputs(1, 2, 2, 1, 40, 8, 3, jnp.float32)
    with self.assertRaisesRegex(ValueError, "eps=1.0"):
      self._decode(q[:, :, 0], k, v, None, 1.0)
    with self.assertRaisesRegex(ValueError, "query must be"):
      self._decode(q, k, v, None, 0.1)


class DecodeCompiledTest(DecodeTest):
  """The same tests on compiled kernels (skipped without a TPU or GPU)."""

  INTERPRET = False


if __name__ == "__main__":
  absltest.main()
