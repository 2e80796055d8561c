"""CertifiedTopKAttention inside a Linen model, through flax.nnx.bridge."""

import jax
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
from tests.nn.common import KV_LEN as SEQ
from tests.tolerances import tol

HEADS = 2


class Block(linen.Module):
  """A residual Linen block whose attention is the bridged Top-k layer."""

  policy: jaxtopk.Policy

  @linen.compact
  def __call__(self, x, mask=None):
    h = linen.Dense(FEATURES, name="embed")(x)
    attn = topk_nn.topk_attention_linen(
      num_heads=HEADS,
      in_features=FEATURES,
      qkv_features=6,
      policy=self.policy,
      decode=False,
      name="attn",
    )
    return h + attn(h, mask=mask, is_causal=True)


class LinenBridgeTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("dense", jaxtopk.Dense()), ("fixed_k", jaxtopk.FixedK(3))
  )
  def test_linen_model_matches_nnx_layer(self, policy):
    x = rand.normal(0, (BATCH, SEQ, FEATURES))
    mask = (jnp.arange(SEQ) < SEQ - 2)[None, None, None, :]
    model = Block(policy)
    variables = model.init(jax.random.key(1), x, mask)
    self.assertEqual(
      variables["params"]["attn"]["query"]["kernel"].shape,
      (FEATURES, HEADS, 3),
    )
    got, state = jax.jit(
      lambda v, x: model.apply(v, x, mask, mutable=["certificates"])
    )({"params": variables["params"]}, x)

    layer = topk_nn.CertifiedTopKAttention(
      num_heads=HEADS,
      in_features=FEATURES,
      qkv_features=6,
      policy=policy,
      decode=False,
      rngs=nnx.Rngs(2),
    )
    nnx.update(layer, nnx.State(variables["params"]["attn"]))
    embed = variables["params"]["embed"]
    h = x @ embed["kernel"] + embed["bias"]
    want = h + layer(h, mask=mask, is_causal=True)
    np.testing.assert_allclose(got, want, **tol(jnp.float32))

    certs = topk_nn.collect_certificates(state)
    self.assertEqual(list(certs), ["certificates/attn/last_certificate"])
    cert = certs["certificates/attn/last_certificate"]
    mine = layer.last_certificate.get_value()
    np.testing.assert_array_equal(cert.k_kept, mine.k_kept)
    np.testing.assert_allclose(cert.tv_bound, mine.tv_bound, rtol=1e-6)


if __name__ == "__main__":
  absltest.main()
