"""PagedKVCache: pages gathered = the contiguous cache; release and reuse."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized

import jaxtopk
from jaxtopk.attention import _cache
from jaxtopk.attention import _decode
from jaxtopk.attention.registry import UnsupportedCacheError
from jaxtopk.selection import key_codes
from tests import rand
from tests.attention.retrace import fresh_decode
from tests.tolerances import assert_same_up_to_rounding

B, H, D, E, PS, M = 3, 2, 8, 5, 4, 5
FIELDS = (
  "keys",
  "values",
  "length",
  "kmin",
  "kmax",
  "vnorm",
  "value_norms",
  "kabs",
  "knorm",
  "kflushed",
  "vmax",
  "key_codes",
  "key_exponents",
)


def _steps(rng, steps, dtype=jnp.float32, b=B):
  k = rng.standard_normal((b, steps, H, D)) * 2.0
  v = rng.standard_normal((b, steps, H, E))
  return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def _pair(num_pages=12, dtype=jnp.float32):
  paged = jaxtopk.PagedKVCache.create(
    B, num_pages, PS, H, D, max_pages_per_seq=M, dtype=dtype, value_dim=E
  )
  flat = jaxtopk.KVCache.create(
    B, M * PS, H, D, block_size=PS, dtype=dtype, value_dim=E
  )
  return paged, flat


def _assert_same_cache(test, got, want):
  test.assertEqual(got.block_size, want.block_size)
  for f in FIELDS:
    a, b = np.asarray(getattr(got, f)), np.asarray(getattr(want, f))
    if a.dtype == jnp.bfloat16:  # numpy's NaN == NaN needs a numpy float
      a, b = a.astype(np.float32), b.astype(np.float32)
    test.assertEqual(a.shape, b.shape, f)
    assert_same_up_to_rounding(a, b, err_msg=f)


# Ragged chunks: (steps, num_steps per sequence).
CHUNKS = ((5, [5, 2, 0]), (3, [1, 3, 3]), (7, [7, 0, 6]), (1, [1, 1, 1]))


def _page_rows(rng):
  """A paged cache filled by CHUNKS: its gather, and its keys, values and
  key codes (d-major, positions on axis 3) as ``_cache.PageRows``."""
  paged, _ = _pair()
  for steps, num in CHUNKS:
    paged = paged.append(*_steps(rng, steps), num_steps=num)
  table = paged.page_table
  pool = paged.pool
  return (
    paged.gather(),
    _cache.PageRows(pool.keys, table),
    _cache.PageRows(pool.values, table),
    _cache.PageRows(pool.key_codes, table, 3),
  )


class PagedKVCacheTest(parameterized.TestCase):
  @parameterized.parameters(jnp.float32, jnp.bfloat16)
  def test_gather_equals_contiguous_cache(self, dtype):
    rng = rand.generator(0)
    paged, flat = _pair(dtype=dtype)
    for i, (steps, num) in enumerate(CHUNKS):
      k, v = _steps(rng, steps, dtype)
      if i == 1:  # a NaN key and a subnormal one reach the summaries
        k = k.at[1, 0, 0, 0].set(jnp.nan).at[2, 1, 1, 2].set(1e-40)
      paged = paged.append(k, v, num_steps=num)
      flat = flat.append(k, v, num_steps=num)
      _assert_same_cache(self, paged.gather(), flat)
    # Pages are the lowest free ones, in sequence order, per append.
    np.testing.assert_array_equal(paged.length, [14, 6, 10])
    self.assertEqual(int(paged.in_use.sum()), 4 + 2 + 3)

  @parameterized.named_parameters(
    ("certified", jaxtopk.Certified(0.1, jaxtopk.Auto(block_size=PS))),
    ("delta", jaxtopk.Certified(0.05, jaxtopk.DeltaSearch(block_size=PS))),
    ("fixed_k", jaxtopk.FixedK(3)),
    ("dense", jaxtopk.Dense()),
  )
  def test_decode_equals_contiguous_cache(self, policy):
    rng = rand.generator(1)
    paged, flat = _pair()
    for steps, num in CHUNKS:
      k, v = _steps(rng, steps)
      paged = paged.append(k, v, num_steps=num)
      flat = flat.append(k, v, num_steps=num)
    # The pages read slot by slot (on CPU from PAGE_SCAN_MIN_BYTES; forced
    # here, and the decode retraced): the logits' d-term sums and the value
    # sum in another order (values and logits of order one); counts and
    # flags equal.
    self.enter_context(mock.patch.object(_cache, "PAGE_SCAN_MIN_BYTES", 0))
    self.enter_context(fresh_decode())
    for q_len in (1, 3):
      q = jnp.asarray(rng.standard_normal((B, q_len, 2 * H, D)), jnp.float32)
      o1, c1 = jaxtopk.decode_attention(q, paged, policy=policy)
      o2, c2 = jaxtopk.decode_attention(q, flat, policy=policy)
      ulp = float(np.finfo(np.float32).eps)
      np.testing.assert_allclose(o1, o2, rtol=4 * ulp, atol=32 * ulp)
      for a, b in zip(jax.tree.leaves(c1), jax.tree.leaves(c2), strict=True):
        if jnp.issubdtype(a.dtype, jnp.floating):
          np.testing.assert_allclose(a, b, rtol=64 * ulp, atol=ulp)
        else:
          np.testing.assert_array_equal(a, b)

  def test_page_rows_read_what_the_gather_holds(self):
    # The lazy reads of the decode's view: whole, at chosen positions, and
    # the key codes' sample positions (d-major, positions on axis 3).
    rng = rand.generator(5)
    whole, keys, _, codes = _page_rows(rng)
    np.testing.assert_array_equal(keys.dense(), whole.keys)
    np.testing.assert_array_equal(codes.dense(), whole.key_codes)
    idx = jnp.asarray(rng.integers(0, M * PS, (B, H, 2, 6)), jnp.int32)
    np.testing.assert_array_equal(
      _cache.take_rows(keys, idx), _cache.take_rows(whole.keys, idx)
    )
    pos = jnp.asarray(rng.integers(0, M * PS, (B, 4)), jnp.int32)
    np.testing.assert_array_equal(
      _cache.at_positions(codes, pos, 3),
      _cache.at_positions(whole.key_codes, pos, 3),
    )

  def test_slot_reads_equal_the_gathered_reads(self):
    # The logits, value sums and code products page slot by page slot (CPU)
    # and from the gathered pages (other platforms), against the gather.
    rng = rand.generator(6)
    whole, keys, values, codes = _page_rows(rng)
    q = jnp.asarray(rng.standard_normal((B, H, 3, D)), jnp.float32)
    p = jnp.asarray(rng.random((B, H, 3, M * PS)), jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    want = (
      jnp.einsum("bkgd,bknd->bkgn", q, whole.keys, precision=hi),
      jnp.einsum("bkgn,bknd->bkgd", p, whole.values, precision=hi),
      key_codes.code_dot(q, whole.key_codes),
    )
    for platforms in (("cpu",), ()):
      with (
        mock.patch.object(_cache, "PAGE_SCAN_PLATFORMS", platforms),
        mock.patch.object(_cache, "PAGE_SCAN_MIN_BYTES", 0),
      ):
        self.assertEqual(keys.by_slot, bool(platforms))
        got = (
          _cache.row_logits(keys, q, hi),
          _cache.row_weighted_sum(values, p, hi),
          _cache.code_products(codes, q),
        )
      for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-5)

  @pytest.mark.slow  # a cache of AUTO_MIN_KEYS positions: the key codes
  def test_key_code_decode_reads_the_pool_and_equals_contiguous(self):
    # The codes bound: its candidates' keys and values read from the pool.
    ps, m, h, d = 64, 16, 2, 8
    n = ps * m
    self.assertEqual(n, _decode.AUTO_MIN_KEYS)
    rng = rand.generator(4)
    paged = jaxtopk.PagedKVCache.create(2, 2 * m, ps, h, d, max_pages_per_seq=m)
    flat = jaxtopk.KVCache.create(2, n, h, d, block_size=ps)
    k = jnp.asarray(rng.standard_normal((2, n, h, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, n, h, d)), jnp.float32)
    num = jnp.asarray([n, n - 100])
    paged = paged.append(k, v, num_steps=num)
    flat = flat.append(k, v, num_steps=num)
    q = jnp.stack([k[:, 7, 0] * 6.0, k[:, 9, 1] * 6.0], 1)[:, None]
    policy = jaxtopk.Certified(
      0.05, jaxtopk.DeltaSearch(ps, bound=jaxtopk.Codes())
    )
    o1, c1 = jaxtopk.decode_attention(q, paged, policy=policy)
    o2, c2 = jaxtopk.decode_attention(q, flat, policy=policy)
    assert_same_up_to_rounding(o1, o2)
    for a, b in zip(jax.tree.leaves(c1), jax.tree.leaves(c2), strict=True):
      assert_same_up_to_rounding(a, b)
    self.assertTrue(np.all(np.asarray(c1.keys_scored) < n // 2))

  def test_released_pages_carry_nothing_to_their_next_owner(self):
    rng = rand.generator(2)
    paged, _ = _pair(num_pages=6)
    k, v = _steps(rng, 8)
    bad = jnp.full_like(k, jnp.nan)  # sequence 0 writes NaN keys
    paged = paged.append(jnp.where(jnp.arange(B)[:, None, None, None] == 0,
                                   bad, k), v, num_steps=[8, 4, 0])  # fmt: skip
    old = np.asarray(paged.page_table[0, :2])
    kept = paged.gather()
    paged = paged.release(jnp.array([True, False, False]))
    np.testing.assert_array_equal(paged.length, [0, 4, 0])
    self.assertEqual(int(paged.in_use.sum()), 1)
    # Sequence 2 now takes sequence 0's pages (the lowest free).
    k2, v2 = _steps(rng, 6)
    paged = paged.append(k2, v2, num_steps=[0, 0, 6])
    np.testing.assert_array_equal(paged.page_table[2, :2], old)
    fresh = jaxtopk.KVCache.create(
      B, M * PS, H, D, block_size=PS, value_dim=E
    ).append(k2, v2, num_steps=[0, 0, 6])
    got = paged.gather()
    for f in FIELDS:
      if f == "length":
        continue
      assert_same_up_to_rounding(
        np.asarray(getattr(got, f))[2], np.asarray(getattr(fresh, f))[2], f
      )
      # Sequence 1 is untouched by the release and the reuse.
      assert_same_up_to_rounding(
        np.asarray(getattr(got, f))[1], np.asarray(getattr(kept, f))[1], f
      )
    q = jnp.ones((B, 1, H, D), jnp.float32)
    out, cert = jaxtopk.decode_attention(
      q, paged, policy=jaxtopk.Certified(0.1, jaxtopk.Auto(block_size=PS))
    )
    self.assertTrue(np.all(np.isfinite(np.asarray(out))))
    np.testing.assert_array_equal(cert.valid[1:], True)

  def test_refusals_write_nothing(self):
    rng = rand.generator(3)
    paged, _ = _pair(num_pages=4)
    k, v = _steps(rng, 5)
    paged = paged.append(k, v, num_steps=[5, 1, 0])  # 3 pages held
    before = jax.tree.map(np.asarray, paged)
    k, v = _steps(rng, 4 * PS)
    with self.assertRaisesRegex(ValueError, "max_pages_per_seq=5"):
      paged.append(k, v, num_steps=[4 * PS, 0, 0])
    with self.assertRaisesRegex(ValueError, "needs 2 new pages; 1 of"):
      paged.append(k, v, num_steps=[0, 4, 1])
    for a, b in zip(
      jax.tree.leaves(paged), jax.tree.leaves(before), strict=True
    ):
      np.testing.assert_array_equal(a, b)
    with self.assertRaisesRegex(ValueError, r"done must be \[batch=3\]"):
      paged.release(jnp.array([True]))
    with self.assertRaisesRegex(TypeError, "done must be bool"):
      paged.release(jnp.array([1, 0, 0]))
    with self.assertRaisesRegex(ValueError, "num_pages=0"):
      jaxtopk.PagedKVCache.create(1, 0, PS, H, D, max_pages_per_seq=1)
    with self.assertRaisesRegex(ValueError, "max_pages_per_seq=-1"):
      jaxtopk.PagedKVCache.create(1, 2, PS, H, D, max_pages_per_seq=-1)
    with self.assertRaisesRegex(ValueError, "page_size=0"):
      jaxtopk.PagedKVCache.create(1, 2, 0, H, D, max_pages_per_seq=1)

  def test_donated_cache_is_refused_by_name(self):
    rng = rand.generator(4)
    paged, _ = _pair()
    k, v = _steps(rng, 2)
    newer = paged.append(k, v)
    with self.assertRaisesRegex(RuntimeError, "PagedKVCache.append"):
      paged.append(k, v)
    kept = newer.append(k, v, donate=False)
    np.testing.assert_array_equal(newer.length, [2, 2, 2])
    np.testing.assert_array_equal(kept.length, [4, 4, 4])

  def test_under_jit_steps_without_pages_are_dropped(self):
    rng = rand.generator(5)
    paged, _ = _pair(num_pages=3)
    k, v = _steps(rng, 6)
    step = jax.jit(lambda c, k, v: c.append(k, v, donate=False))
    out = step(paged, k, v)  # needs 2 pages per sequence, 3 in the pool
    np.testing.assert_array_equal(out.length, [6, 2 * PS - PS, 0])
    np.testing.assert_array_equal(out.in_use, True)

  def test_pallas_refuses_the_cache_and_falls_through(self):
    rng = rand.generator(6)
    paged, _ = _pair()
    k, v = _steps(rng, 3)
    paged = paged.append(k, v)
    q = jnp.ones((B, 1, H, D), jnp.float32)
    with self.assertRaises(UnsupportedCacheError):
      jaxtopk.decode_attention(
        q, paged, policy=jaxtopk.Dense(), implementation="pallas"
      )
    out, _ = jaxtopk.decode_attention(
      q, paged, policy=jaxtopk.Dense(), implementation=("pallas", "xla")
    )
    self.assertEqual(out.shape, (B, 1, H, E))


if __name__ == "__main__":
  absltest.main()
