"""Multi-query decode (q_len > 1 steps over a cache), the log-sum-exp
residual and merge_attention, against float64 truth per row."""

import contextlib
import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from scipy.special import logsumexp

import jaxtopk
from jaxtopk.attention import _decode
from jaxtopk.attention import registry
from tests.attention.retrace import fresh_decode
from tests.theory import truth

B, HK, H, D, N, BS = 2, 1, 2, 4, 64, 16
LENGTHS = (40, 2)  # row 1: its first step falls before the first key
Q_LEN = 3
SCALE = 1 / np.sqrt(D)
# A chunk of the newest steps (the blockwise prefill's route for Certified;
# the other kinds take it from more steps, lowered here by ``_every_kind``);
# sequence 1's first 12 steps fall before its first key.
CHUNK = _decode.CHUNK_MIN_STEPS["certified"]
CHUNK_LENGTHS = (50, 20)
TINY = float(np.finfo(np.float32).tiny)
LOG0 = float(np.finfo(np.float32).min)

POLICIES = (
  jaxtopk.FixedK(3),
  jaxtopk.Ratio(1 / 8),
  jaxtopk.Certified(0.05, max_topk=6),
  jaxtopk.Certified(0.05, jaxtopk.DeltaSearch(block_size=BS), max_topk=4),
  jaxtopk.Certified(
    0.05, jaxtopk.MCSearch(block_size=BS, failure_prob=1e-9), max_topk=6
  ),
)


def _data(seed=0, lengths=LENGTHS, q_len=Q_LEN):
  """(query [B, q_len, H, D], keys [B, N, HK, D], cache): the values are
  one-hot positions (value_dim = N), so an output row is its weights."""
  rng = np.random.default_rng(seed)
  k = np.float32(2 * rng.normal(size=(B, N, HK, D)))
  q = np.float32(rng.normal(size=(B, q_len, H, D)))
  eye = jnp.broadcast_to(jnp.eye(N)[None, :, None, :], (B, N, HK, N))
  cache = jaxtopk.KVCache.create(B, N, HK, D, block_size=BS, value_dim=N)
  cache = cache.append(k, eye, num_steps=jnp.array(lengths))
  return q, k, cache


@contextlib.contextmanager
def _every_kind():
  """Every kind of policy takes the chunk route from CHUNK steps (traced
  afresh: the route is chosen when the decode is traced)."""
  lowered = dict.fromkeys(_decode.CHUNK_MIN_STEPS, CHUNK)
  with mock.patch.dict(_decode.CHUNK_MIN_STEPS, lowered), fresh_decode():
    yield


def _logits(q, k, b, i, h, limit):
  """float64 logits of step i, head h of sequence b over its prefix."""
  return truth.as64(k[b, :limit, 0]) @ truth.as64(q[b, i, h]) * SCALE


