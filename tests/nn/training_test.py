"""An optax training step through Top-k attention lowers the loss."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx

import jaxtopk
from jaxtopk import nn as topk_nn
from tests import rand
from tests.nn.common import BATCH
from tests.nn.common import KV_LEN as SEQ

FEATURES, HEADS = 6, 2


class Regressor(nnx.Module):
  """One causal Top-k attention layer and a linear read-out."""

  def __init__(self, policy, *, rngs):
    self.attn = topk_nn.CertifiedTopKAttention(
      num_heads=HEADS,
      in_features=FEATURES,
      policy=policy,
      decode=False,
      rngs=rngs,
    )
    self.head = nnx.Linear(FEATURES, 1, rngs=rngs)

  def __call__(self, x):
    return self.head(self.attn(x, is_causal=True))[..., 0]


def _task():
  """Target: a running max of the first feature (needs attention)."""
  x = rand.normal(0, (BATCH, SEQ, FEATURES))
  return x, jax.lax.cummax(x[..., 0], axis=1)


class TrainingTest(parameterized.TestCase):
  @parameterized.named_parameters(("fixed_k", jaxtopk.FixedK(3)))
  @pytest.mark.slow
  def test_adam_lowers_the_loss(self, policy):
    model = Regressor(policy, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(3e-2), wrt=nnx.Param)
    x, y = _task()

    def loss_fn(model):
      return jnp.mean((model(x) - y) ** 2)

    @nnx.jit
    def step(model, optimizer):
      loss, grads = nnx.value_and_grad(loss_fn)(model)
      optimizer.update(model, grads)
      return loss, grads

    losses = []
    for i in range(40):
      loss, grads = step(model, optimizer)
      losses.append(float(loss))
      if i == 0:
        leaves = jax.tree.leaves(grads)
        self.assertTrue(all(bool(jnp.all(jnp.isfinite(g))) for g in leaves))
        # The gradient reaches the query and key projections through the
        # softmax over the kept keys (THEORY 8.2).
        q_grad = grads["attn"]["query"]["kernel"][...]
        k_grad = grads["attn"]["key"]["kernel"][...]
        self.assertGreater(float(jnp.abs(q_grad).max()), 0.0)
        self.assertGreater(float(jnp.abs(k_grad).max()), 0.0)
    self.assertTrue(np.all(np.isfinite(losses)))
    self.assertLess(losses[-1], 0.5 * losses[0])
    cert = model.attn.last_certificate.get_value()
    self.assertEqual(cert.tv_bound.shape, (BATCH, SEQ, HEADS))


if __name__ == "__main__":
  absltest.main()
