"""Tests for the sparse flash-attention kernel (outputs, lse, gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized

from jaxtopk import kernels
from tests import rand
from tests import tolerances
from tests.contract import reference
from tests.kernels import base

BQ, BK = 16, 32
_CASES = [
  ("tpu_f32_causal", "tpu", jnp.float32, True),
  ("tpu_bf16_padded", "tpu", jnp.bfloat16, False),
  ("gpu_f32_padded", "gpu", jnp.float32, False),
  ("gpu_bf16_causal", "gpu", jnp.bfloat16, True),
]


def _selection(q, k, mask, causal, eps):
  st = kernels.block_stats_reference(
    q, k, mask=mask, is_causal=causal, block_k=BK
  )
  return kernels.select_blocks(st.lse, eps=eps, block_q=BQ)


def _call(fn, q, k, v, sel, mask, causal, **kw):
  return fn(
    q, k, v, sel.block_idx, sel.block_count, mask=mask, is_causal=causal, **kw
  )


class SparseFlashTest(base.KernelTestCase):
  @parameterized.named_parameters(*_CASES)
  def test_matches_reference(self, backend, dtype, causal):
    q, k, v, mask = base.planted(
      2, 6, 3, 37, 101, 8, 5, dtype, block_k=BK, block_q=BQ
    )
    sel = _selection(q, k, mask, causal, eps=0.05)
    self.assertLess(float(jnp.mean(sel.block_count)), 3.0)  # really sparse
    o, lse = _call(
      kernels.sparse_flash_attention,
      q,
      k,
      v,
      sel,
      mask,
      causal,
      block_sizes=kernels.sparse_flash.BlockSizes(BQ, BK),
      backend=self.grid(backend),
      interpret=self.INTERPRET,
    )
    ro, rl = _call(
      kernels.sparse_flash_attention_reference,
      q,
      k,
      v,
      sel,
      mask,
      causal,
      block_q=BQ,
      block_k=BK,
    )
    self.assertEqual(o.shape, (2, 6, 37, 5))
    self.assertEqual(o.dtype, dtype)
    np.testing.assert_allclose(
      np.asarray(o, np.float32),
      np.asarray(ro, np.float32),
      **tolerances.tol(dtype),
    )
    base.finite_close(self, lse, rl, atol=2e-5, rtol=2e-5)

  def test_all_blocks_kept_is_dense_attention(self):
    q, k, v, mask = self.inputs(1, 4, 2, 21, 75, 8, 7, jnp.float32, seed=3)
    sel = _selection(q, k, mask, False, eps=0.0)
    o, lse = _call(
      kernels.sparse_flash_attention,
      q,
      k,
      v,
      sel,
      mask,
      False,
      block_sizes=kernels.sparse_flash.BlockSizes(BQ, BK),
      interpret=self.INTERPRET,
    )
    # Dense softmax attention, the float64 reference (GQA: 2 heads per kv).
    truth = reference.Truth(
      q,
      reference.repeat_kv(k, 4),
      reference.repeat_kv(v, 4),
      scale=8**-0.5,
      mask=np.asarray(mask)[:, None, None, :],
    )
    dense = np.asarray(truth.attn, np.float64)
    np.testing.assert_allclose(o, dense, **tolerances.tol(jnp.float32))
    self.assertTrue(bool(jnp.all(jnp.isfinite(lse))))

  @pytest.mark.slow
  def test_gradients_match_reference(self, backend="gpu"):
    # One grid style: the backward pass is the same XLA code for both.
    q, k, v, mask = base.planted(
      1, 4, 2, 19, 70, 8, 5, jnp.float32, block_k=BK, block_q=BQ, seed=5
    )
    sel = _selection(q, k, mask, True, eps=0.1)
    ct = rand.normal(7, (1, 4, 19, 5))

    def loss(fn, q, k, v, **kw):
      o, lse = _call(fn, q, k, v, sel, mask, True, **kw)
      return jnp.sum(o * ct) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    got = jax.grad(
      lambda *a: loss(
        kernels.sparse_flash_attention,
        *a,
        block_sizes=kernels.sparse_flash.BlockSizes(BQ, BK),
        backend=self.grid(backend),
        interpret=self.INTERPRET,
      ),
      argnums=(0, 1, 2),
    )(q, k, v)
    want = jax.grad(
      lambda *a: loss(
        kernels.sparse_flash_attention_reference, *a, block_q=BQ, block_k=BK
      ),
      argnums=(0, 1, 2),
    )(q, k, v)
    for g, w in zip(got, want, strict=True):
      np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
    # Keys in no kept block get exactly zero gradient.
    kept = kernels.sparse_flash.kept_key_mask(
      sel.block_idx,
      sel.block_count,
      q_len=19,
      kv_len=70,
      block_q=BQ,
      block_k=BK,
    )
    used = jnp.any(kept, axis=2).reshape(1, 2, 2, 70).any(axis=2)
    self.assertFalse(bool(jnp.all(used)))
    np.testing.assert_array_equal(jnp.where(used[..., None], 0.0, got[1]), 0.0)

  def test_bad_block_idx_shape(self):
    q, k, v, _ = self.inputs(1, 2, 2, 16, 64, 8, 8, jnp.float32)
    with self.assertRaisesRegex(ValueError, "block_idx.shape"):
      kernels.sparse_flash_attention(
        q,
        k,
        v,
        jnp.zeros((1, 2, 5, 2), jnp.int32),
        jnp.zeros((1, 2, 5), jnp.int32),
        block_sizes=kernels.sparse_flash.BlockSizes(BQ, BK),
        interpret=True,
      )


class GatheredAttentionTest(parameterized.TestCase):
  """The backward's XLA function (no Pallas): same as the reference."""

  @parameterized.named_parameters(("causal", True), ("padded", False))
  def test_matches_reference_and_gradient(self, causal):
    # GQA 6 / 3 heads, q_len 37 and kv_len 101 ragged in 16 / 32 tiles.
    q, k, v, mask = base.planted(
      2, 6, 3, 37, 101, 8, 5, jnp.float32, block_k=BK, block_q=BQ
    )
    # A dropped key with a huge logit (chosen without it, then planted): its
    # gradient must stay 0, not NaN from an overflowing exp.
    mask = mask.at[0, 100].set(True)
    sel = _selection(q, k, mask, causal, eps=0.05)
    k = k.at[0, 0, 100].set(50.0 * q[0, 0, 0])
    dropped = ~jnp.any(sel.kept[0, 0, :, 3])  # block 3 holds key 100
    self.assertTrue(bool(dropped) or causal)  # causal: no tile sees it
    kw = dict(mask=mask, is_causal=causal, block_q=BQ, block_k=BK)
    sc = dict(scale=8**-0.5)
    ct = rand.normal(2, (2, 6, 37, 5))

    def loss(fn, q, k, v, **extra):
      o, lse = fn(q, k, v, sel.block_idx, sel.block_count, **kw, **extra)
      return jnp.sum(o * ct) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    got = kernels.sparse_flash.gathered_attention(
      q, k, v, sel.block_idx, sel.block_count, **sc, **kw
    )
    want = kernels.sparse_flash_attention_reference(
      q, k, v, sel.block_idx, sel.block_count, **kw
    )
    for a, b in zip(got, want, strict=True):
      base.finite_close(self, a, b, **tolerances.tol(jnp.float32))
    args = (0, 1, 2)
    g_got = jax.grad(
      lambda *a: loss(kernels.sparse_flash.gathered_attention, *a, **sc),
      argnums=args,
    )(q, k, v)
    g_want = jax.grad(
      lambda *a: loss(kernels.sparse_flash_attention_reference, *a),
      argnums=args,
    )(q, k, v)
    for a, b in zip(g_got, g_want, strict=True):
      self.assertTrue(bool(jnp.all(jnp.isfinite(a))))
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


class SparseFlashCompiledTest(SparseFlashTest):
  """The same tests on compiled kernels (skipped without a TPU or GPU)."""

  INTERPRET = False


if __name__ == "__main__":
  absltest.main()