class MultiQueryTest(parameterized.TestCase):
  @parameterized.parameters(*POLICIES)
  def test_rows_against_float64(self, policy):
    q, k, cache = _data()
    result = jaxtopk.decode_attention(
      q, cache, policy=policy, rng=jax.random.key(0), return_residual=True
    )
    self._check_rows(policy, q, k, *result)

  @parameterized.parameters(
    *POLICIES[:3],
    jaxtopk.Certified(0.05),  # Auto: the exact search on a small index
    jaxtopk.Certified(0.05, jaxtopk.DeltaSearch(block_size=BS)),
    jaxtopk.Certified(
      0.05, jaxtopk.DeltaSearch(block_size=BS, bound=jaxtopk.Codes())
    ),
    jaxtopk.Certified(0.05, jaxtopk.MCSearch(block_size=BS, failure_prob=1e-9)),
  )
  def test_index_rows_against_float64(self, policy):
    # The content index's group searches take max_topk on no path.
    q, k, cache = _data()
    index = jaxtopk.IndexedKVCache.from_cache(cache, group_size=BS)
    result = jaxtopk.decode_attention(
      q, index, policy=policy, rng=jax.random.key(0), return_residual=True
    )
    self._check_rows(policy, q, k, *result)

  @parameterized.parameters(*POLICIES, jaxtopk.Certified(0.05))
  def test_chunk_rows_against_float64(self, policy):
    # CHUNK_MIN_STEPS steps or more: the blockwise prefill with the causal
    # offset (MC-Search, which it refuses, stays on the folded rows).
    q, k, cache = _data(4, CHUNK_LENGTHS, CHUNK)
    with _every_kind():
      result = jaxtopk.decode_attention(
        q, cache, policy=policy, rng=jax.random.key(0), return_residual=True
      )
    self._check_rows(policy, q, k, *result, CHUNK_LENGTHS, CHUNK)

  def test_chunk_takes_the_blockwise_prefill(self):
    q, _, cache = _data(5, CHUNK_LENGTHS, CHUNK + 1)  # a shape not compiled
    with mock.patch.object(_decode, "_step", side_effect=AssertionError):
      jaxtopk.decode_attention(q, cache, policy=jaxtopk.Certified(0.05))
      with _every_kind():
        jaxtopk.decode_attention(q, cache, policy=jaxtopk.FixedK(3))

  def test_chunk_equals_one_shot_prefill(self):
    # The newest CHUNK steps over the cache are the last CHUNK rows of a
    # causal prefill of each whole sequence.
    q_all, k, cache = _data(6, CHUNK_LENGTHS, N)
    eye = np.eye(N, dtype=np.float32)[None, :, None, :]
    for policy in (jaxtopk.FixedK(3),):  # (Dense() shares the engine)
      for b, length in enumerate(CHUNK_LENGTHS):
        whole = jaxtopk.topk_attention(
          q_all[b : b + 1, :length],
          k[b : b + 1, :length],
          eye[:, :length],
          policy=policy,
          is_causal=True,
        )[0]
        q = np.zeros((B, CHUNK, H, D), np.float32)
        first = max(length - CHUNK, 0)
        q[b, CHUNK - (length - first) :] = q_all[b, first:length]
        with _every_kind():
          out = jaxtopk.decode_attention(q, cache, policy=policy)[0]
        np.testing.assert_allclose(
          out[b, CHUNK - (length - first) :],
          whole[0, first:],
          atol=1e-6,
        )

  def _check_rows(
    self, policy, q, k, out, lse, cert, lengths=LENGTHS, q_len=Q_LEN
  ):
    """Every row against its float64 truth (one-hot values: an output row
    is its weights, so its kept set is where it is positive)."""
    self.assertEqual(out.shape, (B, q_len, H, N))
    self.assertEqual(lse.shape, (B, q_len, H))
    self.assertEqual(lse.dtype, jnp.float32)
    self.assertEqual(cert.shape, (B, q_len, H))
    for b in range(B):
      for i in range(q_len):
        limit = lengths[b] - q_len + 1 + i  # positions <= its own
        for h in range(H):
          o = truth.as64(out[b, i, h])
          c = jax.tree.map(lambda x, b=b, i=i, h=h: x[b, i, h], cert)
          if limit <= 0:  # before the first key: no real key
            self.assertFalse(bool(c.valid))
            np.testing.assert_array_equal(o, 0.0)
            self.assertEqual(float(lse[b, i, h]), LOG0)
            continue
          self.assertTrue(bool(c.valid), (b, i, h))
          np.testing.assert_array_equal(o[limit:], 0.0)  # causal
          s = _logits(q, k, b, i, h, limit)
          real = np.ones(limit, bool)
          keep = o[:limit] > 0
          self.assertEqual(int(c.k_kept), int(keep.sum()))
          if isinstance(policy, jaxtopk.FixedK | jaxtopk.Ratio):
            want = (
              policy.num_kept(limit)
              if isinstance(policy, jaxtopk.Ratio)
              else min(3, limit)
            )
            want = int(min(max(want, 1), limit))
            self.assertEqual(int(keep.sum()), want)
            np.testing.assert_array_equal(keep, truth.topk_keep(s, want, real))
          # Output: the softmax renormalised on the kept set.
          p = truth.probs(s, real)
          np.testing.assert_allclose(
            o[:limit], truth.truncated(p, keep), atol=1e-6
          )
          # lse: the log-sum-exp of the kept logits.
          np.testing.assert_allclose(
            float(lse[b, i, h]), logsumexp(s[keep]), rtol=1e-6, atol=1e-6
          )
          # Certificate sound against the float64 truth of this row.
          tau = np.exp(truth.log_tau(s, keep, real))
          self.assertGreaterEqual(float(c.tv_bound), tau - N * TINY)
          err = truth.output_error(s, keep, np.eye(limit, N), real)
          self.assertGreaterEqual(
            float(c.output_error_bound), err - 16 * 1.2e-7
          )
          if isinstance(policy, jaxtopk.Certified):
            if int(c.k_kept) < (policy.max_topk or N):
              self.assertLessEqual(float(c.tv_bound), policy.eps)

  def test_steps_equal_single_query_calls(self):
    # Step i of a q_len-3 call is the q_len-1 call over the cache as it was
    # when that step was appended (the same summaries, a shorter length);
    # q_len = 1 with the residual returns the plain call's results.
    q, _, cache = _data(1)
    policy = POLICIES[2]  # compiled once with test_rows_against_float64
    kw = dict(policy=policy, return_residual=True)
    out, lse, cert = jaxtopk.decode_attention(q, cache, **kw)
    for i in range(Q_LEN):
      length = jnp.maximum(cache.length - (Q_LEN - 1 - i), 0)
      past = dataclasses.replace(cache, length=length)
      o1, l1, c1 = jaxtopk.decode_attention(q[:, i : i + 1], past, **kw)
      np.testing.assert_allclose(out[:, i], o1[:, 0], rtol=1e-6, atol=1e-7)
      np.testing.assert_allclose(lse[:, i], l1[:, 0], rtol=1e-6)
      np.testing.assert_array_equal(cert.valid[:, i], c1.valid[:, 0])
      np.testing.assert_array_equal(cert.k_kept[:, i], c1.k_kept[:, 0])
      np.testing.assert_allclose(
        cert.tv_bound[:, i], c1.tv_bound[:, 0], rtol=1e-6
      )
    o0, c0 = jaxtopk.decode_attention(q[:, i : i + 1], past, policy=policy)
    np.testing.assert_array_equal(o0, o1)
    for a, b in zip(jax.tree.leaves(c0), jax.tree.leaves(c1), strict=True):
      np.testing.assert_array_equal(a, b)


