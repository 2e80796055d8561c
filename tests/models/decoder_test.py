"""Tests for jaxtopk.models.TopKDecoder (native Top-k decoder, THEORY 8)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx

import jaxtopk
from jaxtopk import models
from tests.tolerances import tol

CONFIG = models.DecoderConfig(
  vocab_size=13, num_layers=2, num_heads=3, model_dim=21, mlp_dim=11
)
BATCH, SEQ, PROMPT = 5, 11, 8


@functools.cache
def _base_model():
  return models.TopKDecoder(CONFIG, rngs=nnx.Rngs(0))


def _model_and_tokens():
  model = nnx.clone(_base_model())  # same graphdef: jits compile once
  tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ), 0, 13)
  return model, tokens


_decode_jit = nnx.jit(
  models.decode_teacher_forced,
  static_argnames=("prompt_len", "attention", "block_size"),
)


def _decode(model, tokens, attention, *, rng=None, block_size=None):
  return _decode_jit(
    model,
    tokens,
    prompt_len=PROMPT,
    attention=attention,
    rng=rng,
    block_size=block_size,
  )  # [b, SEQ - PROMPT, vocab], per-layer statistics


@nnx.jit(static_argnames=("attention",))
def _forward(model, tokens, attention=None):
  return model(tokens, attention=attention)


@dataclasses.dataclass(frozen=True)
class _JaxNNAttention:
  """A user hook: dense attention by jax.nn.dot_product_attention."""

  def prefill(self, query, key, value, *, rng=None):
    out = jax.nn.dot_product_attention(query, key, value, is_causal=True)
    return out, {"calls": jnp.ones(query.shape[:3])}

  def decode(self, query, cache, *, rng=None):
    mask = cache.valid()[:, :, None, :]  # [b, 1, 1, max_len]
    out = jax.nn.dot_product_attention(
      query,
      jnp.swapaxes(cache.keys, 1, 2),
      jnp.swapaxes(cache.values, 1, 2),
      mask=mask,
    )
    return out, {"calls": jnp.ones(query.shape[:3])}


class DecoderTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("dense", None),
    ("rho_one", jaxtopk.Ratio(1.0)),
    ("hook", _JaxNNAttention()),
  )
  def test_decode_matches_forward(self, attention):
    model, tokens = _model_and_tokens()
    full, _ = _forward(model, tokens)
    self.assertEqual(full.shape, (BATCH, SEQ, 13))
    decoded, aux = _decode(model, tokens, attention)
    np.testing.assert_allclose(decoded, full[:, PROMPT:], **tol(jnp.float32))
    self.assertLen(aux, CONFIG.num_layers)
    if isinstance(attention, _JaxNNAttention):
      self.assertEqual(aux[0]["calls"].shape, (BATCH, SEQ - PROMPT, 3))
    hooked, _ = _forward(model, tokens, _JaxNNAttention())
    np.testing.assert_allclose(hooked, full, **tol(jnp.float32))

  def test_topk_decode_is_certified_by_the_library(self):
    model, tokens = _model_and_tokens()
    dense, _ = _decode(model, tokens, None)
    sparse, certs = _decode(model, tokens, jaxtopk.Ratio(0.2))
    self.assertGreater(float(jnp.max(jnp.abs(dense - sparse))), 1e-3)
    cert = certs[0]
    self.assertIsInstance(cert, jaxtopk.Certificate)
    self.assertEqual(cert.tv_bound.shape, (BATCH, SEQ - PROMPT, 3))
    # Decode step t sees PROMPT + t + 1 keys; Ratio keeps ceil(0.2 n).
    filled = PROMPT + 1 + np.arange(SEQ - PROMPT)
    want = np.ceil(0.2 * filled - 1e-9).astype(int)
    np.testing.assert_array_equal(
      cert.k_kept, np.broadcast_to(want[:, None], cert.k_kept.shape)
    )
    self.assertTrue(bool(jnp.all((cert.tv_bound > 0) & (cert.tv_bound <= 1))))
    self.assertTrue(bool(jnp.all(cert.valid)))

  def test_prefill_certificates_and_training_gradient(self):
    model, tokens = _model_and_tokens()
    _, certs = _forward(model, tokens, jaxtopk.FixedK(2))
    self.assertEqual(certs[1].k_kept.shape, (BATCH, SEQ, 3))
    np.testing.assert_array_equal(certs[1].k_kept[:, 0], 1)  # causal: 1 key
    np.testing.assert_array_equal(certs[1].k_kept[:, 1:], 2)

    def loss(model):
      logits, _ = model(tokens, attention=jaxtopk.Ratio(0.3))
      return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

    grads = nnx.jit(nnx.grad(loss))(model)
    leaves = jax.tree.leaves(grads)
    self.assertTrue(all(bool(jnp.all(jnp.isfinite(g))) for g in leaves))
    self.assertGreater(sum(float(jnp.sum(jnp.abs(g))) for g in leaves), 0)

  def test_block_attention_is_the_nn_layer(self):
    # The block's attention sublayer equals jaxtopk.nn.CertifiedTopKAttention
    # with the same weights and policy (parameter names are shared).
    model, _ = _model_and_tokens()
    block = model.blocks[0]
    policy = jaxtopk.Ratio(0.5)
    layer = jaxtopk.nn.CertifiedTopKAttention(
      3, 21, policy=policy, decode=False, use_bias=False, rngs=nnx.Rngs(1)
    )
    nnx.update(layer, nnx.state(block.attn, nnx.Param))
    x = jax.random.normal(jax.random.key(5), (BATCH, SEQ, 21))

    @nnx.jit
    def both(block, layer, x):
      q, k, v = block.qkv(x)
      out, _ = models.PolicyAttention(policy).prefill(q, k, v)
      return block.attn.out(out), layer(block.attn_norm(x), is_causal=True)

    mine, library = both(block, layer, x)
    np.testing.assert_allclose(mine, library, **tol(jnp.float32))

  def test_delta_search_decode_uses_the_policy_block_size(self):
    model, tokens = _model_and_tokens()
    policy = jaxtopk.Certified(0.1, search="delta", block_size=4)
    out, certs = _decode(model, tokens, policy)
    self.assertEqual(out.shape, (BATCH, SEQ - PROMPT, 13))
    self.assertTrue(bool(jnp.all(certs[0].tv_bound <= 0.1)))
    with self.assertRaisesRegex(ValueError, "block_size"):
      _decode(model, tokens, policy, block_size=8)

  def test_errors(self):
    model, tokens = _model_and_tokens()
    with self.assertRaisesRegex(ValueError, "s=11"):
      model.prefill(tokens, 7)
    with self.assertRaisesRegex(ValueError, "prompt_len=11"):
      models.decode_teacher_forced(model, tokens, prompt_len=11)
    with self.assertRaisesRegex(ValueError, "model_dim=10"):
      models.DecoderConfig(vocab_size=3, num_heads=3, model_dim=10)
    with self.assertRaisesRegex(TypeError, "attention='ratio'"):
      model(tokens, attention="ratio")
    with self.assertRaisesRegex(TypeError, "policy=0.5"):
      models.PolicyAttention(0.5)


if __name__ == "__main__":
  absltest.main()
