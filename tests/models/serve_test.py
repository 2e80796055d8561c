"""Tests for jaxtopk.models.serve (continuous batching on a paged cache)."""

import functools

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import nnx

import jaxtopk
from jaxtopk import models
from tests import rand
from tests.models.generate_test import CONFIG

NEW = 4
# Five requests of different lengths through two slots: later requests
# reuse the pages of finished ones.
LENGTHS = (9, 3, 14, 1, 6)


@functools.cache
def _model():
  return models.TopKDecoder(CONFIG, rngs=nnx.Rngs(4))


def _prompts():
  return [rand.randint(i, (n,), 0, 17).tolist() for i, n in enumerate(LENGTHS)]


class ServeTest(absltest.TestCase):
  def test_dense_serving_equals_the_forward_pass(self):
    model = _model()
    prompts = _prompts()
    out, stats = models.serve(
      model, prompts, max_new_tokens=NEW, batch=2, page_size=4, chunk=4,
      num_pages=9,
    )  # fmt: skip
    self.assertLen(out, len(prompts))
    # One full causal forward pass, dense, of every request's tokens,
    # right-padded (causal: the padding changes no earlier logit).
    rows = [
      prompt + done.tokens for prompt, done in zip(prompts, out, strict=True)
    ]
    width = max(map(len, rows))
    logits, _ = model(jnp.asarray([r + [0] * (width - len(r)) for r in rows]))
    for i, (prompt, done) in enumerate(zip(prompts, out, strict=True)):
      self.assertLen(done.tokens, NEW)
      want = jnp.argmax(logits[i, len(prompt) - 1 : len(prompt) + NEW - 1], -1)
      np.testing.assert_array_equal(done.tokens, want)
      np.testing.assert_array_equal(done.tv_bound, 0.0)
      self.assertTrue(done.valid)
    self.assertEqual(stats["new_tokens"], NEW * len(prompts))
    self.assertGreater(stats["prefill_steps"], 0)
    self.assertGreater(stats["decode_steps"], 0)

  def test_certified_serving_is_within_budget(self):
    model = _model()
    policy = jaxtopk.Certified(0.05, jaxtopk.DeltaSearch(block_size=4))
    out, _ = models.serve(
      model, _prompts(), max_new_tokens=NEW, attention=policy, batch=3,
      page_size=4, chunk=8,
    )  # fmt: skip
    for done in out:
      self.assertLen(done.tokens, NEW)
      self.assertTrue(done.valid)
      self.assertTrue(np.all(done.tv_bound <= 0.05))

  def test_extend_in_ragged_chunks_equals_prefill(self):
    model = _model()
    ids = rand.randint(7, (2, 10), 0, 17)
    logits, cache, _ = model.prefill(ids, 16, block_size=4)
    empty = model.init_cache(2, 16, block_size=4)
    # Row 0 in chunks of 6 and 4 tokens, row 1 of 3 and 7 (right-padded).
    first = jnp.stack([ids[0, :6], jnp.pad(ids[1, :3], (0, 3))])
    second = jnp.stack([jnp.pad(ids[0, 6:], (0, 3)), ids[1, 3:]])
    _, part, _ = model.extend(first, empty, num_steps=[6, 3])
    got, part, certs = model.extend(second, part, num_steps=[4, 7])
    np.testing.assert_allclose(got, logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(part.layers, cache.layers, strict=True):
      np.testing.assert_array_equal(a.length, [10, 10])
      np.testing.assert_allclose(a.keys, b.keys, rtol=1e-5, atol=1e-6)
    self.assertEqual(certs[0].tv_bound.shape, (2, 7, 4))

  def test_bad_arguments_are_named(self):
    model = _model()
    with self.assertRaisesRegex(ValueError, r"prompts\[1\] is empty"):
      models.serve(model, [[1], []], max_new_tokens=2)
    with self.assertRaisesRegex(ValueError, "batch=0"):
      models.serve(model, [[1]], max_new_tokens=2, batch=0)
    with self.assertRaisesRegex(ValueError, "num_pages=1"):
      models.serve(model, [[1] * 9], max_new_tokens=2, page_size=4, num_pages=1)
    with self.assertRaisesRegex(ValueError, "block_size=8 must equal"):
      models.serve(
        model, [[1]], max_new_tokens=2, page_size=4,
        attention=jaxtopk.Certified(0.1, jaxtopk.DeltaSearch(block_size=8)),
      )  # fmt: skip


if __name__ == "__main__":
  absltest.main()
