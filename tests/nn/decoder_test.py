"""Tests for jaxtopk.nn.TopKDecoder (native Top-k decoder, THEORY 8)."""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
from jax import test_util as jtu

import jaxtopk
from jaxtopk import nn
from jaxtopk.nn import _decoder
from tests.tolerances import tol

CONFIG = nn.DecoderConfig(
  vocab_size=13, num_layers=2, num_heads=3, model_dim=21, mlp_dim=11
)
BATCH, SEQ, PROMPT = 5, 11, 9


@functools.cache
def _base_model():
  return nn.TopKDecoder(CONFIG, rngs=nnx.Rngs(0))


def _model_and_tokens():
  # A fresh copy per test; clones share the static attention_fn of
  # CertifiedTopKAttention (a per-instance closure), so the jitted helpers
  # below compile once for all tests instead of once per new model.
  model = nnx.clone(_base_model())
  tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ), 0, 13)
  return model, tokens


_decode_jit = nnx.jit(
  nn.decode_teacher_forced, static_argnames=("prompt_len", "selector", "stats")
)


def _decode(model, tokens, selector, *, rng=None, stats=False):
  return _decode_jit(
    model, tokens, prompt_len=PROMPT, selector=selector, rng=rng, stats=stats
  )  # [b, SEQ - PROMPT, vocab], stats


@nnx.jit(static_argnames=("selector",))
def _forward(model, tokens, selector=None, rng=None):
  return model(tokens, selector=selector, rng=rng)[0]


class DecoderTest(parameterized.TestCase):
  @parameterized.named_parameters(("dense", None), ("rho_one", "rho_one"))
  def test_decode_matches_forward(self, selector):
    model, tokens = _model_and_tokens()
    selector = jaxtopk.Ratio(1.0) if selector else None
    full = _forward(model, tokens)
    self.assertEqual(full.shape, (BATCH, SEQ, 13))
    decoded, _ = _decode(model, tokens, selector)
    np.testing.assert_allclose(decoded, full[:, PROMPT:], **tol(jnp.float32))

  def test_topk_decode_changes_output_and_reports_tv(self):
    model, tokens = _model_and_tokens()
    dense, _ = _decode(model, tokens, None)
    sparse, infos = _decode(model, tokens, jaxtopk.Ratio(0.2), stats=True)
    self.assertGreater(float(jnp.max(jnp.abs(dense - sparse))), 1e-3)
    tv = infos[0]["tv"]  # first layer: [b, h, steps]
    self.assertEqual(tv.shape, (BATCH, 3, SEQ - PROMPT))
    self.assertTrue(bool(jnp.all((tv > 0) & (tv < 1))))
    self.assertTrue(bool(jnp.all(infos[0]["tv_bound"] >= tv)))
    np.testing.assert_array_equal(infos[0]["kept"][..., -1], 3)  # 0.2 * 11
    np.testing.assert_array_equal(infos[1]["precision"], 1.0)

  def test_jit_forward_with_random_selector(self):
    model, tokens = _model_and_tokens()
    selector = nn.MixedTopK(0.5, 0.5)

    @nnx.jit
    def run(model, tokens, rng):
      return model(tokens, selector=selector, rng=rng)[0]

    a = run(model, tokens, jax.random.key(1))
    b = run(model, tokens, jax.random.key(1))
    c = run(model, tokens, jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    self.assertGreater(float(jnp.max(jnp.abs(a - c))), 1e-4)

  def test_topk_training_gradient_is_finite(self):
    model, tokens = _model_and_tokens()

    def loss(model):
      logits, _ = model(tokens, selector=jaxtopk.Ratio(0.3))
      return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

    grads = nnx.jit(nnx.grad(loss))(model)
    leaves = jax.tree.leaves(grads)
    self.assertTrue(all(bool(jnp.all(jnp.isfinite(g))) for g in leaves))
    self.assertGreater(sum(float(jnp.sum(jnp.abs(g))) for g in leaves), 0)

  def test_truncated_softmax_grads(self):
    logits = jax.random.normal(jax.random.key(3), (3, 7)) * 5
    keep = jnp.arange(7)[None] < jnp.array([[1], [4], [7]])
    out = _decoder.truncated_softmax(logits, keep)
    np.testing.assert_allclose(jnp.sum(out, -1), 1.0, **tol(jnp.float32))
    self.assertTrue(bool(jnp.all(jnp.where(keep, True, out == 0))))
    f = lambda x: _decoder.truncated_softmax(x, keep) @ jnp.arange(7.0)
    jtu.check_grads(
      f, (logits.astype(jnp.float64),), order=1, modes=["rev"], atol=1e-2
    )

  def test_block_uses_certified_topk_attention(self):
    model, _ = _model_and_tokens()
    block = model.blocks[0]
    self.assertIsInstance(block.attn, nn.CertifiedTopKAttention)
    x = jax.random.normal(jax.random.key(5), (BATCH, SEQ, 21))
    both = nnx.jit(
      lambda b, x: (b.my_attention(x), b.library_attention(x, jaxtopk.Dense()))
    )  # jitted: eager op-by-op dispatch is slower than one compile
    mine, library = both(block, x)
    np.testing.assert_allclose(mine, library, **tol(jnp.float32))

  @parameterized.parameters(
    (jaxtopk.Ratio(0.3),), (jaxtopk.Certified(0.1),), (jaxtopk.Ratio(1.0),)
  )
  def test_select_attend_matches_library_topk_attention(self, policy):
    q, k, v = (
      jax.random.normal(jax.random.key(i), (BATCH, 3, SEQ, 7)) for i in range(3)
    )
    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))[None, None]
    got, _ = _decoder.select_attend(q, k, v, causal, selector=policy)
    heads_last = lambda x: x.transpose(0, 2, 1, 3)  # [b, s, h, d]
    want, _ = jaxtopk.topk_attention(
      heads_last(q),
      heads_last(k),
      heads_last(v),
      policy=policy,
      is_causal=True,
    )
    np.testing.assert_allclose(heads_last(got), want, **tol(jnp.float32))

  def test_errors(self):
    model, tokens = _model_and_tokens()
    with self.assertRaisesRegex(ValueError, "s=11"):
      model.prefill(tokens, 7)
    with self.assertRaisesRegex(ValueError, "prompt_len=11"):
      nn.decode_teacher_forced(model, tokens, prompt_len=11)
    with self.assertRaisesRegex(ValueError, "model_dim=10"):
      nn.DecoderConfig(vocab_size=3, num_heads=3, model_dim=10)


