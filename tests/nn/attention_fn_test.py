"""topk_attention_fn inside nnx.MultiHeadAttention and linen's attention."""

import chex
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from flax import linen
from flax import nnx

import jaxtopk
from jaxtopk import nn as topk_nn
from tests import rand
from tests.nn.common import BATCH
from tests.nn.common import FEATURES
from tests.nn.common import KV_LEN
from tests.nn.common import Q_LEN
from tests.tolerances import tol

HEADS = 2
POLICIES = (
  ("dense", jaxtopk.Dense()),
  ("fixed_k", jaxtopk.FixedK(3)),
  ("certified", jaxtopk.Certified(0.1)),
)


def _inputs(dtype=jnp.float32):
  xq = rand.normal(0, (BATCH, Q_LEN, FEATURES), dtype)
  xk = rand.normal(1, (BATCH, KV_LEN, FEATURES), dtype)
  return xq, xk


def _mask():
  """[batch, 1, q_len, kv_len], float as Flax's mask helpers make them."""
  lengths = KV_LEN - jnp.arange(BATCH)
  keys = jnp.arange(KV_LEN) < lengths[:, None]
  return nnx.make_attention_mask(jnp.ones((BATCH, Q_LEN)), keys)


def _layer(policy, dtype=jnp.float32):
  return topk_nn.CertifiedTopKAttention(
    num_heads=HEADS,
    in_features=FEATURES,
    qkv_features=6,
    policy=policy,
    dtype=dtype,
    decode=False,
    rngs=nnx.Rngs(0),
  )


class NnxHookTest(parameterized.TestCase):
  @parameterized.named_parameters(
    (name, policy, dtype)
    for (name, policy), dtype in zip(
      POLICIES, (jnp.float32, jnp.bfloat16, jnp.float32), strict=True
    )
  )
  def test_hook_in_nnx_matches_module(self, policy, dtype):
    layer = _layer(policy, dtype)
    mha = nnx.MultiHeadAttention(
      num_heads=HEADS,
      in_features=FEATURES,
      qkv_features=6,
      dtype=dtype,
      decode=False,
      attention_fn=topk_nn.topk_attention_fn(policy),
      rngs=nnx.Rngs(1),
    )
    nnx.update(mha, nnx.state(layer, nnx.Param))
    xq, xk = _inputs(dtype)
    mask = _mask()
    want = layer(xq, xk, mask=mask)
    got, inter = nnx.capture(mha, nnx.Intermediate)(
      xq, xk, mask=mask, sow_weights=True
    )
    np.testing.assert_allclose(
      np.asarray(got, np.float32), np.asarray(want, np.float32), **tol(dtype)
    )
    certs = topk_nn.collect_certificates(inter)
    self.assertEqual(list(certs), ["certificate/0"])
    mine = layer.last_certificate.get_value()
    chex.assert_trees_all_close(certs["certificate/0"], mine, rtol=1e-6)

  def test_hook_without_sow_records_nothing(self):
    mha = nnx.MultiHeadAttention(
      num_heads=HEADS,
      in_features=FEATURES,
      qkv_features=6,
      decode=False,
      attention_fn=topk_nn.topk_attention_fn(jaxtopk.Dense()),
      rngs=nnx.Rngs(1),
    )
    xq, _ = _inputs()
    _, inter = nnx.capture(mha, nnx.Intermediate)(xq)
    self.assertEqual(topk_nn.collect_certificates(inter), {})

  def test_hook_refuses_active_dropout(self):
    fn = topk_nn.topk_attention_fn(jaxtopk.Dense())
    q = jnp.ones((BATCH, Q_LEN, HEADS, 3))
    with self.assertRaisesRegex(NotImplementedError, "dropout_rate=0.5"):
      fn(q, q, q, dropout_rate=0.5, deterministic=False)


class LinenHookTest(parameterized.TestCase):
  @parameterized.named_parameters(
    (name, policy, dtype)
    for (name, policy), dtype in zip(
      POLICIES, (jnp.bfloat16, jnp.float32, jnp.float32), strict=True
    )
  )
  def test_hook_in_linen_matches_module(self, policy, dtype):
    layer = _layer(policy, dtype)
    mhdpa = linen.MultiHeadDotProductAttention(
      num_heads=HEADS,
      qkv_features=6,
      dtype=dtype,
      attention_fn=topk_nn.topk_attention_fn(policy),
    )
    params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    xq, xk = _inputs(dtype)
    mask = _mask()
    want = layer(xq, xk, mask=mask)
    got, state = mhdpa.apply(
      {"params": params},
      xq,
      xk,
      mask=mask,
      sow_weights=True,
      mutable=["intermediates"],
    )
    np.testing.assert_allclose(
      np.asarray(got, np.float32), np.asarray(want, np.float32), **tol(dtype)
    )
    certs = topk_nn.collect_certificates(state)
    self.assertEqual(list(certs), ["intermediates/certificate/0"])
    np.testing.assert_array_equal(
      certs["intermediates/certificate/0"].k_kept,
      layer.last_certificate.get_value().k_kept,
    )


if __name__ == "__main__":
  absltest.main()
