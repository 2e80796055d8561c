"""KV-sharded decode equals unsharded decode, on 8 simulated devices.

Run by ``tests/parallel/multidevice_test.py`` with 8 CPU devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

import jaxtopk
from jaxtopk import Certified
from jaxtopk import FixedK
from jaxtopk import Ratio
from jaxtopk import parallel
from tests.tolerances import tol

B, HK, G, D = 2, 2, 3, 5  # batch, kv heads, query heads per kv head, dim
MAX_LEN, FILLED = 96, 61  # cache capacity (8 shards x 12) and filled length


def setUpModule():
  if jax.device_count() < 8:
    raise RuntimeError(f"needs 8 devices, found {jax.device_count()}")


def _cache_and_query(seed, filled=FILLED):
  rng = np.random.default_rng(seed)
  cache = jaxtopk.KVCache.create(B, MAX_LEN, HK, D, block_size=16)
  k = jnp.asarray(rng.standard_normal((B, filled, HK, D)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, filled, HK, D)), jnp.float32)
  cache = cache.append(k, v)
  q = jnp.asarray(rng.standard_normal((B, 1, HK * G, D)) * 3, jnp.float32)
  return cache, q


class ShardedDecodeTest(parameterized.TestCase):
  # Every mesh axis and both kinds of policy (a count, FixedK's and Ratio's
  # path, and Certified) in two programs.
  @parameterized.named_parameters(
    ("kv8_certified", {"kv": 8}, Certified(0.05)),
    ("data2_heads2_kv2_ratio", {"data": 2, "heads": 2, "kv": 2}, Ratio(0.1)),
  )
  def test_sharded_decode_equals_decode_attention(self, axes, policy):
    # The cache holds FILLED - 2 positions when sharded; two more are
    # appended to the SHARDED cache (a decode step's append, jitted to keep
    # the cache's shardings), then one step is decoded.
    cache, q = _cache_and_query(0, FILLED - 2)
    rng = np.random.default_rng(1)
    k_new, v_new = (
      jnp.asarray(rng.standard_normal((B, 2, HK, D)), jnp.float32)
      for _ in range(2)
    )
    mesh = parallel.make_mesh(axes)
    shardings = parallel.cache_shardings(mesh, cache)
    cache_s = jax.device_put(cache, shardings)
    append = lambda c, k, v: c.append(k, v)
    cache_s = jax.jit(append, out_shardings=shardings)(cache_s, k_new, v_new)
    self.assertEqual(cache_s.keys.sharding, shardings.keys)
    cache = cache.append(k_new, v_new)
    np.testing.assert_array_equal(cache_s.length, FILLED)
    out, cert = parallel.sharded_decode_attention(
      q, cache_s, policy=policy, mesh=mesh
    )
    ref_out, ref_cert = jaxtopk.decode_attention(q, cache, policy=policy)
    self.assertEqual(out.shape, ref_out.shape)
    out, cert, ref_out, ref_cert = jax.device_get(
      (out, cert, ref_out, ref_cert)
    )
    np.testing.assert_array_equal(cert.valid, ref_cert.valid)
    np.testing.assert_array_equal(cert.keys_scored, FILLED)
    if isinstance(policy, Certified):
      self.assertLessEqual(float(np.max(cert.tv_bound)), policy.eps)
      self.assertLessEqual(float(np.max(ref_cert.tv_bound)), policy.eps)
      # Histogram threshold: near-minimal.
      self.assertLessEqual(
        np.mean(cert.k_kept), 1.2 * np.mean(ref_cert.k_kept) + 1
      )
    else:
      np.testing.assert_array_equal(cert.k_kept, ref_cert.k_kept)
      np.testing.assert_allclose(out, ref_out, **tol(jnp.float32))
      np.testing.assert_allclose(
        cert.tv_bound, ref_cert.tv_bound, rtol=1e-3, atol=1e-6
      )

  def test_indivisible_cache_is_rejected(self):
    cache, q = _cache_and_query(1)
    mesh = parallel.make_mesh({"kv": 8})
    small = jaxtopk.KVCache.create(B, 84, HK, D, block_size=4)
    with self.assertRaisesRegex(ValueError, "max_len=84 must be divisible"):
      parallel.sharded_decode_attention(q, small, policy=FixedK(3), mesh=mesh)


if __name__ == "__main__":
  absltest.main()
