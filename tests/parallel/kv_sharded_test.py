"""kv_shard_attention on simulated key shards: equality and soundness.

The shards are simulated with ``jax.vmap(..., axis_name="kv")``, whose
collectives (psum, pmax, all_gather, axis_index) behave as under shard_map;
the real multi-device runs are in ``multidevice/``.
"""

import hypothesis
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import strategies as st

from jaxtopk import Certified
from jaxtopk import Dense
from jaxtopk import FixedK
from jaxtopk import PowerLaw
from jaxtopk import Ratio
from jaxtopk import UnsupportedPolicyError
from tests.parallel import truth
from tests.tolerances import tol

B, H, T, D, E = 2, 3, 5, 7, 11  # batch, heads, q_len, head_dim, v_dim

POLICIES = {
  "power": PowerLaw(1.5, 0.5),
  "certified_capped": Certified(1e-3, max_topk=4),
}


def _inputs(seed, n, *, dtype=jnp.float32, q_scale=1.0, n_distinct=None):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, H, T, D)) * q_scale
  if n_distinct:  # repeated keys: ties among logits
    k = rng.standard_normal((B, H, n_distinct, D))[
      :, :, np.arange(n) % n_distinct
    ]
  else:
    k = rng.standard_normal((B, H, n, D))
  v = rng.standard_normal((B, H, n, E))
  valid = rng.random((B, H, T, n)) > 0.3
  valid[0, 0, 0] = False  # a row with no real key
  valid[0, 0, 1] = np.arange(n) == n - 1  # one real key
  q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
  return q, k, v, jnp.asarray(valid)


class KvShardAttentionTest(parameterized.TestCase):
  @parameterized.named_parameters(*[(name, p) for name, p in POLICIES.items()])
  def test_sharded_equals_single_shard(self, policy, n_shards=5):
    q, k, v, valid = _inputs(0, 25)
    o1, c1, keep1 = truth.simulated_kv_attention(
      q, k, v, valid, policy=policy, n_shards=1
    )
    on, cn, keepn = truth.simulated_kv_attention(
      q, k, v, valid, policy=policy, n_shards=n_shards
    )
    np.testing.assert_array_equal(keep1, keepn)
    np.testing.assert_allclose(on, o1, **tol(jnp.float32))
    np.testing.assert_array_equal(cn.k_kept, c1.k_kept)
    np.testing.assert_array_equal(cn.valid, c1.valid)
    np.testing.assert_allclose(cn.tv_bound, c1.tv_bound, rtol=1e-5, atol=1e-7)

  def test_output_is_top_k_attention_and_invalid_rows_flagged(self):
    q, k, v, valid = _inputs(1, 21)
    out, cert, keep = truth.simulated_kv_attention(
      q, k, v, valid, policy=FixedK(4), n_shards=3
    )
    _, _, ref = truth.dense_truth(q, k, v, valid, keep)
    ok = np.asarray(cert.valid)
    np.testing.assert_allclose(np.asarray(out)[ok], ref[ok], **tol(jnp.float32))
    self.assertFalse(ok[0, 0, 0])
    self.assertTrue(np.isnan(cert.tv_bound[0, 0, 0]))
    self.assertTrue(ok[0, 0, 1])
    self.assertEqual(int(cert.k_kept[0, 0, 1]), 1)
    self.assertEqual(float(cert.tv_bound[0, 0, 1]), 0.0)
    np.testing.assert_array_equal(cert.k_kept, np.minimum(np.sum(valid, -1), 4))
    np.testing.assert_array_equal(cert.keys_scored, np.sum(valid, -1))

  def test_dense_policy_certifies_zero(self):
    q, k, v, valid = _inputs(2, 12)
    out, cert, _ = truth.simulated_kv_attention(
      q, k, v, valid, policy=Dense(), n_shards=4
    )
    ok = np.asarray(cert.valid)
    np.testing.assert_array_equal(np.asarray(cert.tv_bound)[ok], 0.0)
    _, _, dense = truth.dense_truth(q, k, v, valid, valid)
    np.testing.assert_allclose(
      np.asarray(out)[ok], dense[ok], **tol(jnp.float32)
    )


class PolicyFieldsTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("delta", Certified(0.1, search="delta"), "Certified.search"),
    ("mc", Certified(0.1, search="mc"), "Certified.search"),
  )
  def test_block_searches_refused_by_name(self, policy, field):
    q, k, v, valid = _inputs(0, 8)
    with self.assertRaisesRegex(UnsupportedPolicyError, field):
      truth.simulated_kv_attention(q, k, v, valid, policy=policy, n_shards=2)


class SoundnessTest(parameterized.TestCase):
  """Global certificates never below the float64 truth (THEORY 3.4)."""

  @parameterized.named_parameters(
    ("fixed_4x3", FixedK(2), 4, 12, jnp.float32),
    ("certified_4x1", Certified(0.1), 4, 4, jnp.float32),
    ("ratio_2x7_bf16", Ratio(0.2), 2, 14, jnp.bfloat16),
    ("certified_3x5_bf16", Certified(0.01), 3, 15, jnp.bfloat16),
  )
  @hypothesis.settings(max_examples=15)
  @hypothesis.given(
    seed=st.integers(0, 2**16),
    log_q_scale=st.floats(-2.0, 2.5),
    n_distinct=st.sampled_from([None, 1, 2]),
  )
  def test_certificate_sound(
    self, policy, n_shards, n, dtype, seed, log_q_scale, n_distinct
  ):
    q, k, v, valid = _inputs(
      seed, n, dtype=dtype, q_scale=10.0**log_q_scale, n_distinct=n_distinct
    )
    out, cert, keep = truth.simulated_kv_attention(
      q, k, v, valid, policy=policy, n_shards=n_shards
    )
    self.assertEqual(out.dtype, dtype)
    tau, err, _ = truth.dense_truth(q, k, v, valid, keep)
    ok = np.asarray(cert.valid)
    np.testing.assert_array_equal(ok, np.asarray(valid).any(-1))
    tv = np.asarray(cert.tv_bound, np.float64)[ok]
    self.assertTrue(np.all(tv >= tau[ok]), (tv - tau[ok]).min())
    log_tv = np.asarray(cert.log_tv_bound, np.float64)[ok]
    with np.errstate(divide="ignore"):
      self.assertTrue(np.all(log_tv >= np.log(tau[ok])))
    err_bound = np.asarray(cert.output_error_bound)[ok]
    self.assertTrue(np.all(err_bound >= err[ok]), (err_bound - err[ok]).min())
    if isinstance(policy, Certified):
      self.assertTrue(np.all(tv <= policy.eps), tv.max())
      np.testing.assert_array_equal(cert.keys_scored, np.sum(valid, -1))


if __name__ == "__main__":
  absltest.main()
