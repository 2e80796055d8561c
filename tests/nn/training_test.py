"""An optax training step through Top-k attention lowers the loss."""

import chex
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


class InitCertificatesTest(absltest.TestCase):
  def _step(self, traces):
    x, y = _task()

    @nnx.jit
    def step(model):
      traces.append(1)  # runs when nnx.jit traces the step

      def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)

      return nnx.value_and_grad(loss_fn)(model)

    return x, step

  def test_a_fresh_model_compiles_its_jitted_step_once(self):
    policy = jaxtopk.Certified(0.1)
    for init, expected in ((False, 2), (True, 1)):
      with self.subTest(init=init):
        model = Regressor(policy, rngs=nnx.Rngs(0))
        traces = []
        x, step = self._step(traces)
        if init:
          topk_nn.init_certificates(model.attn, x, is_causal=True)
        for _ in range(3):
          jax.block_until_ready(step(model))
        # Without it, the second call sees last_certificate as new state.
        self.assertLen(traces, expected)

  def test_placeholder_is_invalid_and_leaves_the_model_as_it_was(self):
    model = Regressor(jaxtopk.Certified(0.1), rngs=nnx.Rngs(0))
    other = Regressor(jaxtopk.Certified(0.1), rngs=nnx.Rngs(0))
    x, _ = _task()
    before = nnx.state(model)
    topk_nn.init_certificates(model, jax.ShapeDtypeStruct(x.shape, x.dtype))
    chex.assert_trees_all_equal(
      nnx.state(model, nnx.Not(nnx.Intermediate)), before
    )
    placeholder = model.attn.last_certificate.get_value()
    self.assertFalse(np.any(placeholder.valid))
    self.assertTrue(np.all(np.isnan(placeholder.tv_bound)))
    self.assertFalse(np.any(placeholder.k_kept))
    other(x)
    cert = other.attn.last_certificate.get_value()
    chex.assert_trees_all_equal_shapes_and_dtypes(placeholder, cert)
    self.assertEqual(jax.tree.structure(placeholder), jax.tree.structure(cert))
    model(x)  # the first call overwrites it
    chex.assert_trees_all_equal(model.attn.last_certificate.get_value(), cert)

  def test_layers_the_call_does_not_reach_get_none(self):
    model = Regressor(jaxtopk.Dense(), rngs=nnx.Rngs(0))
    spare = topk_nn.CertifiedTopKAttention(
      num_heads=HEADS,
      in_features=FEATURES,
      policy=jaxtopk.Dense(),
      decode=False,
      rngs=nnx.Rngs(1),
    )
    model.spare = spare
    x, _ = _task()
    topk_nn.init_certificates(model, x)
    self.assertIsNotNone(model.attn.last_certificate)
    self.assertIsNone(model.spare.last_certificate)
    # A layer that holds a certificate: replaced where the call reaches it
    # (the new shape), left as it is where it does not.
    spare(x[:1, :5])
    held = spare.last_certificate.get_value()
    topk_nn.init_certificates(model, x[:, :7])
    self.assertEqual(
      model.attn.last_certificate.get_value().valid.shape, (BATCH, 7, HEADS)
    )
    chex.assert_trees_all_equal(spare.last_certificate.get_value(), held)


if __name__ == "__main__":
  absltest.main()
