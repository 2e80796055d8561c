"""decode_attention over the key codes (THEORY 3.5) vs float64 truth.

The key-code path of the XLA decode (``bound='codes'``, and ``Auto`` on
caches of ``AUTO_MIN_KEYS`` positions or more): soundness on the
adversarial rows of ``decode_property_test`` (identity values: the output
is P_hat), the honest cost in ``keys_scored``, and Auto's choice per row.
"""

import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import jaxtopk
from jaxtopk.attention import _decode
from jaxtopk.attention import _paged
from jaxtopk.selection import key_codes
from tests.attention import decode_property_test as dpt
from tests.attention.retrace import fresh_decode

_CI_EXAMPLES = (
  settings.default.max_examples
  if os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci"
  else 12
)
_AUTO_EXAMPLES = (
  settings.default.max_examples
  if os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci"
  else 8
)

CODES = (
  jaxtopk.Certified(0.05, jaxtopk.DeltaSearch(bound=jaxtopk.Codes())),
  jaxtopk.Certified(
    0.01, jaxtopk.DeltaSearch(bound=jaxtopk.Codes()), max_topk=4
  ),
)


def _check_row(test, out, cert, q, k, length, policy, dt):
  """The assertions of ``decode_property_test`` for every head."""
  q64 = np.asarray(jnp.asarray(q, dt).astype(jnp.float32), np.float64)
  k64 = np.asarray(jnp.asarray(k, dt).astype(jnp.float32), np.float64)
  n = k.shape[0]
  x = np.abs(np.concatenate([q64.ravel(), k64[:length].ravel()]))
  benign = bool(np.all((x == 0) | ((x >= dpt.TINY) & (x < 1e6))))
  eps_out = float(jnp.finfo(dt).eps)
  for h in range(q.shape[0]):
    s = k64[:length] @ q64[h] / np.sqrt(q.shape[1])
    p = np.zeros(n)
    p[:length] = np.exp(s - s.max()) / np.sum(np.exp(s - s.max()))
    o = np.asarray(out[0, 0, h].astype(jnp.float32), np.float64)
    c = jax.tree.map(lambda x, h=h: x[0, 0, h], cert)
    kept = int(c.k_kept)
    test.assertLessEqual(int(np.sum(o > 0)), kept)
    if policy.max_topk is not None:
      test.assertLessEqual(kept, policy.max_topk)
    if not bool(c.valid):
      normal = np.all(np.isfinite(s)) and np.all(np.abs(s) < 3e38)
      test.assertFalse(normal, f"invalid normal row {s[:6]}")
      continue
    tv = float(c.tv_bound)
    tau = float(np.sum(p[o <= 0]))
    slack = n * dpt.TINY
    test.assertGreaterEqual(tv, tau - slack)
    err = float(np.linalg.norm(p - o))
    rnd = 16 * eps_out * max(float(np.linalg.norm(o)), dpt.TINY)
    test.assertGreaterEqual(float(c.output_error_bound), err - rnd - slack)
    capped = policy.max_topk is not None and kept >= policy.max_topk
    if np.isfinite(tv) and not capped and benign:
      test.assertLessEqual(tv, policy.eps)


class CodesDecodeTest(parameterized.TestCase):
  @pytest.mark.slow  # 4 compilations, 12 examples in CI
  @settings(max_examples=_CI_EXAMPLES)
  @given(
    row=dpt.decode_rows(),
    which=st.integers(0, len(CODES) - 1),
    bf16=st.booleans(),
  )
  def test_certificate_sound_vs_float64(self, row, which, bf16):
    q, k, length = row
    policy = CODES[which]
    dt = jnp.bfloat16 if bf16 else jnp.float32
    out, cert = dpt._decode(q, k, length, policy, dt)
    _check_row(self, out, cert, q, k, length, policy, dt)

  def test_cost_counts_the_codes(self):
    # Peaked row: few candidates; keys_scored = ceil(n (d + 1) / (4 d)) +
    # the candidates scored, well below n; the kept keys are scored ones.
    rng = np.random.default_rng(0)
    k = np.float32(rng.normal(size=(dpt.N, dpt.D)) * 4)
    q = np.float32(rng.normal(size=(dpt.H, dpt.D)))
    policy = CODES[0]
    out, cert = dpt._decode(q, k, dpt.N, policy, jnp.float32)
    code = int(key_codes.code_cost(dpt.N, dpt.D, jnp.float32))
    scored = np.asarray(cert.keys_scored[0, 0])
    kept = np.asarray(cert.k_kept[0, 0])
    self.assertTrue(np.all(scored >= code + kept), (scored, kept))
    self.assertTrue(np.all(scored < dpt.N), scored)
    _check_row(self, out, cert, q, k, dpt.N, policy, jnp.float32)


