"""Tests for jaxtopk.models.generate (KV-cache generation, certificates)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import nnx

import jaxtopk
from jaxtopk import models
from tests import rand

CONFIG = models.DecoderConfig(
  vocab_size=17,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  model_dim=12,
  head_dim=6,
  mlp_dim=9,
  rope_theta=30.0,
  tie_embeddings=True,
)
BATCH, PROMPT, NEW = 3, 7, 5


@functools.cache
def _model():
  return models.TopKDecoder(CONFIG, rngs=nnx.Rngs(4))


def _prompt():
  return rand.randint(1, (BATCH, PROMPT), 0, 17)


class GenerateTest(absltest.TestCase):
  def test_greedy_is_the_argmax_of_the_forward_pass(self):
    model = _model()
    tokens, certs = models.generate(model, _prompt(), max_new_tokens=NEW)
    self.assertEqual(tokens.shape, (BATCH, PROMPT + NEW))
    self.assertEqual(tokens.dtype, jnp.int32)
    np.testing.assert_array_equal(tokens[:, :PROMPT], _prompt())
    logits, _ = model(tokens)
    want = jnp.argmax(logits[:, PROMPT - 1 : -1], -1)
    np.testing.assert_array_equal(tokens[:, PROMPT:], want)
    self.assertLen(certs, 2)
    self.assertEqual(certs[1].tv_bound.shape, (BATCH, PROMPT + NEW - 1, 4))
    np.testing.assert_array_equal(certs[1].tv_bound, 0.0)  # dense
    # Row t saw t + 1 keys, prompt rows and decode rows alike.
    want_kept = np.arange(1, PROMPT + NEW)[None, :, None]
    np.testing.assert_array_equal(
      certs[0].k_kept, np.broadcast_to(want_kept, certs[0].k_kept.shape)
    )

  def test_certified_generation_is_within_budget(self):
    model = _model()
    policy = jaxtopk.Certified(0.05)
    _, certs = models.generate(
      model, _prompt(), max_new_tokens=NEW, attention=policy
    )
    for cert in certs:
      self.assertTrue(bool(jnp.all(cert.valid)))
      self.assertTrue(bool(jnp.all(cert.tv_bound <= 0.05)))
    # dense_prefill: the prompt rows are dense, the decode rows certified.
    _, mixed = models.generate(
      model, _prompt(), max_new_tokens=NEW, attention=policy, dense_prefill=True
    )
    np.testing.assert_array_equal(mixed[0].tv_bound[:, :PROMPT], 0.0)
    self.assertTrue(bool(jnp.all(mixed[1].tv_bound[:, PROMPT:] <= 0.05)))
    self.assertTrue(bool(jnp.any(mixed[1].tv_bound[:, PROMPT:] > 0)))

  def test_mc_search_decode_states_its_failure_probability(self):
    policy = jaxtopk.Certified(
      0.1, jaxtopk.MCSearch(block_size=4, failure_prob=0.02)
    )
    _, certs = models.generate(
      _model(),
      _prompt(),
      max_new_tokens=2,
      attention=policy,
      dense_prefill=True,  # the prefill takes no PRNG key: MC is refused
      rng=jax.random.key(3),
    )
    self.assertEqual(certs[0].failure_prob, 0.02)  # every row, sound
    self.assertTrue(bool(jnp.all(certs[1].tv_bound[:, PROMPT:] <= 0.1)))

  def test_sampling(self):
    model = _model()
    kw = dict(max_new_tokens=NEW, temperature=2.0)
    a, _ = models.generate(model, _prompt(), rng=jax.random.key(0), **kw)
    b, _ = models.generate(model, _prompt(), rng=jax.random.key(0), **kw)
    c, _ = models.generate(model, _prompt(), rng=jax.random.key(1), **kw)
    np.testing.assert_array_equal(a, b)
    self.assertFalse(bool(jnp.all(a == c)))

  def test_errors(self):
    model = _model()
    with self.assertRaisesRegex(ValueError, "max_new_tokens=0"):
      models.generate(model, _prompt(), max_new_tokens=0)
    with self.assertRaisesRegex(ValueError, "rng="):
      models.generate(model, _prompt(), max_new_tokens=2, temperature=1.0)
    with self.assertRaisesRegex(ValueError, "temperature=-1"):
      models.generate(model, _prompt(), max_new_tokens=2, temperature=-1)
    with self.assertRaisesRegex(ValueError, "input_ids"):
      models.generate(model, _prompt()[0], max_new_tokens=2)
    with self.assertRaisesRegex(TypeError, "attention=0.5"):
      models.generate(model, _prompt(), max_new_tokens=2, attention=0.5)


if __name__ == "__main__":
  absltest.main()
