"""Tests for the native Top-k selectors (experiments/_selectors.py)."""

import functools
import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from jax import test_util as jtu

import jaxtopk
from experiments import _selectors
from tests import rand
from tests.tolerances import tol

N_KEYS = 13
LENGTHS = np.array([13, 11, 7, 5, 1])  # real keys per batch row


def _inputs():
  logits = rand.normal(0, (5, 3, N_KEYS)) * 3.0
  mask = np.arange(N_KEYS)[None, None, :] < LENGTHS[:, None, None]
  return logits, jnp.asarray(np.broadcast_to(mask, logits.shape))


def _budget(rho):
  return np.maximum(1, np.ceil(rho * LENGTHS - 1e-9)).astype(int)


class ExactTopKTest(parameterized.TestCase):
  @parameterized.parameters(0.1, 0.3, 0.5, 1.0)
  def test_matches_numpy_argsort(self, rho):
    logits, mask = _inputs()
    keep = np.asarray(_selectors.ExactTopK(rho)(logits, mask))
    budget = _budget(rho)
    for b in range(5):
      for h in range(3):
        row = np.asarray(logits[b, h, : LENGTHS[b]])
        want = np.zeros(N_KEYS, bool)
        want[np.argsort(-row)[: budget[b]]] = True
        np.testing.assert_array_equal(keep[b, h], want)

  def test_rho_one_is_mask(self):
    logits, mask = _inputs()
    np.testing.assert_array_equal(_selectors.ExactTopK(1.0)(logits, mask), mask)

  def test_jit(self):
    logits, mask = _inputs()
    sel = _selectors.ExactTopK(0.4)
    np.testing.assert_array_equal(jax.jit(sel)(logits, mask), sel(logits, mask))


class MixedTopKTest(parameterized.TestCase):
  @parameterized.parameters(0.0, 0.3, 0.6, 1.0)
  def test_precision_and_budget(self, precision):
    logits, mask = _inputs()
    rho = 0.3
    keep = _selectors.MixedTopK(rho, precision)(logits, mask, jax.random.key(1))
    self.assertFalse(np.any(np.asarray(keep) & ~np.asarray(mask)))
    budget = _budget(rho)
    np.testing.assert_array_equal(
      np.sum(keep, -1), np.broadcast_to(budget[:, None], (5, 3))
    )
    got = np.asarray(_selectors.selection_precision(keep, logits, mask, rho))
    others = LENGTHS - budget
    want = np.maximum(np.round(precision * budget), budget - others) / budget
    np.testing.assert_allclose(got, np.broadcast_to(want[:, None], (5, 3)))

  def test_needs_rng(self):
    logits, mask = _inputs()
    with self.assertRaisesRegex(ValueError, "rng=None"):
      _selectors.MixedTopK(0.5, 0.5)(logits, mask, None)


class ApproxMaxKTest(parameterized.TestCase):
  def test_xla_cpu_is_exact(self):
    logits, mask = _inputs()
    keep = _selectors.ApproxMaxK(0.4, 0.5, emulate=False)(logits, mask)
    np.testing.assert_array_equal(keep, _selectors.ExactTopK(0.4)(logits, mask))

  def test_emulation_exact_with_one_key_per_bin(self):
    logits, mask = _inputs()
    # recall 0.99 asks for more bins than keys: every key is its own bin.
    self.assertEqual(_selectors.approx_bins(N_KEYS, 5, 0.99), N_KEYS)
    keep = _selectors.ApproxMaxK(0.4, 0.99)(logits, mask)
    np.testing.assert_array_equal(keep, _selectors.ExactTopK(0.4)(logits, mask))

  def test_emulation_recall_falls_with_target(self):
    logits = rand.normal(2, (7, 256))
    mask = jnp.ones_like(logits, bool)
    recalls = []
    for target in (0.3, 0.9):
      keep = _selectors.ApproxMaxK(0.125, target)(logits, mask)
      np.testing.assert_array_equal(np.sum(keep, -1), 32)
      recalls.append(
        float(
          jnp.mean(_selectors.selection_precision(keep, logits, mask, 0.125))
        )
      )
    self.assertLess(recalls[0], recalls[1])
    self.assertLess(recalls[0], 0.95)

  def test_bins(self):
    self.assertEqual(_selectors.approx_bins(256, 16, 0.5), 32)
    self.assertEqual(_selectors.approx_bins(256, 16, 0.9), 256)
    self.assertEqual(_selectors.approx_bins(256, 1, 0.5), 256)