class AutoDecodeTest(parameterized.TestCase):
  """Auto on a cache of AUTO_MIN_KEYS positions: each row's sample chooses,
  the batch runs the most general choice."""

  N = _decode.AUTO_MIN_KEYS

  def _decode(self, q, k):
    # One kv head per query head: each row decides for itself (heads of a
    # GQA group share their kv head's choice).
    n, d = k.shape
    h = q.shape[0]
    cache = jaxtopk.KVCache.create(1, n, h, d, block_size=64, value_dim=n)
    kk = jnp.broadcast_to(jnp.asarray(k)[None, :, None], (1, n, h, d))
    eye = jnp.eye(n, dtype=jnp.float32)[None, :, None]
    cache = cache.append(kk, jnp.broadcast_to(eye, (1, n, h, n)))
    return jaxtopk.decode_attention(
      jnp.asarray(q)[None, None], cache, policy=jaxtopk.Certified(0.05)
    )

  def test_the_batch_takes_the_codes_only_when_every_row_chose_them(self):
    rng = np.random.default_rng(1)
    d = 8
    k = np.float32(rng.normal(size=(self.N, d)))
    flat = rng.normal(size=d) * 1e-3  # (tiny query: every logit ~0)
    policy = jaxtopk.Certified(0.05)
    sample = int(key_codes.code_cost(_decode.AUTO_SAMPLE, 8, jnp.float32))
    # Both heads peaked: the codes save on each.
    q = np.float32(np.stack([k[7] * 8.0, k[300] * 8.0]))
    out, cert = self._decode(q, k)
    scored = np.asarray(cert.keys_scored[0, 0])
    _check_row(self, out, cert, q, k, self.N, policy, jnp.float32)
    if jax.default_backend() not in _decode.AUTO_CODES_PLATFORMS:
      # Where the codes were measured not to pay, Auto scores every key.
      np.testing.assert_array_equal(scored, self.N)
      return
    self.assertTrue(np.all(scored < self.N // 2), scored)
    self.assertTrue(np.all(scored > sample), scored)
    # Head 0 flat, head 1 peaked: the batch keeps every key of both rows
    # (tv 0), each row's sample counted (one program: the same shapes).
    q = np.float32(np.stack([flat, k[7] * 8.0]))
    out, cert = self._decode(q, k)
    np.testing.assert_array_equal(cert.keys_scored[0, 0], self.N + sample)
    np.testing.assert_array_equal(cert.k_kept[0, 0], self.N)
    np.testing.assert_array_equal(cert.tv_bound[0, 0], 0.0)
    _check_row(self, out, cert, q, k, self.N, policy, jnp.float32)

  @settings(max_examples=_AUTO_EXAMPLES)
  @given(row=dpt.decode_rows())
  def test_auto_sound_vs_float64(self, row):
    # The adversarial rows, tiled to AUTO_MIN_KEYS keys and zero-padded to
    # d = 8 (the program of the test above): the heads' samples choose
    # the codes, every key kept or (mixed) the batch's most general
    # branch; each must be sound.
    q, k, _ = row
    pad = ((0, 0), (0, 8 - k.shape[1]))
    reps = self.N // k.shape[0]
    q, k = (np.float32(np.pad(x, pad)) for x in (q, np.tile(k, (reps, 1))))
    out, cert = self._decode(q, k)
    policy = jaxtopk.Certified(0.05)
    _check_row(self, out, cert, q, k, self.N, policy, jnp.float32)

  def test_a_capped_row_is_never_kept_whole(self):
    # max_topk caps the kept set: a flat row runs the exact search.
    rng = np.random.default_rng(3)
    d = 8
    k = jnp.float32(rng.normal(size=(1, self.N, 1, d)))
    q = jnp.float32(rng.normal(size=(1, 1, 1, d)) * 1e-3)
    cache = jaxtopk.KVCache.create(1, self.N, 1, d).append(k, k)
    for policy, want in [
      (jaxtopk.Certified(0.05), _decode._ALL),
      (jaxtopk.Certified(0.05, max_topk=16), _decode._EXACT),
    ]:
      choice, _ = _decode._sample_choice(policy, q, cache, d**-0.5)
      self.assertEqual(int(choice[0, 0]), want, policy)

  def test_large_groups_run_the_exact_search(self):
    # Concentrated rows: the codes with one query per kv head; with more
    # than AUTO_CODES_MAX_GROUP per kv head the exact search, over a
    # contiguous and a paged cache.
    rng = np.random.default_rng(4)
    d, g = 8, _decode.AUTO_CODES_MAX_GROUP + 1
    k = jnp.float32(rng.normal(size=(1, self.N, 1, d)))
    q = jnp.broadcast_to(k[0, 7, 0] * 8.0, (1, 1, g, d))
    policy = jaxtopk.Certified(0.05)
    cache = jaxtopk.KVCache.create(1, self.N, 1, d).append(k, k)
    ps = 64
    paged = jaxtopk.PagedKVCache.create(
      1, self.N // ps, ps, 1, d, max_pages_per_seq=self.N // ps
    ).append(k, k)
    for query, c, want in [
      (q[:, :, :1], cache, _decode._CODES),
      (q, cache, _decode._EXACT),
      (q[:, :, :1], _paged._view(paged), _decode._CODES),
      (q, _paged._view(paged), _decode._EXACT),
    ]:
      choice, _ = _decode._sample_choice(policy, query, c, d**-0.5)
      self.assertEqual(int(choice[0, 0]), want, (query.shape, type(c.keys)))

  def test_concentrated_rows_over_tight_boxes_take_the_box_search(self):
    # Keys in tight clusters of one block each, queries aimed at one: the
    # block boxes certify within SEARCH_CAPACITY of the blocks, so Auto
    # scores those blocks only, over a paged cache with 1 query head per kv
    # head (the codes' fallback) and a contiguous one with 4 (the exact
    # search's).
    rng = np.random.default_rng(5)
    d, ps = 8, 64
    centre = rng.normal(size=(self.N // ps, d)) * 2
    k = np.repeat(centre, ps, 0) + 0.05 * rng.normal(size=(self.N, d))
    k = jnp.float32(k)[None, :, None]  # [1, N, 1, d]
    policy = jaxtopk.Certified(0.05)
    cache = jaxtopk.KVCache.create(1, self.N, 1, d, value_dim=self.N)
    eye = jnp.eye(self.N, dtype=jnp.float32)[None, :, None]
    cache = cache.append(k, eye)
    paged = jaxtopk.PagedKVCache.create(
      1, self.N // ps, ps, 1, d, max_pages_per_seq=self.N // ps,
      value_dim=self.N,
    ).append(k, eye)  # fmt: skip
    for g, c in ((1, paged), (4, cache)):
      q = np.float32(np.stack([centre[3 + 3 * i] * 6.0 for i in range(g)]))
      out, cert = jaxtopk.decode_attention(
        jnp.asarray(q)[None, None], c, policy=policy
      )
      scored = np.asarray(cert.keys_scored[0, 0])
      bound = (_decode.SEARCH_CAPACITY + 0.1) * self.N
      self.assertTrue(np.all(scored < bound), (g, type(c), scored))
      _check_row(self, out, cert, q, k[0, :, 0], self.N, policy, jnp.float32)

  def test_rows_the_codes_miss_are_redone_exactly_at_their_cost(self):
    # The safety net: where a row's finished bound from the codes misses
    # eps (rounding past the margins; forced here), the batch runs the
    # exact search, whose keys_scored adds what the codes, the sample and
    # the box stage already cost. (Its own program: the decode's compiled
    # ones stay as they are.)
    rng = np.random.default_rng(6)
    d, h = 8, 2
    k = np.float32(rng.normal(size=(self.N, d)))
    q = np.float32(np.stack([k[7] * 8.0, k[300] * 8.0]))  # codes pay
    cache = jaxtopk.KVCache.create(1, self.N, h, d, value_dim=self.N)
    kk = jnp.broadcast_to(jnp.asarray(k)[None, :, None], (1, self.N, h, d))
    eye = jnp.eye(self.N, dtype=jnp.float32)[None, :, None]
    cache = cache.append(kk, jnp.broadcast_to(eye, (1, self.N, h, self.N)))
    policy = jaxtopk.Certified(0.05)
    attempt = _decode._codes_attempt

    def missed(*args, **kw):
      result, _, cost = attempt(*args, **kw)
      return result, jnp.bool_(True), cost

    def auto(q, cache):
      done = _decode._codes_rows(policy, q, cache, d**-0.5)
      out, cert, _ = _decode._final(done)
      return out.reshape(1, 1, h, -1), jax.tree.map(
        lambda x: x.reshape(1, 1, h), cert
      )

    with mock.patch.object(_decode, "_codes_attempt", missed):
      out, cert = jax.jit(auto)(jnp.asarray(q)[None, None], cache)
    _check_row(self, out, cert, q, k, self.N, policy, jnp.float32)
    code = int(key_codes.code_cost(self.N, d, jnp.float32))
    sample = int(key_codes.code_cost(_decode.AUTO_SAMPLE, d, jnp.float32))
    scored = np.asarray(cert.keys_scored[0, 0])
    self.assertTrue(np.all(scored >= self.N + code + sample), scored)
    self.assertTrue(np.all(scored < 2 * self.N), scored)

  def test_platforms_without_the_codes_run_the_exact_search(self):
    rng = np.random.default_rng(2)
    d = 8
    k = np.float32(rng.normal(size=(self.N, d)))
    q = np.float32(k[3:4] * 8.0)  # peaked: the codes would pay on CPU
    # The choice is made when the decode is traced: traced afresh.
    with mock.patch.object(_decode, "AUTO_CODES_PLATFORMS", ()), fresh_decode():
      out, cert = self._decode(q, k)
    self.assertEqual(int(cert.keys_scored[0, 0, 0]), self.N)  # no sample
    _check_row(
      self, out, cert, q, k, self.N, jaxtopk.Certified(0.05), jnp.float32
    )


if __name__ == "__main__":
  absltest.main()