class MergeTest(parameterized.TestCase):
  def _parts(self, policy):
    """A chunk of Q_LEN steps: prefill over the cache's first 24 positions
    (all before the chunk) and causal decode over the rest (ending with
    the chunk), each with its residual."""
    lengths = (40, 30)
    q, k, cache = _data(3, lengths)
    cut = 24
    eye = jnp.broadcast_to(jnp.eye(N)[None, :, None, :], (B, N, HK, N))
    first = jaxtopk.topk_attention(
      q, k[:, :cut], eye[:, :cut], policy=policy, return_residual=True
    )
    rest = jaxtopk.KVCache.create(B, N, HK, D, block_size=BS, value_dim=N)
    rest = rest.append(
      k[:, cut:],
      eye[:, cut:],
      num_steps=jnp.array(lengths) - cut,
    )
    second = jaxtopk.decode_attention(
      q, rest, policy=jaxtopk.Dense(), return_residual=True
    )
    return q, k, cache, lengths, first, second

  def test_dense_halves_equal_the_whole(self):
    _, _, cache, _, first, second = self._parts(jaxtopk.Dense())
    q = _data(3, (40, 30))[0]
    out, lse, cert = jaxtopk.merge_attention(first, second)
    whole, lse_w, cert_w = jaxtopk.decode_attention(
      q, cache, policy=jaxtopk.Dense(), return_residual=True
    )
    np.testing.assert_allclose(out, whole, atol=1e-6)
    np.testing.assert_allclose(lse, lse_w, rtol=1e-6)
    np.testing.assert_array_equal(cert.valid, cert_w.valid)
    np.testing.assert_array_equal(cert.k_kept, cert_w.k_kept)
    np.testing.assert_array_equal(cert.tv_bound, 0.0)
    # An empty part (no real key) is the identity.
    empty = jaxtopk.KVCache.create(B, N, HK, D, block_size=BS, value_dim=N)
    nothing = jaxtopk.decode_attention(
      q, empty, policy=jaxtopk.Dense(), return_residual=True
    )
    np.testing.assert_array_equal(nothing[1], LOG0)
    out2, lse2, cert2 = jaxtopk.merge_attention((out, lse, cert), nothing)
    np.testing.assert_array_equal(out2, out)
    np.testing.assert_array_equal(lse2, lse)
    np.testing.assert_array_equal(cert2.valid, cert.valid)

  def test_certified_merge_is_sound(self):
    policy = jaxtopk.Certified(0.05)
    q, k, _, lengths, first, second = self._parts(policy)
    out, lse, cert = jaxtopk.merge_attention(first, second)
    for b in range(B):
      for i in range(Q_LEN):
        limit = lengths[b] - Q_LEN + 1 + i
        for h in range(H):
          c = jax.tree.map(lambda x, b=b, i=i, h=h: x[b, i, h], cert)
          self.assertTrue(bool(c.valid))
          s = _logits(q, k, b, i, h, limit)
          real = np.ones(limit, bool)
          o = truth.as64(out[b, i, h])
          keep = o[:limit] > 0
          self.assertEqual(int(c.k_kept), int(keep.sum()))
          tau = np.exp(truth.log_tau(s, keep, real))
          self.assertGreaterEqual(float(c.tv_bound), tau - N * TINY)
          self.assertLessEqual(float(c.tv_bound), policy.eps)
          err = truth.output_error(s, keep, np.eye(limit, N), real)
          self.assertGreaterEqual(
            float(c.output_error_bound), err - 16 * 1.2e-7
          )
          p = truth.probs(s, real)
          np.testing.assert_allclose(
            o[:limit], truth.truncated(p, keep), atol=1e-6
          )
          np.testing.assert_allclose(
            float(lse[b, i, h]), logsumexp(s[keep]), rtol=1e-6
          )

  def test_bad_parts(self):
    x = jnp.zeros((1, 2, 3))
    cert = jaxtopk.decode_attention(
      jnp.ones((1, 1, 1, 4)),
      jaxtopk.KVCache.create(1, 8, 1, 4, block_size=4),
      policy=jaxtopk.Dense(),
    )[1]
    with self.assertRaisesRegex(TypeError, "triple"):
      jaxtopk.merge_attention((x, cert), (x, x, cert))
    with self.assertRaisesRegex(ValueError, "agree"):
      jaxtopk.merge_attention((x, x, cert), (x, x, cert))


