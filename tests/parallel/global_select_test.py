"""Global selection over simulated key shards (vmap with an axis name)."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from scipy.special import logsumexp

from jaxtopk import parallel
from jaxtopk.selection import threshold


def _split(x, n_shards):
  """``[r, n]`` -> ``[n_shards, r, n / n_shards]``."""
  r, n = x.shape
  return jnp.moveaxis(x.reshape(r, n_shards, n // n_shards), 1, 0)


def _join(x):
  return jnp.concatenate(list(x), axis=-1)


def _rows(seed, rows, n, *, ties):
  rng = np.random.default_rng(seed)
  if ties:  # few distinct values: many ties at every threshold
    s = rng.integers(-2, 3, size=(rows, n)).astype(np.float32)
  else:
    s = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
  valid = rng.random((rows, n)) > 0.25
  valid[0] = True  # one unmasked row
  valid[1] = False  # one row with no real key
  valid[2, 1:] = False  # one row with a single real key
  return jnp.asarray(s), jnp.asarray(valid)


class GlobalTopkTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("top1", 3, 1, True, "candidates"),
    ("ties_more_than_local", 5, 7, True, "candidates"),
    ("all_keys", 3, 15, False, "candidates"),
    ("radix_ties", 5, 7, True, "radix"),
    ("radix_top1", 3, 1, False, "radix"),
  )
  def test_equals_lax_top_k_on_the_whole_row(
    self, n_shards, topk, ties, method
  ):
    s, valid = _rows(0, 11, 15, ties=ties)
    fn = lambda s_, v_: parallel.global_topk_keep(  # noqa: E731
      s_, v_, topk=topk, axis_name="kv", method=method
    )
    keep = _join(
      jax.jit(jax.vmap(fn, axis_name="kv"))(
        _split(s, n_shards), _split(valid, n_shards)
      )
    )
    # Reference: lax.top_k on the full row (lowest index wins ties).
    cand = jnp.where(valid, s, -jnp.inf)
    idx = jax.lax.top_k(cand, topk)[1]
    ref = jnp.any(jax.nn.one_hot(idx, 15, dtype=bool), axis=-2) & valid
    np.testing.assert_array_equal(keep, ref)
    np.testing.assert_array_equal(
      jnp.sum(keep, -1), jnp.minimum(jnp.sum(valid, -1), topk)
    )

  @parameterized.parameters("candidates", "radix")
  def test_per_row_counts_match_selection_topk_mask(self, method):
    # The single-device reference of topk_attention (radix select).
    s, valid = _rows(1, 7, 15, ties=True)
    row_topk = jnp.array([3, 0, 1, 5, 7, 2, 4], jnp.int32)
    fn = lambda s_, v_: parallel.global_topk_keep(  # noqa: E731
      s_, v_, topk=7, axis_name="kv", row_topk=row_topk, method=method
    )
    keep = _join(
      jax.jit(jax.vmap(fn, axis_name="kv"))(_split(s, 5), _split(valid, 5))
    )
    ref = threshold.topk_mask(s, row_topk, valid)
    np.testing.assert_array_equal(keep, ref)


class GlobalCertifiedTest(parameterized.TestCase):
  @parameterized.named_parameters(("loose", 2, 0.3), ("tight", 5, 1e-3))
  def test_budget_met_minimal_and_shard_invariant(self, n_shards, eps):
    rows, n = 7, 110
    s, valid = _rows(2, rows, n, ties=False)
    row_max = jnp.max(s, axis=-1, where=valid, initial=-jnp.inf)
    log_budget = jnp.log(eps)

    def run(d):
      fn = lambda s_, v_: parallel.global_certified_keep(  # noqa: E731
        s_, v_, row_max, log_budget, n_total=n, axis_name="kv"
      )
      sim = jax.jit(jax.vmap(fn, axis_name="kv"))
      return _join(sim(_split(s, d), _split(valid, d)))

    keep = np.asarray(run(n_shards))
    np.testing.assert_array_equal(keep, np.asarray(run(1)))
    s64, valid = np.asarray(s, np.float64), np.asarray(valid)
    self.assertFalse(np.any(keep & ~valid))
    for r in range(rows):
      if not valid[r].any():
        continue
      real = s64[r][valid[r]]
      kept = s64[r][keep[r]]
      dropped = s64[r][valid[r] & ~keep[r]]
      tau = np.exp(logsumexp(dropped) - logsumexp(real)) if dropped.size else 0
      self.assertLessEqual(tau, eps * (1 + 1e-5))
      if dropped.size:  # an upper set of the logits
        self.assertGreaterEqual(kept.min(), dropped.max())
      # Near-minimal: within one fine bin of the minimal certified set.
      order = np.sort(real)[::-1]
      tails = [
        np.exp(logsumexp(order[i:]) - logsumexp(real))
        for i in range(1, len(order))
      ] + [0.0]
      k_min = 1 + int(np.argmax(np.asarray(tails) <= eps))
      span = np.log(n) - np.log(eps) + 2
      fine_width = span / 63 / 64
      allowed = np.sum(real >= order[k_min - 1] - fine_width)
      self.assertBetween(len(kept), k_min, allowed)


if __name__ == "__main__":
  absltest.main()
