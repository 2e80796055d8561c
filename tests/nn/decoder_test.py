"""Tests for jaxtopk.nn.TopKDecoder (native Top-k decoder, THEORY 8)."""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
from jax import test_util as jtu

from jaxtopk import nn
from jaxtopk.nn import _decoder
from tests.tolerances import tol

CONFIG = nn.DecoderConfig(
  vocab_size=13, num_layers=2, num_heads=3, model_dim=21, mlp_dim=11
)
BATCH, SEQ, PROMPT = 5, 11, 9


def _model_and_tokens():
  model = nn.TopKDecoder(CONFIG, rngs=nnx.Rngs(0))
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
    selector = nn.ExactTopK(1.0) if selector else None
    full = _forward(model, tokens)
    self.assertEqual(full.shape, (BATCH, SEQ, 13))
    decoded, _ = _decode(model, tokens, selector)
    np.testing.assert_allclose(decoded, full[:, PROMPT:], **tol(jnp.float32))

  def test_topk_decode_changes_output_and_reports_tv(self):
    model, tokens = _model_and_tokens()
    dense, _ = _decode(model, tokens, None)
    sparse, infos = _decode(model, tokens, nn.ExactTopK(0.2), stats=True)
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
      logits, _ = model(tokens, selector=nn.ExactTopK(0.3))
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

  def test_entropy_matches_numpy(self):
    logits = jax.random.normal(jax.random.key(4), (5, 11))
    mask = jnp.arange(11)[None] < jnp.array([[11], [7], [5], [3], [1]])
    got = _decoder.attention_entropy(logits, mask)
    for row in range(5):
      x = np.asarray(logits[row], np.float64)[np.asarray(mask[row])]
      p = np.exp(x - x.max())
      p /= p.sum()
      np.testing.assert_allclose(got[row], -np.sum(p * np.log(p)), atol=1e-5)

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