class LibraryAgreementTest(parameterized.TestCase):
  @parameterized.parameters(0.1, 0.3, 1.0)
  def test_exact_topk_is_library_ratio(self, rho):
    logits, mask = _inputs()
    want = jaxtopk.select(logits, jaxtopk.Ratio(rho), mask=mask).keep
    np.testing.assert_array_equal(_selectors.ExactTopK(rho)(logits, mask), want)


class ErrorsTest(absltest.TestCase):
  def test_errors_name_value(self):
    with self.assertRaisesRegex(ValueError, "rho=0"):
      _selectors.ExactTopK(0)
    with self.assertRaisesRegex(ValueError, "precision=1.5"):
      _selectors.MixedTopK(0.5, 1.5)
    with self.assertRaisesRegex(ValueError, "recall_target=1.0"):
      _selectors.ApproxMaxK(0.5, 1.0)

  def test_num_kept(self):
    mask = jnp.arange(N_KEYS)[None] < jnp.asarray(LENGTHS)[:, None]
    np.testing.assert_array_equal(
      _selectors.num_kept(mask, 0.3), [math.ceil(0.3 * n) for n in LENGTHS]
    )


class SelectorAttentionTest(parameterized.TestCase):
  """The decoder hook of the fidelity sweeps (jaxtopk.models attention)."""

  @parameterized.parameters(0.3, 1.0)
  def test_exact_topk_matches_library_ratio(self, rho):
    b, s, h, d = 2, 11, 3, 7
    q, k, v = (rand.normal(i, (b, s, h, d)) for i in range(3))
    hook = _selectors.SelectorAttention(_selectors.ExactTopK(rho))
    got, info = jax.jit(hook.prefill)(q, k, v)
    want, cert = jaxtopk.topk_attention(
      q, k, v, policy=jaxtopk.Ratio(rho), is_causal=True
    )
    np.testing.assert_allclose(got, want, **tol(jnp.float32))
    np.testing.assert_array_equal(info["kept"], cert.k_kept)
    np.testing.assert_array_equal(info["precision"], 1.0)
    self.assertTrue(bool(jnp.all(info["tv_bound"] >= info["tv"])))

  def test_truncated_softmax_grads(self):
    logits = rand.normal(3, (3, 7)) * 5
    keep = jnp.arange(7)[None] < jnp.array([[1], [4], [7]])
    out = _selectors.truncated_softmax(logits, keep)
    np.testing.assert_allclose(jnp.sum(out, -1), 1.0, **tol(jnp.float32))
    self.assertTrue(bool(jnp.all(jnp.where(keep, True, out == 0))))
    f = lambda x: _selectors.truncated_softmax(x, keep) @ jnp.arange(7.0)
    jtu.check_grads(
      f, (logits.astype(jnp.float64),), order=1, modes=["rev"], atol=1e-2
    )


def _tau64(q, k, keep, mask):
  """float64 dropped mass of the exact logits q.k / sqrt(d), per row."""
  logits = np.einsum("bhqd,bhsd->bhqs", q, k) / np.sqrt(q.shape[-1])
  logits = np.where(mask, logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  return (p * ~keep).sum(-1) / p.sum(-1)


@functools.partial(jax.jit, static_argnames=("selector",))
def _attend(q, k, v, mask, selector):
  return _selectors.select_attend(q, k, v, mask, selector, None)


class TvBoundTest(parameterized.TestCase):
  """The selector hook's tv_bound is never below the float64 truth."""

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
    selector = _selectors.ExactTopK(rho)
    _, info = _attend(q, k, v, jnp.asarray(mask), selector)
    keep = np.asarray(
      selector(jnp.einsum("bhqd,bhsd->bhqs", q, k) * 5**-0.5, jnp.asarray(mask))
    )
    truth = _tau64(q.astype(np.float64), k.astype(np.float64), keep, mask)
    self.assertTrue(np.all(np.asarray(info["tv_bound"]) >= truth))
    self.assertTrue(np.all(np.asarray(info["tv_bound"]) <= 1.0))


if __name__ == "__main__":
  absltest.main()
