"""KVCache and decode_attention: summaries, agreement with topk_attention."""

import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized

import jaxtopk
from jaxtopk.attention import _decode
from jaxtopk.theory import _blockwise
from tests import rand
from tests.tolerances import tol

B, HKV, H, D, DV = 3, 2, 6, 5, 7
N, BS = 1024, 32  # capacity and block size (candidate path needs n >= 32 k)
LENGTHS = (1024, 700, 13)  # every batch row a different fill


@pytest.fixture(autouse=True, scope="module")
def _candidate_path():
  """The bracket / candidate path at N = 1024 (by default caches shorter
  than ``CANDIDATE_MIN_KEYS`` take the full row; the full row also runs
  here, where the candidates do not fit)."""
  with mock.patch.object(_decode, "CANDIDATE_MIN_KEYS", 0):
    yield


def _filled_cache(seed=0, clustered=False):
  """(cache filled in 3 chunks to N, cache with rows of LENGTHS, k, v)."""
  rng = rand.generator(seed)
  k = rng.standard_normal((B, N, HKV, D))
  v = rng.standard_normal((B, N, HKV, DV))
  if clustered:  # keys drift slowly, so block boxes are informative
    drift = np.cumsum(rng.standard_normal((B, N // BS, 1, D)), 1)
    k = 0.2 * k + 3 * np.repeat(drift, BS, 1)
  k, v = (jax.device_put(x.astype(np.float32)) for x in (k, v))
  empty = lambda: jaxtopk.KVCache.create(
    B, N, HKV, D, block_size=BS, value_dim=DV
  )
  full = empty()
  for lo, hi in ((0, 333), (333, 334), (334, N)):
    full = full.append(k[:, lo:hi], v[:, lo:hi])
  rows = empty().append(k, v, num_steps=jnp.array(LENGTHS))
  return full, rows, k, v


class CacheTest(parameterized.TestCase):
  def test_summaries_match_box_summary(self):
    cache, _, k, v = _filled_cache()
    np.testing.assert_array_equal(cache.length, N)
    kh = k.transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(cache.keys, kh)
    box = _blockwise.box_summary(kh, block_size=BS)
    np.testing.assert_array_equal(cache.kmin, box.kmin)
    np.testing.assert_array_equal(cache.kmax, box.kmax)
    vn = np.linalg.norm(np.asarray(v, np.float64), axis=-1)  # [b, n, hk]
    vn = vn.transpose(0, 2, 1).reshape(B, HKV, N // BS, BS).max(-1)
    self.assertTrue(np.all(cache.vnorm >= vn))
    np.testing.assert_allclose(cache.vnorm, vn, rtol=1e-5)

  def test_rows_of_different_lengths(self):
    _, cache, k, _ = _filled_cache()
    np.testing.assert_array_equal(cache.length, LENGTHS)
    cnt = np.asarray(cache.block_count())[:, 0]
    np.testing.assert_array_equal(cnt.sum(-1), LENGTHS)
    # Sliced in numpy (each new jax slice compiles).
    k, kmin, kmax, keys = map(
      np.asarray, (k, cache.kmin, cache.kmax, cache.keys)
    )
    for b, n in enumerate(LENGTHS):
      box = _blockwise.box_summary(k[b, :n].transpose(1, 0, 2), block_size=BS)
      nb = box.kmin.shape[1]
      np.testing.assert_array_equal(kmin[b, :, :nb], box.kmin)
      np.testing.assert_array_equal(kmax[b, :, :nb], box.kmax)
      self.assertTrue(np.all(np.isinf(kmin[b, :, nb:])))
      np.testing.assert_array_equal(keys[b, :, n:], 0.0)

  def test_overflow_drops_and_saturates(self):
    cache = jaxtopk.KVCache.create(1, 32, 1, 3, block_size=16)
    x = jnp.ones((1, 40, 1, 3))
    cache = cache.append(x, x)
    np.testing.assert_array_equal(cache.length, [32])
    np.testing.assert_array_equal(cache.kmax, 1.0)

  @parameterized.named_parameters(
    ("len", lambda: jaxtopk.KVCache.create(1, 30, 1, 3, block_size=16), "30"),
    ("neg", lambda: jaxtopk.KVCache.create(0, 32, 1, 3), "batch=0"),
  )
  def test_bad_init(self, make, fragment):
    with self.assertRaisesRegex(ValueError, fragment):
      make()

  def test_bad_update(self):
    cache = jaxtopk.KVCache.create(2, 32, 1, 3, block_size=16)
    with self.assertRaisesRegex(ValueError, "keys must be"):
      cache.append(jnp.ones((2, 1, 2, 3)), jnp.ones((2, 1)))

  @parameterized.named_parameters(
    # [2] for a batch of 2 rows of 1 used to corrupt ``length``; a Python
    # int raised an IndexError naming nothing (now: one count for all).
    ("shape", np.array([1, 2, 1]), ValueError, "num_steps must be"),
    ("float", np.array([1.0, 2.0]), TypeError, "num_steps.dtype=float64"),
    ("bool", True, TypeError, "num_steps=True"),
    ("range", np.array([0, 3]), ValueError, r"num_steps=\[0, 3\]"),
    ("negative", -1, ValueError, r"num_steps=-1 must be in \[0, 2\]"),
  )
  def test_bad_num_steps(self, num_steps, exc, fragment):
    cache = jaxtopk.KVCache.create(2, 32, 1, 3, block_size=16)
    x = jnp.ones((2, 2, 1, 3))
    with self.assertRaisesRegex(exc, fragment):
      cache.append(x, x, num_steps=num_steps)

  def test_num_steps_scalar_and_traced(self):
    cache = jaxtopk.KVCache.create(2, 32, 1, 3, block_size=16)
    x = jnp.ones((2, 2, 1, 3))
    got = jax.tree.map(jnp.copy, cache).append(x, x, num_steps=1)
    np.testing.assert_array_equal(got.length, [1, 1])
    f = jax.jit(lambda c, n: c.append(x, x, num_steps=n))
    got = f(cache, jnp.array([5, 1]))  # traced: clipped to [0, steps]
    np.testing.assert_array_equal(got.length, [2, 1])

  @parameterized.named_parameters(
    ("complex", np.complex64, "keys must be real floating"),
    ("int", np.int32, "keys must be real floating"),
  )
  def test_non_real_keys_refused(self, dtype, fragment):
    # Complex keys were silently cast to their real part.
    cache = jaxtopk.KVCache.create(1, 16, 1, 3, block_size=16)
    x = np.ones((1, 1, 1, 3), np.float32)
    with self.assertRaisesRegex(TypeError, fragment):
      cache.append(x.astype(dtype), x)
    with self.assertRaisesRegex(TypeError, "values must be real floating"):
      cache.append(x, x.astype(dtype))


def _reference(q, k, v, policy):
  """topk_attention over each row's filled prefix, as the decode oracle."""
  mask = (jnp.arange(N)[None, :] < jnp.array(LENGTHS)[:, None])[
    :, None, None, :
  ]
  return jaxtopk.topk_attention(q, k, v, policy=policy, mask=mask)


class DecodeTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("fixedk_candidates", jaxtopk.FixedK(5)),  # sub-block candidate path
    ("ratio_full_row", jaxtopk.Ratio(1 / 8)),  # one radix over the row
    ("dense", jaxtopk.Dense()),
    ("certified_exact", jaxtopk.Certified(0.05, "exact")),
  )
  def test_matches_topk_attention(self, policy):
    _, cache, k, v = _filled_cache()
    q = 2 * rand.normal(7, (B, 1, H, D))
    out, cert = jaxtopk.decode_attention(q, cache, policy=policy)
    ref, rcert = _reference(q, k, v, policy)
    self.assertEqual(cert.tv_bound.shape, (B, 1, H))
    if isinstance(policy, jaxtopk.Certified):
      # Decode keeps the fewest keys up to one fine histogram bin; the
      # prefill's tiles up to one coarse bin (threshold.COARSE_BINS): a few
      # more keys, never fewer here. Both are within their output bounds
      # of dense attention, hence of each other.
      self.assertTrue(np.all(cert.k_kept <= rcert.k_kept))
      self.assertTrue(np.all(cert.tv_bound <= policy.eps))
      self.assertTrue(np.all(rcert.tv_bound <= policy.eps))
      gap = np.linalg.norm(np.asarray(out - ref, np.float64), axis=-1)
      bound = cert.output_error_bound + rcert.output_error_bound
      self.assertTrue(np.all(gap <= np.asarray(bound) + 1e-6))
      return
    np.testing.assert_allclose(out, ref, **tol(jnp.float32))
    np.testing.assert_array_equal(cert.k_kept, rcert.k_kept)
    np.testing.assert_allclose(cert.tv_bound, rcert.tv_bound, rtol=1e-4)

  @parameterized.named_parameters(
    ("fixedk", jaxtopk.FixedK(5)),
    ("certified_exact", jaxtopk.Certified(0.05, "exact")),
  )
  def test_short_caches_take_the_full_row(self, policy):
    # Below CANDIDATE_MIN_KEYS: one path, a smaller program, same result.
    _, cache, _, _ = _filled_cache()
    q = 2 * rand.normal(7, (B, 1, H, D))
    runs = {}
    for min_keys in (0, N + 1):  # candidates tried, then the full row only
      with mock.patch.object(_decode, "CANDIDATE_MIN_KEYS", min_keys):
        fn = jax.jit(lambda q, c: jaxtopk.decode_attention(q, c, policy=policy))
        runs[min_keys] = (fn(q, cache), len(fn.lower(q, cache).as_text()))
    (out, cert), size = runs[N + 1]
    (ref, rcert), ref_size = runs[0]
    self.assertLess(size, 0.75 * ref_size)
    np.testing.assert_allclose(out, ref, **tol(jnp.float32))
    np.testing.assert_array_equal(cert.k_kept, rcert.k_kept)
    np.testing.assert_allclose(cert.tv_bound, rcert.tv_bound, rtol=1e-4)

  def test_candidates_keeping_more_than_the_gather_capacity(self):
    # 60 near-equal large logits, the rest far below: the candidates fit
    # (<= 2 N / 32 + 16) but the kept set exceeds the gather capacity (N /
    # 32 = 32 keys). The candidate path then takes the dense value product;
    # the full-row path is poisoned here, so a fallback to it would show.
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 1, 1, D)).astype(np.float32)
    u = q[0, 0, 0] / np.linalg.norm(q)
    k = rng.standard_normal((1, N, 1, D)) * 0.01 - 10 * u
    k[0, ::17, 0] = 10 * u + 0.01 * rng.standard_normal((N // 17 + 1, D))
    v = rng.standard_normal((1, N, 1, DV))
    k, v = k.astype(np.float32), v.astype(np.float32)
    cache = jaxtopk.KVCache.create(1, N, 1, D, block_size=BS, value_dim=DV)
    cache = cache.append(k, v)
    orig = _decode._full_row

    def poisoned(st, keep, capacity):
      part = orig(st, keep, capacity)
      return dataclasses.replace(part, o=part.o * jnp.nan)

    policy = jaxtopk.Certified(0.05, "exact")
    with (
      mock.patch.object(_decode, "CANDIDATE_MIN_KEYS", 0),
      mock.patch.object(_decode, "_full_row", poisoned),
    ):
      out, cert = jaxtopk.decode_attention(q, cache, policy=policy)
    self.assertGreater(int(cert.k_kept[0, 0, 0]), N // 32)
    self.assertTrue(bool(cert.valid[0, 0, 0]))
    self.assertLessEqual(float(cert.tv_bound[0, 0, 0]), 0.05)
    s = (k[0, :, 0].astype(np.float64) @ q[0, 0, 0]) / np.sqrt(D)
    p = np.exp(s - s.max())
    dense = (p / p.sum()) @ v[0, :, 0].astype(np.float64)
    gap = np.linalg.norm(np.asarray(out[0, 0, 0], np.float64) - dense)
    self.assertLessEqual(gap, float(cert.output_error_bound[0, 0, 0]))

  def test_ties_in_candidate_path_sound(self):
    # Many identical keys: exact ties across sub-blocks and at the threshold.
    cache = jaxtopk.KVCache.create(1, N, 1, D, block_size=BS)
    base = rand.normal(1, (7, D))
    k = base[jnp.arange(N) % 7][None, :, None, :]
    cache = cache.append(k, k)
    q = rand.normal(2, (1, 1, 1, D))
    topk = 200  # 200 of 1024: several tied groups straddle the threshold
    # Jitted: one program, not a hundred eager ops.
    idx, kept, thresh = jax.jit(
      lambda keys, q: _decode.topk_indices(
        (keys[0, 0] @ q[0, 0, 0]).astype(jnp.float32)[None],
        jnp.array([topk]),
        jnp.ones((1, N), bool),
        256,
      )
    )(cache.keys, q)
    self.assertEqual(len(set(np.asarray(idx[0][kept[0]]).tolist())), topk)
    _, cert = jaxtopk.decode_attention(
      q, cache, policy=jaxtopk.FixedK(topk), scale=1.0
    )
    s = np.asarray(base, np.float64) @ np.asarray(q[0, 0, 0], np.float64)
    row = s[np.arange(N) % 7]
    e = np.exp(row - row.max())
    tau = np.sort(e)[: N - topk].sum() / e.sum()
    self.assertGreaterEqual(float(cert.tv_bound[0, 0, 0]), tau)
    np.testing.assert_allclose(cert.tv_bound[0, 0, 0], tau, rtol=1e-4)

  @parameterized.parameters("delta", "mc")
  def test_search_sound_and_skips_blocks(self, search):
    _, cache, k, v = _filled_cache(clustered=True)
    q = rand.normal(7, (B, 1, H, D))
    strategy = {"delta": jaxtopk.DeltaSearch, "mc": jaxtopk.MCSearch}[search]
    policy = jaxtopk.Certified(0.05, strategy(BS))
    out, cert = jaxtopk.decode_attention(
      q, cache, policy=policy, rng=jax.random.key(1)
    )
    self.assertTrue(np.all(cert.tv_bound <= 0.05))
    n_real = np.array(LENGTHS)[:, None, None]
    frac = np.asarray(cert.keys_scored) / n_real
    self.assertLess(float(frac[:2].mean()), 0.6)  # boxes skip most blocks
    # Soundness of the output bound vs float64 dense attention.
    ref, _ = _reference(q, k, v, jaxtopk.Dense())
    err = np.linalg.norm(
      np.asarray(out, np.float64) - np.asarray(ref, np.float64), axis=-1
    )
    self.assertTrue(np.all(cert.output_error_bound + 1e-5 >= err))

  def test_compact_search_equals_the_search_of_every_block(self):
    # Auto's box stage: rows that certify within SEARCH_CAPACITY of their
    # blocks are finished from the scored blocks only (else the fallback,
    # here a sentinel that fails the test, runs). The result equals the
    # search of every block: kept set, cost, bound and output.
    _, cache, k, _ = _filled_cache(clustered=True)
    # Each query aims at one key of its kv head's first 13 (within every
    # row's length): a row's mass in a block or two.
    pos = np.arange(H) % 13
    q = 8 * np.asarray(k)[:, pos, np.arange(H) // (H // HKV)][:, None]
    policy = jaxtopk.Certified(0.05, jaxtopk.DeltaSearch(BS))
    scale = D**-0.5

    def run(compact):
      st = _decode._step(jnp.asarray(q), cache, scale)
      full = lambda: _decode._search_full(policy, policy.search, st, None)  # noqa: E731
      if not compact:
        return _decode._final(full())
      nothing = lambda: jax.tree.map(lambda x: jnp.full_like(x, -1), full())  # noqa: E731
      return _decode._final(_decode._box_search(policy, st, nothing))

    (o1, c1, _), (o2, c2, _) = (
      jax.jit(run, static_argnums=0)(True),
      jax.jit(run, static_argnums=0)(False),
    )
    np.testing.assert_array_equal(c1.keys_scored, c2.keys_scored)
    np.testing.assert_array_equal(c1.k_kept, c2.k_kept)
    np.testing.assert_allclose(c1.tv_bound, c2.tv_bound, rtol=1e-6)
    np.testing.assert_allclose(o1, o2, rtol=1e-5, atol=1e-6)
    # Every row certified within the capacity (keys_scored counts the
    # scored blocks' keys and 2 per block for the boxes).
    most = _decode.SEARCH_CAPACITY * N + 2 * N // BS
    self.assertLessEqual(int(np.max(c1.keys_scored)), most)

  def test_empty_row_is_zero_and_invalid(self):
    # The shapes and policies of test_matches_topk_attention (its compiled
    # programs), the last row empty.
    _, _, k, v = _filled_cache()
    cache = jaxtopk.KVCache.create(B, N, HKV, D, block_size=BS, value_dim=DV)
    cache = cache.append(k, v, num_steps=jnp.array([N, 5, 0]))
    q = jnp.ones((B, 1, H, D))
    for policy in (jaxtopk.FixedK(5), jaxtopk.Certified(0.05, "exact")):
      out, cert = jaxtopk.decode_attention(q, cache, policy=policy)
      np.testing.assert_array_equal(
        cert.valid[:, 0], [[True] * H] * 2 + [[False] * H]
      )
      np.testing.assert_array_equal(out[2], 0.0)

  def test_query_norm_past_the_largest_float_keeps_its_certificate(self):
    # ||q|| = 4.2e38 overflows float32 while every logit is O(1): the large
    # query components meet subnormal key components (read as 0 by the
    # CPU). The row keeps a useful certificate, and a sound one.
    rng = np.random.default_rng(0)
    n = 8
    k = rng.normal(size=(1, n, 1, 4)).astype(np.float32)
    k[..., 0] = (np.arange(n) % 3 * 1e-39).reshape(1, n, 1)
    k[..., 1] = -3e-39
    v = rng.normal(size=(1, n, 1, 3)).astype(np.float32)
    q = np.array([3e38, 3e38, 1.0, 0.5], np.float32).reshape(1, 1, 1, 4)
    cache = jaxtopk.KVCache.create(1, n, 1, 4, block_size=4, value_dim=3)
    cache = cache.append(jnp.asarray(k), jnp.asarray(v))
    out, cert = jaxtopk.decode_attention(
      jnp.asarray(q),
      cache,
      policy=jaxtopk.Certified(0.1, jaxtopk.DeltaSearch(block_size=4)),
    )
    self.assertTrue(bool(cert.valid[0, 0, 0]))
    # Every key kept: the certificate says so (it was tv 1, error +inf).
    self.assertEqual(float(cert.tv_bound[0, 0, 0]), 0.0)
    self.assertTrue(np.isfinite(float(cert.output_error_bound[0, 0, 0])))
    s = k[0, :, 0].astype(np.float64) @ q[0, 0, 0].astype(np.float64) / 2
    p = np.exp(s - s.max())
    exact = p @ v[0, :, 0].astype(np.float64) / p.sum()
    err = np.linalg.norm(np.asarray(out[0, 0, 0], np.float64) - exact)
    self.assertLessEqual(err, float(cert.output_error_bound[0, 0, 0]) + 1e-5)

  @parameterized.named_parameters(
    ("query", dict(q_shape=(B, 0, H, D)), ValueError, "q_len"),
    ("heads", dict(q_shape=(B, 1, 5, D)), ValueError, "multiple"),
    ("pallas", dict(implementation="pallas"), NotImplementedError, "pallas"),
    ("block", dict(policy=jaxtopk.Certified(0.1, "delta")), ValueError, "64"),
    (
      "lowrank",
      dict(
        policy=jaxtopk.Certified(
          0.1, jaxtopk.DeltaSearch(block_size=BS, bound=jaxtopk.LowRank())
        )
      ),
      ValueError,
      "box",
    ),
    (
      "mc_key",
      dict(policy=jaxtopk.Certified(0.1, jaxtopk.MCSearch(block_size=BS))),
      ValueError,
      "key",
    ),
  )
  def test_bad_input(self, kwargs, exc, fragment):
    cache = jaxtopk.KVCache.create(B, 64, HKV, D, block_size=BS)
    q = jnp.ones(kwargs.pop("q_shape", (B, 1, H, D)))
    kwargs.setdefault("policy", jaxtopk.FixedK(2))
    with self.assertRaisesRegex(exc, fragment):
      jaxtopk.decode_attention(q, cache, **kwargs)


class DefaultLevelTest(absltest.TestCase):
  """Programs compiled at XLA's default optimization level, the level users
  run (the suite compiles at level 0: tests/conftest.py)."""

  def test_exact_search_candidates_with_wide_values(self):
    # The exact search's bracket and candidates (caches of
    # CANDIDATE_MIN_KEYS keys or more) with 512-wide values: the zero
    # output of the keys below the bracket once came out holding NaNs at
    # the default level (every row invalid, tv_bound NaN); at level 0 it
    # was right.
    rng = np.random.default_rng(6)
    n, d, h, dv = 1024, 8, 2, 512
    k = np.float32(rng.normal(size=(n, d)))
    q = jnp.asarray(np.stack([k[7] * 8.0, k[300] * 8.0]))[None, None]
    kk = jnp.broadcast_to(jnp.asarray(k)[None, :, None], (1, n, h, d))
    v = jnp.asarray(rng.normal(size=(1, n, h, dv)), jnp.float32)
    cache = jaxtopk.KVCache.create(1, n, h, d, value_dim=dv).append(kk, v)
    policy = jaxtopk.Certified(0.05, jaxtopk.Exact())

    def exact(q, cache, candidates):
      st = _decode._step(q, cache, d**-0.5, candidates=candidates)
      return _decode._final(_decode._certified_exact(policy, st))[:2]

    opts = {  # jax's defaults (the suite's flags: tests/conftest.py)
      "xla_backend_optimization_level": 3,
      "xla_llvm_disable_expensive_passes": False,
    }
    got = jax.jit(exact, static_argnums=2, compiler_options=opts)(
      q, cache, True
    )
    want = jax.jit(exact, static_argnums=2)(q, cache, False)  # the full row
    self.assertTrue(bool(jnp.all(got[1].valid)), got[1])
    np.testing.assert_array_equal(got[1].k_kept, want[1].k_kept)
    np.testing.assert_allclose(got[1].tv_bound, want[1].tv_bound, rtol=1e-3)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
  absltest.main()
