"""Sharded certified attention on 8 simulated devices (real shard_map).

Run by ``tests/parallel/multidevice_test.py`` with 8 CPU devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from jax.sharding import PartitionSpec as P

import jaxtopk
from jaxtopk import Certified
from jaxtopk import Dense
from jaxtopk import FixedK
from jaxtopk import Ratio
from jaxtopk import parallel
from tests.parallel import truth
from tests.tolerances import tol

B, T, H, D, E = 2, 3, 4, 5, 7  # batch, q_len, heads, head_dim, v_dim
N = 56  # keys: divisible by 8 shards of 7


def setUpModule():
  if jax.device_count() < 8:
    raise RuntimeError(
      f"needs 8 devices, found {jax.device_count()}; run through"
      " tests/parallel/multidevice_test.py"
    )


def _inputs(seed, *, q_scale=2.0, kv_heads=H):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((B, T, H, D)) * q_scale, jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, N, kv_heads, D)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, N, kv_heads, E)), jnp.float32)
  mask = jnp.asarray(rng.random((B, 1, 1, N)) > 0.2)  # key padding
  return q, k, v, mask


def _single_device(q, k, v, mask, policy, is_causal=False):
  mesh = parallel.make_mesh({"kv": 1}, devices=jax.devices()[:1])
  return parallel.sharded_topk_attention(
    q, k, v, policy=policy, mesh=mesh, mask=mask, is_causal=is_causal
  )


MESHES = {
  "kv8": {"kv": 8},
  "data2_kv4": {"data": 2, "kv": 4},
  "data2_heads2_kv2": {"data": 2, "heads": 2, "kv": 2},
  "heads4_data2": {"heads": 4, "data": 2},
}


class ShardedAttentionTest(parameterized.TestCase):
  # The kv8 mesh: test_gradients_equal_topk_attention_on_a_real_mesh (a count
  # policy; its forward pass is checked there, sharing the program) and
  # test_global_certificate_sound_on_a_real_mesh (Certified). Certified with
  # max_topk: kv_sharded_test (simulated shards).
  @parameterized.named_parameters(
    ("data2_kv4_certified_causal", "data2_kv4", Certified(0.02), True, H),
    ("mixed_ratio_causal_gqa", "data2_heads2_kv2", Ratio(0.2), True, 2),
    ("heads_data_dense", "heads4_data2", Dense(), False, H),
  )
  def test_sharded_equals_single_device(
    self, mesh_name, policy, is_causal, kv_heads
  ):
    q, k, v, mask = _inputs(0, kv_heads=kv_heads)
    mesh = parallel.make_mesh(MESHES[mesh_name])
    q_s, k_s, v_s = parallel.shard_attention_inputs(mesh, q, k, v)
    out, cert = parallel.sharded_topk_attention(
      q_s, k_s, v_s, policy=policy, mesh=mesh, mask=mask, is_causal=is_causal
    )
    self.assertEqual(out.shape, (B, T, H, E))
    self.assertEqual(cert.tv_bound.shape, (B, T, H))
    self.assertEqual(len(out.sharding.device_set), 8)
    if not isinstance(policy, Certified):
      # jaxtopk.topk_attention (the single-device XLA path of the attention
      # package) keeps the same keys.
      ref_out, ref_cert = jaxtopk.topk_attention(
        q, k, v, policy=policy, mask=mask, is_causal=is_causal
      )
      out, cert, ref_out, ref_cert = jax.device_get(
        (out, cert, ref_out, ref_cert)
      )
      np.testing.assert_array_equal(cert.valid, ref_cert.valid)
      np.testing.assert_array_equal(cert.keys_scored, ref_cert.keys_scored)
      np.testing.assert_array_equal(cert.k_kept, ref_cert.k_kept)
      np.testing.assert_allclose(out, ref_out, **tol(jnp.float32))
      # Both sound; they differ only in rounding slack.
      np.testing.assert_allclose(
        cert.tv_bound, ref_cert.tv_bound, rtol=1e-3, atol=1e-6
      )
      return
    # Certified: the histogram threshold differs from topk_attention's exact
    # radix threshold, so compare with the same algorithm on one device.
    out, cert, one_out, one_cert = jax.device_get(
      (out, cert, *_single_device(q, k, v, mask, policy, is_causal))
    )
    np.testing.assert_array_equal(cert.valid, one_cert.valid)
    np.testing.assert_array_equal(cert.keys_scored, one_cert.keys_scored)
    np.testing.assert_allclose(out, one_out, **tol(jnp.float32))
    np.testing.assert_array_equal(cert.k_kept, one_cert.k_kept)
    # Same kept set; the bounds differ only in rounding slack: each merge of
    # per-shard partials adds its rescale slack (core.PartialSoftmax.reduce,
    # about
    # |m_shard - m| / 2 eps per merge), so 4 shards round up a little more
    # than 1 (~2e-5 relative here).
    np.testing.assert_allclose(
      cert.tv_bound, one_cert.tv_bound, rtol=1e-4, atol=1e-7
    )
    if policy.max_topk is None:
      _, ref_cert = jax.device_get(
        jaxtopk.topk_attention(
          q, k, v, policy=policy, mask=mask, is_causal=is_causal
        )
      )
      np.testing.assert_array_equal(cert.valid, ref_cert.valid)
      self.assertLessEqual(float(np.nanmax(ref_cert.tv_bound)), policy.eps)
      self.assertLessEqual(float(np.nanmax(cert.tv_bound)), policy.eps)
      # Histogram threshold: near-minimal (within a fine bin).
      self.assertLessEqual(
        np.mean(cert.k_kept), 1.2 * np.mean(ref_cert.k_kept) + 1
      )

  def test_global_certificate_sound_on_a_real_mesh(self):
    # kv_shard_attention under a real 8-way shard_map, returning the kept set,
    # checked against float64 dense truth (count policies: kv_sharded_test's
    # property tests and the equality tests above).
    policy = Certified(0.01)
    q, k, v, mask = _inputs(1, q_scale=4.0)
    qh, kh, vh = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # head-major
    valid = jnp.broadcast_to(jnp.swapaxes(mask, 1, 2), (B, H, T, N))
    mesh = parallel.make_mesh({"kv": 8})

    def per_shard(q_, k_, v_, m_):
      return parallel.kv_shard_attention(
        q_,
        k_,
        v_,
        m_,
        policy=policy,
        scale=D**-0.5,
        axis_name="kv",
        n_total=N,
        return_keep=True,
      )

    kv_spec = P(None, None, "kv", None)
    fn = parallel.shard_map(
      per_shard,
      mesh=mesh,
      in_specs=(P(), kv_spec, kv_spec, P(None, None, None, "kv")),
      out_specs=(P(), P(), P(None, None, None, "kv")),
    )
    out, cert, keep = jax.device_get(jax.jit(fn)(qh, kh, vh, valid))
    tau, err, head = truth.dense_truth(qh, kh, vh, valid, keep)
    ok = np.asarray(cert.valid)
    self.assertTrue(ok.all())
    self.assertTrue(np.all(cert.tv_bound >= tau))
    self.assertTrue(np.all(cert.output_error_bound >= err))
    np.testing.assert_allclose(out, head, **tol(jnp.float32))
    self.assertTrue(np.all(cert.tv_bound <= policy.eps))

  def test_gradients_equal_topk_attention_on_a_real_mesh(self):
    # Forward pass and gradients through the real 8-way kv shard_map
    # (psum / all_gather transposed by jax) equal those of topk_attention on
    # one device: the kept set and certificate of a count policy exactly.
    q, k, v, mask = _inputs(3)
    w = jnp.asarray(np.random.default_rng(3).standard_normal((B, T, H, E)))
    mesh = parallel.make_mesh({"kv": 8})
    policy = FixedK(4)

    def sharded(q, k, v):
      return parallel.sharded_topk_attention(
        q, k, v, policy=policy, mesh=mesh, mask=mask
      )

    def single(q, k, v):
      return jaxtopk.topk_attention(q, k, v, policy=policy, mask=mask)

    def forward_and_grads(fn):
      out, vjp, cert = jax.vjp(fn, q, k, v, has_aux=True)
      return out, cert, vjp(w.astype(out.dtype))

    out, cert, got = forward_and_grads(sharded)
    self.assertEqual(out.shape, (B, T, H, E))
    self.assertLen(out.sharding.device_set, 8)
    out, cert, got = jax.device_get((out, cert, got))
    ref_out, ref_cert, want = jax.device_get(forward_and_grads(single))
    np.testing.assert_array_equal(cert.valid, ref_cert.valid)
    np.testing.assert_array_equal(cert.keys_scored, ref_cert.keys_scored)
    np.testing.assert_array_equal(cert.k_kept, ref_cert.k_kept)
    np.testing.assert_allclose(out, ref_out, **tol(jnp.float32))
    np.testing.assert_allclose(
      cert.tv_bound, ref_cert.tv_bound, rtol=1e-3, atol=1e-6
    )
    for g, r in zip(got, want, strict=True):
      np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-4)

  def test_indivisible_kv_len_is_rejected(self):
    q, k, v, _ = _inputs(2)
    mesh = parallel.make_mesh({"kv": 8})
    with self.assertRaisesRegex(ValueError, "kv_len=55 must be divisible"):
      parallel.sharded_topk_attention(
        q, k[:, :55], v[:, :55], policy=FixedK(3), mesh=mesh
      )


if __name__ == "__main__":
  absltest.main()