class RefusalTest(parameterized.TestCase):
  def test_one_step_ops_refuse_by_name(self):
    policy = jaxtopk.Dense()  # honoured by every decode op
    for name, op in registry.OPS.items():
      if op.kind != "decode":
        continue
      for arg, fragment in (
        ("multi_query", "q_len"),
        ("return_residual", "return_residual"),
      ):
        error = op.refusal(policy, given=frozenset({arg}))
        if arg in op.arguments:
          self.assertNotIsInstance(
            error, NotImplementedError, f"{name} {arg}: {error}"
          )
        else:
          self.assertIsInstance(error, NotImplementedError, name)
          self.assertIn(fragment, str(error), name)

  def test_sequence_falls_through(self):
    q, _, cache = _data()
    kw = dict(policy=POLICIES[0], return_residual=True)
    want = jaxtopk.decode_attention(q, cache, **kw)
    got = jaxtopk.decode_attention(
      q, cache, implementation=("sharded", "xla"), **kw
    )
    np.testing.assert_array_equal(got[0], want[0])
    policy = POLICIES[0]
    with self.assertRaisesRegex(NotImplementedError, "q_len"):
      jaxtopk.decode_attention(
        q, cache, policy=policy, implementation="sharded"
      )


if __name__ == "__main__":
  absltest.main()
