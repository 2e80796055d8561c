"""The Flax layer trains under an 8-device mesh (data=2, heads=4).

Run by ``tests/parallel/multidevice_test.py`` with 8 CPU devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxtopk
import jaxtopk.nn
from jaxtopk import parallel

B, T, F, HEADS = 4, 7, 12, 4  # batch, seq, features, heads


def setUpModule():
  if jax.device_count() < 8:
    raise RuntimeError(f"needs 8 devices, found {jax.device_count()}")


class Model(nnx.Module):
  def __init__(self, rngs):
    self.attn = jaxtopk.nn.CertifiedTopKAttention(
      num_heads=HEADS,
      in_features=F,
      policy=jaxtopk.FixedK(3),
      decode=False,
      rngs=rngs,
    )
    self.readout = nnx.Linear(F, 1, rngs=rngs)

  def __call__(self, x):
    return self.readout(self.attn(x, is_causal=True))[..., 0]  # [b, t]


def _data():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((B, T, F)).astype(np.float32)
  # Target: a causal running mean of feature 0 (learnable by attention).
  y = np.cumsum(x[..., 0], axis=1) / np.arange(1, T + 1)
  return jnp.asarray(x), jnp.asarray(y, jnp.float32)


def _train(mesh, steps=8):
  model = Model(nnx.Rngs(0))
  if mesh is not None:
    parallel.shard_module(model, mesh)
  opt = nnx.Optimizer(model, optax.adam(3e-2), wrt=nnx.Param)
  x, y = _data()
  if mesh is not None:
    x = jax.device_put(x, parallel.activation_sharding(mesh, 3))
    y = jax.device_put(y, parallel.activation_sharding(mesh, 2))
    # The optimizer's state placed as the step returns it (its step count
    # replicated), ...
    state = nnx.state(opt)
    nnx.update(
      opt, jax.device_put(state, parallel.param_shardings(state, mesh))
    )
  # ... and the layer's last_certificate created (by its first call) before
  # the first step: otherwise the second step sees new inputs and compiles
  # the train step again (a forward pass compiles in less time).
  nnx.jit(lambda model, x: model(x))(model, x)

  @nnx.jit
  def step(model, opt, x, y):
    def loss_fn(model):
      return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  losses = [float(step(model, opt, x, y)) for _ in range(steps)]
  return model, losses


class FlaxMeshTest(absltest.TestCase):
  def test_trains_sharded_and_matches_one_device(self):
    mesh = parallel.make_mesh({"data": 2, "heads": 4})
    model, losses = _train(mesh)
    self.assertLess(losses[-1], 0.7 * losses[0], losses)
    # Parameters stay sharded over heads after training.
    for param, spec in (
      (model.attn.query.kernel, P(None, "heads", None)),
      (model.attn.value.bias, P("heads", None)),
      (model.attn.out.kernel, P("heads", None, None)),
      (model.readout.kernel, P()),
    ):
      x = param.get_value()
      want = NamedSharding(mesh, spec)
      self.assertTrue(x.sharding.is_equivalent_to(want, x.ndim), x.sharding)
      self.assertLen(x.sharding.device_set, 8)
    # The same training on one device gives the same losses.
    _, ref_losses = _train(None)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, atol=1e-6)
    cert = model.attn.last_certificate.get_value()
    self.assertEqual(cert.k_kept.shape, (B, T, HEADS))


if __name__ == "__main__":
  absltest.main()