def _tau64(q, k, keep, mask):
  """float64 dropped mass of the exact logits q.k / sqrt(d), per row."""
  logits = np.einsum("bhqd,bhsd->bhqs", q, k) / np.sqrt(q.shape[-1])
  logits = np.where(mask, logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  return (p * ~keep).sum(-1) / p.sum(-1)


class TvBoundTest(parameterized.TestCase):
  """tv_bound is never below the float64 truth (THEORY 3.4)."""

  @pytest.mark.slow
  @hypothesis.given(
    seed=st.integers(0, 2**16),
    spread=st.sampled_from([0.1, 1.0, 10.0, 100.0]),
    repeat=st.booleans(),
    length=st.integers(1, 11),
    rho=st.sampled_from([0.1, 0.3, 0.7, 1.0]),
  )
  def test_sound(self, seed, spread, repeat, length, rho):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(1, 3, 1, 5)).astype(np.float32) * spread
    k = rng.normal(size=(1, 3, 11, 5)).astype(np.float32)
    if repeat:  # ties: every key equal to the first
      k[:] = k[:, :, :1]
    v = rng.normal(size=(1, 3, 11, 5)).astype(np.float32)
    mask = np.broadcast_to(np.arange(11) < length, (1, 3, 1, 11))
    _, info = _attend(q, k, v, mask, nn.ExactTopK(rho))
    keep = np.asarray(
      nn.ExactTopK(rho)(
        jnp.einsum("bhqd,bhsd->bhqs", q, k) * 5**-0.5, jnp.asarray(mask)
      )
    )
    truth = _tau64(q.astype(np.float64), k.astype(np.float64), keep, mask)
    self.assertTrue(np.all(np.asarray(info["tv_bound"]) >= truth))
    self.assertTrue(np.all(np.asarray(info["tv_bound"]) <= 1.0))


@functools.partial(jax.jit, static_argnames=("selector",))
def _attend(q, k, v, mask, selector):
  return _decoder.select_attend(q, k, v, mask, selector=selector, stats=True)


if __name__ == "__main__":
  absltest.main()
