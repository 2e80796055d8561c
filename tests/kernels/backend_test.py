"""implementation='pallas' of topk_attention / decode_attention vs 'xla'."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized

import jaxtopk
from tests import rand
from tests.contract import reference
from tests.kernels import base


def _same_certificate(test, a, b):
  """Same kept sets and bounds; output_error_bound from each path's own
  logit rounding bound (both tiny for Dense: every key is kept)."""
  for name in ("tv_bound", "log_tv_bound", "k_kept", "keys_scored", "valid"):
    np.testing.assert_array_equal(
      getattr(a, name), getattr(b, name), err_msg=name
    )
  for c in (a, b):
    test.assertLess(float(jnp.max(c.output_error_bound)), 1e-3)


def _dense_np(q, k, v, vis):
  """float64 dense attention (the reference), jax.nn layout [b, t, h, d]."""
  qh, kh, vh = reference.head_major(q, k, v)
  truth = reference.Truth(qh, kh, vh, scale=q.shape[-1] ** -0.5, mask=vis)
  return np.swapaxes(np.asarray(truth.attn, np.float64), 1, 2)


class PallasTopkAttentionTest(base.KernelTestCase):
  def _inputs(self):
    q, k, v, mask = base.planted(
      2, 4, 2, 21, 101, 8, 8, jnp.float32, block_k=32, block_q=16
    )
    sw = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    return sw(q), sw(k), sw(v), mask[:, None, None, :]

  @parameterized.named_parameters(("causal", True), ("padded", False))
  def test_dense_policy_same_as_xla(self, causal):
    q, k, v, mask = self._inputs()
    kw = dict(policy=jaxtopk.Dense(), mask=mask, is_causal=causal)
    ox, cx = jaxtopk.topk_attention(q, k, v, **kw)
    op, cp = jaxtopk.topk_attention(q, k, v, implementation="pallas", **kw)
    np.testing.assert_allclose(op, ox, atol=1e-5, rtol=1e-5)
    _same_certificate(self, cp, cx)

  def test_dense_gradients_same_as_xla(self):
    q, k, v, mask = self._inputs()
    ct = rand.normal(3, (2, 21, 4, 8))

    def loss(impl, q, k, v):
      out, _ = jaxtopk.topk_attention(
        q, k, v, policy=jaxtopk.Dense(), mask=mask, implementation=impl
      )
      return jnp.sum(out * ct)

    gx = jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2))(q, k, v)
    gp = jax.grad(lambda *a: loss("pallas", *a), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(gp, gx, strict=True):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)

  def test_certified_policy_agrees_with_xla_within_bounds(self):
    q, k, v, mask = self._inputs()
    eps = 0.05
    kw = dict(
      policy=jaxtopk.Certified(eps, jaxtopk.Auto(block_size=32)), mask=mask
    )
    ox, cx = jaxtopk.topk_attention(q, k, v, **kw)
    op, cp = jaxtopk.topk_attention(q, k, v, implementation="pallas", **kw)
    self.assertEqual(cp.shape, cx.shape)
    self.assertTrue(bool(jnp.all(cp.valid == cx.valid)))
    self.assertTrue(bool(jnp.all(cp.tv_bound <= eps * 1.001)))
    self.assertTrue(bool(jnp.all(cx.tv_bound <= eps * 1.001)))
    dense = _dense_np(q, k, v, np.asarray(mask))
    for o, c in ((op, cp), (ox, cx)):
      err = np.linalg.norm(np.asarray(o, np.float64) - dense, axis=-1)
      bound = np.asarray(c.output_error_bound, np.float64)
      self.assertTrue(np.all(err <= bound + 1e-5), f"{np.max(err - bound)=}")
    # Same results either way, up to what each certifies.
    gap = np.linalg.norm(np.asarray(op - ox, np.float64), axis=-1)
    both = np.asarray(cp.output_error_bound + cx.output_error_bound)
    self.assertTrue(np.all(gap <= both + 1e-5))
    # The kernel path really skipped blocks.
    n_real = jnp.sum(mask, axis=-1)[:, :, :1]  # [b, 1, 1] real keys per row
    self.assertLess(float(jnp.mean(cp.k_kept / n_real)), 0.85)

  def test_unsupported_raise(self):
    q, k, v, mask = self._inputs()
    with self.assertRaisesRegex(NotImplementedError, "FixedK"):
      jaxtopk.topk_attention(
        q, k, v, policy=jaxtopk.FixedK(3), implementation="pallas"
      )
    with self.assertRaisesRegex(NotImplementedError, "bias"):
      jaxtopk.topk_attention(
        q,
        k,
        v,
        policy=jaxtopk.Dense(),
        bias=jnp.zeros((1, 1, 21, 101)),
        implementation="pallas",
      )
    with self.assertRaisesRegex(NotImplementedError, "key-padding"):
      jaxtopk.topk_attention(
        q,
        k,
        v,
        policy=jaxtopk.Dense(),
        mask=jnp.ones((2, 1, 21, 101), bool),
        implementation="pallas",
      )
    for name, value in (
      ("query_seq_lengths", jnp.array([3, 21])),
      ("local_window_size", (2, 2)),
      ("return_residual", True),
    ):
      with self.assertRaisesRegex(NotImplementedError, name):
        jaxtopk.topk_attention(
          q,
          k,
          v,
          policy=jaxtopk.Dense(),
          implementation="pallas",
          **{name: value},
        )

  def test_gpu_refuses_block_sizes_triton_cannot_tile(self):
    # Compiled on a GPU, key blocks are Triton arrays: powers of 2 >= 16.
    # The op refuses other Certified.block_size values, so that
    # implementation=("pallas", "xla") falls through to XLA.
    op = jaxtopk.attention.registry.OPS["pallas_prefill"]
    small = jaxtopk.Certified(0.1, jaxtopk.Auto(block_size=4))
    with mock.patch.object(jax, "default_backend", return_value="gpu"):
      self.assertNotIn("policy=Certified", op.supported(small))
      self.assertIn("policy=Certified", op.supported(jaxtopk.Certified(0.1)))
      self.assertIsInstance(op.refusal(small), NotImplementedError)
    for platform in ("cpu", "tpu"):  # interpret mode; Mosaic tiles
      with mock.patch.object(jax, "default_backend", return_value=platform):
        self.assertIn("policy=Certified", op.supported(small))

  def test_key_value_seq_lengths_are_key_padding(self):
    q, k, v, _ = self._inputs()
    lens = jnp.array([37, 101], jnp.int32)
    pad = (jnp.arange(101) < lens[:, None])[:, None, None, :]
    kw = dict(policy=jaxtopk.Dense(), implementation="pallas")
    o1, c1 = jaxtopk.topk_attention(q, k, v, key_value_seq_lengths=lens, **kw)
    o2, c2 = jaxtopk.topk_attention(q, k, v, mask=pad, **kw)
    np.testing.assert_array_equal(o1, o2)
    _same_certificate(self, c1, c2)
    np.testing.assert_array_equal(c1.k_kept[0], 37)


class PallasDecodeAttentionTest(base.KernelTestCase):
  def _cache(self):
    q, k, v, _ = base.planted(
      2, 4, 2, 1, 150, 8, 8, jnp.float32, block_k=16, block_q=1
    )
    cache = jaxtopk.KVCache.create(2, 192, 2, 8, block_size=16)
    sw = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    cache = cache.append(sw(k), sw(v))
    return sw(q), cache

  def test_dense_same_as_xla(self):
    q, cache = self._cache()
    ox, cx = jaxtopk.decode_attention(q, cache, policy=jaxtopk.Dense())
    op, cp = jaxtopk.decode_attention(
      q, cache, policy=jaxtopk.Dense(), implementation="pallas"
    )
    self.assertEqual(op.shape, (2, 1, 4, 8))
    np.testing.assert_allclose(op, ox, atol=1e-5, rtol=1e-5)
    _same_certificate(self, cp, cx)

  @pytest.mark.slow
  def test_certified_agrees_with_xla_within_bounds(self):
    q, cache = self._cache()
    pol = jaxtopk.Certified(0.05, jaxtopk.DeltaSearch(block_size=16))
    ox, cx = jaxtopk.decode_attention(q, cache, policy=pol)
    op, cp = jaxtopk.decode_attention(
      q, cache, policy=pol, implementation="pallas"
    )
    self.assertTrue(bool(jnp.all(cp.valid)))
    self.assertTrue(bool(jnp.all(cp.tv_bound <= 0.05)))
    self.assertLess(float(jnp.max(cp.keys_scored)), 150)
    # Block-granular Delta-Search scores about as many keys as the XLA path.
    self.assertLessEqual(
      float(jnp.mean(cp.keys_scored)), 1.25 * float(jnp.mean(cx.keys_scored))
    )
    gap = np.linalg.norm(np.asarray(op - ox, np.float64), axis=-1)
    both = np.asarray(cp.output_error_bound + cx.output_error_bound)
    self.assertTrue(np.all(gap <= both + 1e-5))
    od, _ = jaxtopk.decode_attention(q, cache, policy=jaxtopk.Dense())
    err = np.linalg.norm(np.asarray(op - od, np.float64), axis=-1)
    self.assertTrue(np.all(err <= np.asarray(cp.output_error_bound) + 1e-5))


class PallasTopkAttentionCompiledTest(PallasTopkAttentionTest):
  """The same tests on compiled kernels (skipped without a TPU or GPU)."""

  INTERPRET = False


class PallasDecodeAttentionCompiledTest(PallasDecodeAttentionTest):
  """The same tests on compiled kernels (skipped without a TPU or GPU)."""

  INTERPRET = False


if __name__ == "__main__":
  absltest.main()
