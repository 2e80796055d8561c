"""The jaxtyping annotations of jaxtopk.models' public functions are accurate.

Each function is wrapped with ``jaxtyped(typechecker=beartype)``: calls with
consistent shapes pass the check, an inconsistent one fails it.
"""

import functools

import jax.numpy as jnp
from absl.testing import absltest
from beartype import beartype
from flax import nnx
from jaxtyping import TypeCheckError
from jaxtyping import jaxtyped

import jaxtopk
from jaxtopk import models
from tests import rand

_checked = jaxtyped(typechecker=beartype)


@functools.cache
def _decoder():
  config = models.DecoderConfig(
    vocab_size=11, num_layers=1, num_heads=2, model_dim=8, mlp_dim=5
  )
  return models.TopKDecoder(config, rngs=nnx.Rngs(0))


class AnnotationsTest(absltest.TestCase):
  def test_pooling(self):
    hidden = rand.normal(0, (3, 7, 5))
    mask = jnp.ones((3, 7), jnp.int32)
    pooled = _checked(models.mean_pool)(hidden, mask)
    _checked(models.l2_normalize)(pooled)
    with self.assertRaises(TypeCheckError):
      _checked(models.mean_pool)(hidden, mask[:, :5])

  def test_decoder(self):
    model = _decoder()
    tokens = jnp.zeros((3, 7), jnp.int32)
    logits, certs = _checked(model.__call__)(
      tokens, attention=jaxtopk.FixedK(2)
    )
    self.assertEqual(logits.shape, (3, 7, 11))
    out, _ = _checked(models.decode_teacher_forced)(model, tokens, prompt_len=5)
    self.assertEqual(out.shape, (3, 2, 11))
    with self.assertRaises(TypeCheckError):
      _checked(models.decode_teacher_forced)(model, tokens[0], prompt_len=5)


if __name__ == "__main__":
  absltest.main()
