"""Tests for the native Top-k selectors (jaxtopk.nn._selectors)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

import jaxtopk
from jaxtopk import nn
from jaxtopk.nn import _selectors

N_KEYS = 13
LENGTHS = np.array([13, 11, 7, 5, 1])  # real keys per batch row


def _inputs():
  logits = jax.random.normal(jax.random.key(0), (5, 3, N_KEYS)) * 3.0
  mask = np.arange(N_KEYS)[None, None, :] < LENGTHS[:, None, None]
  return logits, jnp.asarray(np.broadcast_to(mask, logits.shape))


def _budget(rho):
  return np.maximum(1, np.ceil(rho * LENGTHS - 1e-9)).astype(int)


class ExactTopKTest(parameterized.TestCase):
  @parameterized.parameters(0.1, 0.3, 0.5, 1.0)
  def test_matches_numpy_argsort(self, rho):
    logits, mask = _inputs()
    keep = np.asarray(nn.ExactTopK(rho)(logits, mask))
    budget = _budget(rho)
    for b in range(5):
      for h in range(3):
        row = np.asarray(logits[b, h, : LENGTHS[b]])
        want = np.zeros(N_KEYS, bool)
        want[np.argsort(-row)[: budget[b]]] = True
        np.testing.assert_array_equal(keep[b, h], want)

  def test_rho_one_is_mask(self):
    logits, mask = _inputs()
    np.testing.assert_array_equal(nn.ExactTopK(1.0)(logits, mask), mask)

  def test_jit(self):
    logits, mask = _inputs()
    sel = nn.ExactTopK(0.4)
    np.testing.assert_array_equal(jax.jit(sel)(logits, mask), sel(logits, mask))


class MixedTopKTest(parameterized.TestCase):
  @parameterized.parameters(0.0, 0.3, 0.6, 1.0)
  def test_precision_and_budget(self, precision):
    logits, mask = _inputs()
    rho = 0.3
    keep = nn.MixedTopK(rho, precision)(logits, mask, jax.random.key(1))
    self.assertFalse(np.any(np.asarray(keep) & ~np.asarray(mask)))
    budget = _budget(rho)
    np.testing.assert_array_equal(
      np.sum(keep, -1), np.broadcast_to(budget[:, None], (5, 3))
    )
    got = np.asarray(nn.selection_precision(keep, logits, mask, rho))
    others = LENGTHS - budget
    want = np.maximum(np.round(precision * budget), budget - others) / budget
    np.testing.assert_allclose(got, np.broadcast_to(want[:, None], (5, 3)))

  def test_needs_rng(self):
    logits, mask = _inputs()
    with self.assertRaisesRegex(ValueError, "rng=None"):
      nn.MixedTopK(0.5, 0.5)(logits, mask, None)


class ApproxMaxKTest(parameterized.TestCase):
  def test_xla_cpu_is_exact(self):
    logits, mask = _inputs()
    keep = nn.ApproxMaxK(0.4, 0.5, emulate=False)(logits, mask)
    np.testing.assert_array_equal(keep, nn.ExactTopK(0.4)(logits, mask))

  def test_emulation_exact_with_one_key_per_bin(self):
    logits, mask = _inputs()
    # recall 0.99 asks for more bins than keys: every key is its own bin.
    self.assertEqual(_selectors.approx_bins(N_KEYS, 5, 0.99), N_KEYS)
    keep = nn.ApproxMaxK(0.4, 0.99)(logits, mask)
    np.testing.assert_array_equal(keep, nn.ExactTopK(0.4)(logits, mask))

  def test_emulation_recall_falls_with_target(self):
    logits = jax.random.normal(jax.random.key(2), (7, 256))
    mask = jnp.ones_like(logits, bool)
    recalls = []
    for target in (0.3, 0.9):
      keep = nn.ApproxMaxK(0.125, target)(logits, mask)
      np.testing.assert_array_equal(np.sum(keep, -1), 32)
      recalls.append(
        float(jnp.mean(nn.selection_precision(keep, logits, mask, 0.125)))
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
    np.testing.assert_array_equal(nn.ExactTopK(rho)(logits, mask), want)


class ErrorsTest(absltest.TestCase):
  def test_errors_name_value(self):
    with self.assertRaisesRegex(ValueError, "rho=0"):
      nn.ExactTopK(0)
    with self.assertRaisesRegex(ValueError, "precision=1.5"):
      nn.MixedTopK(0.5, 1.5)
    with self.assertRaisesRegex(ValueError, "recall_target=1.0"):
      nn.ApproxMaxK(0.5, 1.0)

  def test_num_kept(self):
    mask = jnp.arange(N_KEYS)[None] < jnp.asarray(LENGTHS)[:, None]
    np.testing.assert_array_equal(
      _selectors.num_kept(mask, 0.3), [math.ceil(0.3 * n) for n in LENGTHS]
    )


if __name__ == "__main__":
  absltest.main()
