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
from tests import rand
from tests.tolerances import tol

CONFIG = models.DecoderConfig(
  vocab_size=13,
  num_layers=2,
  num_heads=3,
  num_kv_heads=1,
  model_dim=21,
  head_dim=6,
  mlp_dim=11,
)
BATCH, SEQ, PROMPT = 5, 11, 8


@functools.cache
def _base_model():
  return models.TopKDecoder(CONFIG, rngs=nnx.Rngs(0))


def _model_and_tokens():
  model = nnx.clone(_base_model())  # same graphdef: jits compile once
  tokens = rand.randint(0, (BATCH, SEQ), 0, 13)
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


def _rms(x, scale, eps):
  return scale * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def _rope(x, inv_freq):
  # x [b, s, h, d]; positions 0..s-1; rotate_half layout.
  ang = np.arange(x.shape[1])[:, None] * inv_freq.astype(np.float64)
  ang = np.concatenate([ang, ang], -1)[None, :, None]  # [1, s, 1, d]
  half = x.shape[-1] // 2
  rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
  return x * np.cos(ang) + rot * np.sin(ang)


def _reference_logits(model, tokens):
  """Float64 numpy forward of a TopKDecoder (no biases, untied)."""
  c = model.config
  p = jax.tree.map(
    lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(model))
  )
  inv_freq = models.rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
  x = p["embed"]["embedding"][tokens]  # [b, s, dim]
  s = tokens.shape[1]
  causal = np.tril(np.ones((s, s), bool))
  group = c.num_heads // c.num_kv_heads
  for i in range(c.num_layers):
    blk = p["blocks"][i]
    h = _rms(x, blk["attn_norm"]["scale"], c.norm_eps)
    att = blk["attn"]
    q = np.einsum("bsm,mhd->bshd", h, att["query"]["kernel"])
    k = np.einsum("bsm,mhd->bshd", h, att["key"]["kernel"])
    v = np.einsum("bsm,mhd->bshd", h, att["value"]["kernel"])
    q, k = _rope(q, inv_freq), _rope(k, inv_freq)
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(c.head_dim)
    logits = np.where(causal, logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", w, v)
    x = x + np.einsum("bqhd,hdm->bqm", out, att["out"]["kernel"])
    h = _rms(x, blk["mlp_norm"]["scale"], c.norm_eps)
    mlp = blk["mlp"]
    g = h @ mlp["gate"]["kernel"]
    u = h @ mlp["up"]["kernel"]
    x = x + (g / (1 + np.exp(-g)) * u) @ mlp["down"]["kernel"]
  h = _rms(x, p["final_norm"]["scale"], c.norm_eps)
  return h @ p["lm_head"]["kernel"]


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

  def test_forward_matches_a_float64_reference(self):
    # The whole forward pass (GQA, rotary, RMSNorm, SwiGLU) against a plain
    # numpy float64 transcription of the architecture.
    model, tokens = _model_and_tokens()
    got, _ = _forward(model, tokens)
    want = _reference_logits(model, np.asarray(tokens))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)

  def test_delta_search_decode_uses_the_policy_block_size(self):
    model, tokens = _model_and_tokens()
    policy = jaxtopk.Certified(0.1, jaxtopk.DeltaSearch(block_size=4))
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
    with self.assertRaisesRegex(ValueError, "head_dim=5"):
      models.DecoderConfig(vocab_size=3, num_heads=2, model_dim=10)
    with self.assertRaisesRegex(ValueError, "num_kv_heads=2"):
      models.DecoderConfig(
        vocab_size=3, num_heads=3, num_kv_heads=2, head_dim=4
      )
    with self.assertRaisesRegex(TypeError, "attention='ratio'"):
      model(tokens, attention="ratio")
    with self.assertRaisesRegex(TypeError, "policy=0.5"):
      models.PolicyAttention(0.5)


if __name__ == "__main__":
  absltest.main()
