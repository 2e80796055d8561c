"""Content-grouped KV index: soundness vs float64, updates, selections."""

import dataclasses
import os

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import settings

import jaxtopk
from jaxtopk.attention import _index_decode
from jaxtopk.selection import core
from jaxtopk.selection import key_codes
from tests.theory import truth

B, N, HK, H, D, DV = 2, 45, 1, 2, 5, 3  # GQA: 2 query heads per kv head
C, MAX_LEN, ROUNDS = 8, 48, 2  # group size, capacity, groups per round
KINDS = ("normal", "clustered", "ties", "huge", "tiny", "subnormal", "mixed")


def _draw_arrays(kind, seed):
  """(k [B, N, HK, D], v [B, N, HK, DV], q [B, 1, H, D]) float64 numpy."""
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(B, N, HK, D))
  v = rng.normal(size=(B, N, HK, DV))
  q = rng.normal(size=(B, 1, H, D))
  if kind == "clustered":  # tight clusters: groups get skipped
    cen = 3 * rng.normal(size=(B, 6, HK, D))
    k = cen[:, rng.integers(0, 6, N)] + 0.05 * k
    q = 3 * q
  elif kind == "ties":  # repeated keys and integer logits
    k = rng.integers(-2, 3, size=k.shape).astype(float)
    q = rng.integers(-2, 3, size=q.shape).astype(float)
  elif kind == "huge":  # logits ~1e3..1e30 apart, values ~1e30
    k = k * 10.0 ** rng.integers(10, 16)
    q = q * 10.0 ** rng.integers(-5, 16)
    v = v * 1e30
  elif kind == "tiny":  # products are subnormal: the CPU reads them as 0
    k, q, v = k * 1e-20, q * 1e-20, v * 1e-30
  elif kind == "subnormal":  # subnormal components next to normal ones
    k = np.where(rng.random(k.shape) < 0.5, k * 1e-39, k * 1e30)
    q = np.where(rng.random(q.shape) < 0.5, q * 1e-39, q)
    v = np.where(rng.random(v.shape) < 0.5, v * 1e-41, v)
  elif kind == "mixed":  # every component its own magnitude
    k = k * 10.0 ** rng.uniform(-40, 18, k.shape)
    q = q * 10.0 ** rng.uniform(-40, 18, q.shape)
    v = v * 10.0 ** rng.uniform(-40, 30, v.shape)
  return k, v, q


@st.composite
def _cases(draw):
  kind = draw(st.sampled_from(KINDS))
  seed = draw(st.integers(0, 2**31 - 1))
  lengths = draw(st.lists(st.integers(0, N), min_size=B, max_size=B))
  eps = draw(st.sampled_from([0.01, 0.1, 0.5]))
  return kind, seed, np.asarray(lengths, np.int32), eps


def _padded(pos):
  """Positions padded with -1 (ignored) to MAX_LEN wide: the selection
  calls of this file then share a compiled program per static setting."""
  pos = np.asarray(pos)
  pad = [(0, 0)] * (pos.ndim - 1) + [(0, MAX_LEN - pos.shape[-1])]
  return np.pad(pos, pad, constant_values=-1)


def _index(k, v, lengths, dtype):
  return jaxtopk.IndexedKVCache.build(
    jnp.asarray(k, dtype),
    jnp.asarray(v, dtype),
    lengths=lengths,
    max_len=MAX_LEN,
    group_size=C,
    groups_per_round=ROUNDS,
  )


def _stored(index):
  """float64 keys/values per slot ``[b, hk, G*C, .]`` and slot validity."""
  kf = truth.as64(index.keys).reshape(B, HK, -1, D)
  vf = truth.as64(index.values).reshape(B, HK, -1, DV)
  valid = (np.arange(C) < np.asarray(index.count)[..., None]).reshape(B, HK, -1)
  return kf, vf, valid


def _check_row(self, s, keep, valid, vals, tv, log_tv, out, err, ok, dtype):
  """tv >= float64 truth of ``keep``; output error <= its bound."""
  if not ok:
    return
  lt = truth.log_tau(s, keep, valid)
  self.assertGreaterEqual(float(tv), np.exp(lt), msg=f"{lt=}")
  self.assertGreaterEqual(float(log_tv), lt)
  if not np.all(np.isfinite(vals[valid])):
    return
  p = truth.probs(s, valid)
  dense = p @ np.where(valid[:, None], vals, 0.0)
  # The certificate does not cover the rounding of the returned output
  # itself: a few ulps of the largest value norm in the output dtype, or a
  # subnormal output flushed to 0 by the CPU.
  vmax = np.max(np.linalg.norm(vals[valid], axis=-1))
  fin = jnp.finfo(dtype)
  slack = 32 * float(fin.eps) * vmax + 2 * float(fin.tiny) * np.sqrt(DV)
  self.assertLessEqual(
    np.linalg.norm(truth.as64(out) - dense), float(err) + slack
  )


# CI draws few examples (each runs four searches); the soak profile draws
# its own count (HYPOTHESIS_PROFILE=soak).
_EXAMPLES = (
  settings.default.max_examples
  if os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci"
  else 20  # CI: compile-bound; soak draws 500
)
_EXAMPLES = 12 if _EXAMPLES <= 60 else _EXAMPLES


class IndexSoundnessTest(parameterized.TestCase):
  @parameterized.named_parameters(("f32", jnp.float32), ("bf16", jnp.bfloat16))
  @settings(max_examples=_EXAMPLES)
  @given(case=_cases(), m=st.integers(0, 12))
  def test_sound(self, dtype, case, m):
    """Delta/MC-Search, the code-bounded group search, certify_selection
    and grow_selection (with the codes, the default) vs float64."""
    kind, seed, lengths, eps = case
    k, v, q = _draw_arrays(kind, seed)
    index = _index(k, v, lengths, dtype)
    query = jnp.asarray(q, dtype)
    self._check_search(index, query, lengths, eps, seed, dtype)
    rng = np.random.default_rng(seed)
    # Arbitrary sets: duplicates, -1 padding and positions past the length;
    # m real entries padded with -1 to one width (one compilation).
    pos = rng.integers(-2, N + 3, size=(B, 1, H, 12)).astype(np.int32)
    pos[..., m:] = -1
    pos = _padded(pos)
    self._check_selection(index, query, k, v, pos, lengths, eps, dtype)

  def _check_search(self, index, query, lengths, eps, seed, dtype):
    kf, vf, valid = _stored(index)
    q64 = truth.as64(query)[:, 0]  # [b, h, d]
    scale = 1 / np.sqrt(D)
    for search in ("delta", "mc", "codes"):
      if search == "codes":  # group bounds from the keys' 8-bit codes
        use = jnp.ones((B, 1, H), bool)
        out, cert, kept = _index_decode._codes_search(
          query, index, use, eps, scale=scale
        )
      else:
        strategy = (
          jaxtopk.MCSearch(C, failure_prob=1e-6)
          if search == "mc"
          else jaxtopk.DeltaSearch(C)
        )
        pol = jaxtopk.Certified(eps, strategy)
        out, cert, kept = _index_decode._search_decode(
          query,
          index,
          jax.random.key(seed % 1000),
          eps,
          policy=jaxtopk.Certified(0.5, pol.search),  # eps traced, as the API
          scale=scale,
        )
      for b in range(B):
        self.assertEqual(bool(np.any(cert.valid[b])), lengths[b] > 0)
        for h in range(H):
          hk = h // (H // HK)
          s = kf[b, hk] @ q64[b, h] * scale
          keep = np.repeat(np.asarray(kept[b, hk, h % (H // HK)]), C)
          if cert.valid[b, 0, h]:
            self.assertLessEqual(float(cert.tv_bound[b, 0, h]), eps)
          _check_row(
            self,
            s,
            keep & valid[b, hk],
            valid[b, hk],
            vf[b, hk],
            cert.tv_bound[b, 0, h],
            cert.log_tv_bound[b, 0, h],
            out[b, 0, h],
            cert.output_error_bound[b, 0, h],
            bool(cert.valid[b, 0, h]),
            dtype,
          )

  def _check_selection(self, index, query, k, v, pos, lengths, eps, dtype):
    m = pos.shape[-1]
    given = np.zeros((B, 1, H, MAX_LEN), bool)
    for b, h, i in np.ndindex(B, H, m):
      if 0 <= pos[b, 0, h, i] < lengths[b]:
        given[b, 0, h, pos[b, 0, h, i]] = True
    cert = jaxtopk.certify_selection(query, index, pos)
    ok = np.asarray(cert.valid)
    np.testing.assert_array_equal(cert.k_kept[ok], given.sum(-1)[ok])
    out, sel = jaxtopk.grow_selection(query, index, pos, eps=eps)
    grown = np.asarray(sel.keep)
    self.assertTrue(np.all(grown | ~given))  # the start set is kept
    k64 = truth.as64(jnp.asarray(k, dtype))
    v64 = truth.as64(jnp.asarray(v, dtype))
    q64 = truth.as64(query)[:, 0]
    for b, h in np.ndindex(B, H):
      valid = np.arange(MAX_LEN) < lengths[b]
      kk = np.zeros((MAX_LEN, D))
      kk[:N] = k64[b, :, h // (H // HK)]
      vv = np.zeros((MAX_LEN, DV))
      vv[:N] = v64[b, :, h // (H // HK)]
      s = kk @ q64[b, h] / np.sqrt(D)
      for c, keep, o in ((cert, given, None), (sel.certificate, grown, out)):
        # Valid iff something real is kept (core.row_valid); finite inputs
        # of every kind drawn here keep the logits finite or the row goes
        # invalid, which the search check below covers.
        if not np.any(keep[b, 0, h]):
          self.assertFalse(bool(c.valid[b, 0, h]))
        self.assertFalse(np.any(keep[b, 0, h] & ~valid))
        _check_row(
          self,
          s,
          keep[b, 0, h],
          valid,
          vv,
          c.tv_bound[b, 0, h],
          c.log_tv_bound[b, 0, h],
          np.zeros(DV) if o is None else o[b, 0, h],
          np.inf if o is None else c.output_error_bound[b, 0, h],
          bool(c.valid[b, 0, h]),
          dtype,
        )


def _clustered(seed=0, n=N):
  """float32 numpy: slicing them compiles nothing."""
  k, v, q = _draw_arrays("clustered", seed)
  f32 = lambda x: x.astype(np.float32)
  return f32(k[:, :n]), f32(v[:, :n]), f32(q)


class IndexTest(parameterized.TestCase):
  def test_layout_and_summaries(self):
    k, v, _ = _clustered()
    index = _index(k, v, np.array([N, 13]), jnp.float32)
    pos = np.asarray(index.position)
    cnt = np.asarray(index.count)
    self.assertEqual(index.keys.shape, (B, HK, 12, C, D))
    # Read in numpy (indexing the jax arrays compiles each new slice).
    keys, centre, radius, vnorm, slot = map(
      np.asarray,
      (index.keys, index.centre, index.radius, index.vnorm, index.slot),
    )
    for b, n in ((0, N), (1, 13)):
      got = pos[b, 0][pos[b, 0] >= 0]
      np.testing.assert_array_equal(np.sort(got), np.arange(n))
      for g in range(index.num_groups):
        members = pos[b, 0, g, : cnt[b, 0, g]]
        self.assertTrue(np.all(members >= 0))
        self.assertTrue(np.all(pos[b, 0, g, cnt[b, 0, g] :] == -1))
        kk = np.asarray(k[b, members, 0], np.float64)
        np.testing.assert_array_equal(keys[b, 0, g, : len(members)], kk)
        dist = np.linalg.norm(kk - centre[b, 0, g], axis=-1)
        self.assertTrue(np.all(dist <= radius[b, 0, g]))
        vn = np.linalg.norm(np.asarray(v[b, members, 0], np.float64), axis=-1)
        self.assertTrue(np.all(vn <= vnorm[b, 0, g]))
      slots = slot[b, 0]
      self.assertTrue(np.all(slots[n:] == -1))
      np.testing.assert_array_equal(
        pos[b, 0].reshape(-1)[slots[:n]], np.arange(n)
      )

  def test_incremental_equals_rebuild(self):
    """Appends keep what a rebuild holds; only the grouping differs.

    Documented differences: appended keys join existing groups (centres
    never move, radii grow) or open spare groups, so groups, radii and
    hence keys_scored differ from a fresh build; the stored keys, values
    and positions, the dense output and the soundness do not.
    """
    k, v, q = _clustered(seed=3)
    lengths = jnp.array([N, N])
    fresh = _index(k, v, lengths, jnp.float32)
    # Built from the first 21 keys (the rest past ``lengths``), then two
    # appends of 12: the shapes of the other tests' builds and appends.
    grown = _index(k, v, jnp.array([21, 21]), jnp.float32)
    grown = grown.append(k[:, 21:33], v[:, 21:33])
    grown = grown.append(k[:, 33:], v[:, 33:])
    np.testing.assert_array_equal(grown.length, [N, N])
    for idx in (fresh, grown):
      pos = np.asarray(idx.position).reshape(B, HK, -1)
      kf = np.asarray(idx.keys).reshape(B, HK, -1, D)
      counts, keys, centre, radius = map(
        np.asarray, (idx.count, idx.keys, idx.centre, idx.radius)
      )
      # The stored value norms are core.value_norms of the stored values
      # (0 in empty slots), whether built or appended.
      np.testing.assert_array_equal(
        idx.value_norms, core.value_norms(idx.values)
      )
      for b in range(B):
        got = pos[b, 0][pos[b, 0] >= 0]
        np.testing.assert_array_equal(np.sort(got), np.arange(N))
        order = np.argsort(np.where(pos[b, 0] >= 0, pos[b, 0], 10**6))[:N]
        np.testing.assert_array_equal(kf[b, 0, order], k[b, :, 0])
        cnt = counts[b, 0]
        for g in np.nonzero(cnt)[0]:
          kk = np.asarray(keys[b, 0, g, : cnt[g]], np.float64)
          c = np.asarray(centre[b, 0, g], np.float64)
          self.assertTrue(
            np.all(np.linalg.norm(kk - c, axis=-1) <= radius[b, 0, g])
          )
    outs = [
      jaxtopk.decode_attention(q, idx, policy=jaxtopk.Dense())[0]
      for idx in (fresh, grown)
    ]
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    rebuilt = grown.rebuild()
    np.testing.assert_array_equal(rebuilt.count.sum(-1), [[N], [N]])
    pol = jaxtopk.Certified(0.1, jaxtopk.DeltaSearch(block_size=C))
    for idx in (fresh, grown, rebuilt):
      _, cert = jaxtopk.decode_attention(q, idx, policy=pol)
      self.assertTrue(np.all(cert.valid))
      self.assertTrue(np.all(cert.tv_bound <= 0.1))

  def test_update_saturates_and_opens_groups(self):
    k, v, _ = _clustered()
    index = _index(k, v, jnp.array([40, 40]), jnp.float32)  # 40 of N keys
    far = np.full((B, 12, HK, D), 1e3, np.float32)  # far from every centre
    fv = far[..., :DV]
    full = jax.tree.map(jnp.copy, index).append(far, fv)  # index kept
    np.testing.assert_array_equal(full.length, [MAX_LEN, MAX_LEN])
    np.testing.assert_array_equal(full.count.sum(-1), [[MAX_LEN]] * B)
    opened = (np.asarray(full.count) > 0) & (np.asarray(index.count) == 0)
    self.assertTrue(np.any(opened))
    part = index.append(far, fv, num_steps=jnp.array([0, 2]))
    np.testing.assert_array_equal(part.length, [40, 42])

  def test_full_policies_match_kv_cache(self):
    k, v, q = _clustered(seed=5)
    index = _index(k, v, jnp.array([N, 30]), jnp.float32)
    cache = jaxtopk.KVCache.create(
      B, MAX_LEN, HK, D, block_size=C, value_dim=DV
    )
    cache = cache.append(k, v, num_steps=jnp.array([N, 30]))
    for pol in (jaxtopk.FixedK(5), jaxtopk.Certified(0.05), jaxtopk.Dense()):
      o1, c1 = jaxtopk.decode_attention(q, index, policy=pol)
      o2, c2 = jaxtopk.decode_attention(q, cache, policy=pol)
      np.testing.assert_allclose(o1, o2, atol=1e-5, rtol=1e-5)
      np.testing.assert_array_equal(c1.k_kept, c2.k_kept)
      np.testing.assert_array_equal(c1.keys_scored, [[[N] * H], [[30] * H]])
      # Same keys, same kept set: the index's bounds are not looser than
      # the cache's (each rounding term counted once; with Dense the bound
      # is that term alone). The two paths bound the logits' rounding from
      # their own key summaries: equal up to a few ulps.
      for field in ("tv_bound", "output_error_bound"):
        a, b = getattr(c1, field), getattr(c2, field)
        np.testing.assert_array_less(a, b * (1 + 1e-5) + 1e-30, err_msg=field)

  def test_selection_defined_results(self):
    k, v, q = _clustered()
    index = _index(k, v, jnp.array([N, 0]), jnp.float32)
    every = np.broadcast_to(np.arange(MAX_LEN), (B, 1, 1, MAX_LEN))
    # Every set here MAX_LEN wide (-1 padding): one compiled program.
    cert = jaxtopk.certify_selection(q, index, every)
    np.testing.assert_array_equal(cert.valid, [[[True] * H], [[False] * H]])
    np.testing.assert_array_equal(cert.tv_bound[0], 0.0)  # nothing dropped
    np.testing.assert_array_equal(cert.k_kept[0], N)
    empty = np.full((B, 1, H, MAX_LEN), -1)
    cert = jaxtopk.certify_selection(q, index, empty)
    self.assertFalse(np.any(cert.valid))  # nothing kept (core.row_valid)
    self.assertTrue(np.all(np.isnan(cert.tv_bound)))
    np.testing.assert_array_equal(cert.k_kept, 0)
    dup = _padded(np.broadcast_to([3, 3, 3, 7, -1, N + 5], (B, 1, 1, 6)))
    cert = jaxtopk.certify_selection(q, index, dup)
    np.testing.assert_array_equal(cert.k_kept[0], 2)
    n_groups = int(np.sum(np.asarray(index.count[0, 0]) > 0))
    # The selection, the group summaries, 2 for the query, and the codes of
    # the N stored keys at their byte share (THEORY 3.5).
    codes = int(key_codes.code_cost(N, D, jnp.float32))
    np.testing.assert_array_equal(cert.keys_scored[0], 2 + n_groups + 2 + codes)
    cert = jaxtopk.certify_selection(q, index, dup, codes=False)
    np.testing.assert_array_equal(cert.keys_scored[0], 2 + n_groups + 2)

  def test_grow_cap_reports_true_bound(self):
    k, v, q = _clustered(seed=7)
    index = _index(k, v, jnp.array([N, N]), jnp.float32)
    start = _padded(np.zeros((B, 1, 1, 1), np.int32))
    _, capped = jaxtopk.grow_selection(q, index, start, eps=1e-6, max_groups=1)
    _, full = jaxtopk.grow_selection(q, index, start, eps=1e-6)
    self.assertTrue(np.all(full.certificate.tv_bound <= 1e-6))
    self.assertTrue(np.all(capped.k_kept <= 1 + C))
    self.assertTrue(np.any(capped.certificate.tv_bound > 1e-6))

  def test_search_skips_groups_on_clustered_keys(self):
    k, v, q = _clustered(seed=11)
    index = _index(k, v, jnp.array([N, N]), jnp.float32)
    pol = jaxtopk.Certified(0.5, jaxtopk.DeltaSearch(block_size=C))
    _, cert = jaxtopk.decode_attention(q, index, policy=pol)
    self.assertTrue(np.all(cert.valid))
    self.assertLess(float(np.mean(cert.k_kept)), N)

  @parameterized.named_parameters(
    (
      "block_size",
      dict(search=jaxtopk.DeltaSearch(block_size=16)),
      "block_size=16",
    ),
    (
      "max_topk",
      dict(search=jaxtopk.DeltaSearch(block_size=C), max_topk=3),
      "max_topk",
    ),
    (
      "lowrank",
      dict(search=jaxtopk.DeltaSearch(block_size=C, bound=jaxtopk.LowRank())),
      "bound",
    ),
  )
  def test_refused_fields(self, kwargs, fragment):
    k, v, q = _clustered()
    index = _index(k, v, None, jnp.float32)
    pol = jaxtopk.Certified(0.1, **kwargs)
    with self.assertRaisesRegex(ValueError, fragment):
      jaxtopk.decode_attention(q, index, policy=pol)

  def test_bad_arguments(self):
    k, v, q = _clustered()
    index = _index(k, v, None, jnp.float32)
    mc = jaxtopk.Certified(0.1, jaxtopk.MCSearch(block_size=C))
    with self.assertRaisesRegex(ValueError, "PRNG key"):
      jaxtopk.decode_attention(q, index, policy=mc)
    with self.assertRaisesRegex(ValueError, "implementation"):
      jaxtopk.decode_attention(
        q, index, policy=jaxtopk.Dense(), implementation="pallas"
      )
    with self.assertRaisesRegex(ValueError, "query must be"):
      jaxtopk.certify_selection(q[:, :, :, :3], index, np.zeros((B, 1, 1, 1)))
    with self.assertRaisesRegex(TypeError, "positions must be integer"):
      jaxtopk.certify_selection(q, index, np.zeros((B, 1, 1, 1)))
    with self.assertRaisesRegex(ValueError, "eps"):
      jaxtopk.grow_selection(q, index, np.zeros((B, 1, 1, 1), int), eps=1.5)
    with self.assertRaisesRegex(ValueError, "max_len"):
      jaxtopk.IndexedKVCache.build(k, v, max_len=10)
    with self.assertRaisesRegex(ValueError, "group_size"):
      jaxtopk.IndexedKVCache.build(k, v, group_size=0)

  def test_one_key(self):
    k, v, q = _clustered(n=1)
    index = jaxtopk.IndexedKVCache.build(k, v, group_size=C)
    for pol in (
      jaxtopk.Certified(0.1, jaxtopk.DeltaSearch(block_size=C)),
      jaxtopk.Dense(),
    ):
      out, cert = jaxtopk.decode_attention(q, index, policy=pol)
      np.testing.assert_allclose(
        out[:, 0], np.repeat(v[:, 0], H, axis=1), atol=1e-6
      )
      np.testing.assert_array_equal(cert.tv_bound, 0.0)

  def test_jit_and_pytree(self):
    k, v, q = _clustered()
    index = _index(k, v, None, jnp.float32)
    pol = jaxtopk.Certified(0.1, jaxtopk.DeltaSearch(block_size=C))
    f = jax.jit(lambda q, i: jaxtopk.decode_attention(q, i, policy=pol))
    o1, c1 = f(q, index)
    o2, c2 = jaxtopk.decode_attention(q, index, policy=pol)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(c1.tv_bound, c2.tv_bound)
    leaves = jax.tree.leaves(index)
    self.assertLen(leaves, len(dataclasses.fields(index)) - 2)


def _ld_logits(q, k, scale):
  """``[h, n]`` exact logits of q ``[1, 1, h, d]``, k ``[1, n, 1, d]``."""
  qq = np.asarray(q, np.float32).astype(np.longdouble)[0, 0]
  kk = np.asarray(k, np.float32).astype(np.longdouble)[0, :, 0]
  return (qq @ kk.T) * np.longdouble(scale)


def _tau_ld(s, keep):
  """Exact dropped mass of each row of ``s`` ``[h, n]`` (longdouble)."""
  m = s.max(-1, keepdims=True)
  e = np.exp(s - m)
  return (e * ~keep).sum(-1) / e.sum(-1)


class IndexAuditTest(parameterized.TestCase):
  """Regression tests of the second reliability audit (content index)."""

  def test_appended_huge_keys_are_never_dropped(self):
    # Keys near the largest float: every distance to a centre overflows
    # (inf, or NaN from inf - inf), argmin picked group 0 although it was
    # full, and the key was silently dropped (Dense kept 6 of 7).
    rng = np.random.default_rng(1)
    k = rng.uniform(-5e37, 5e37, (1, 7, 1, 5)).astype(np.float32)
    k[0, :, 0, 0] = [-2.5e38, -2.5e38, -1e38, 1e38, -1e38, 2.5e38, -1e38]
    v = np.eye(7, dtype=np.float32)[None, :, None, :]
    index = jaxtopk.IndexedKVCache.build(
      k[:, :2], v[:, :2], max_len=7, group_size=4
    )
    index = index.append(k[:, 2:], v[:, 2:])
    slot = np.asarray(index.slot)[0, 0]
    self.assertTrue(np.all(slot >= 0), slot)
    self.assertLen(set(slot.tolist()), 7)
    self.assertEqual(int(np.asarray(index.count).sum()), 7)

  def test_tiny_query_keeps_its_ball_term(self):
    # ||q|| = 1.5e-38 against one group of keys +-2.5e38 along q: scale
    # ||q|| is subnormal, and (scale ||q||) r flushed the ball term (~1.9
    # logits) to 0: tv 0.518 against tau 0.648.
    k = np.zeros((1, 8, 1, 4), np.float32)
    k[0, :, 0, 0] = [2.5e38, -2.5e38, 1e38, -1e38] * 2
    q = np.zeros((1, 1, 2, 4), np.float32)
    q[0, 0, :, 0] = [1.5e-38, -1.5e-38]
    index = jaxtopk.IndexedKVCache.build(k, k, group_size=8, num_clusters=1)
    pos = np.array([[[[0], [1]]]])
    cert = jaxtopk.certify_selection(q, index, pos)
    keep = np.zeros((2, 8), bool)
    keep[0, 0] = keep[1, 1] = True
    tau = _tau_ld(_ld_logits(q, k, 0.5), keep)
    np.testing.assert_array_equal(cert.valid, True)
    tv = np.asarray(cert.tv_bound, np.longdouble)[0, 0]
    self.assertTrue(np.all(tv >= tau), (tv, tau))
    _, sel = jaxtopk.grow_selection(q, index, pos, eps=0.5, max_groups=0)
    tv = np.asarray(sel.certificate.tv_bound, np.longdouble)[0, 0]
    self.assertTrue(np.all(tv >= tau), (tv, tau))

  @parameterized.named_parameters(("3e37", 3e37), ("1e38", 1e38))
  def test_large_values_are_averaged_not_summed(self, mag):
    # N values of 3e37: their weighted sum overflows, their mean does
    # not; every index row was invalid with zero output. (The file's
    # shapes: the programs of the other tests.)
    rng = np.random.default_rng(0)
    k = rng.normal(size=(B, N, HK, D)).astype(np.float32)
    v = np.full((B, N, HK, DV), mag, np.float32)
    v[..., 1] *= np.where(np.arange(N) % 2, 1, -1)[None, :, None]
    q = (0.1 * rng.normal(size=(B, 1, H, D))).astype(np.float32)
    index = _index(k, v, None, jnp.float32)
    cache = jaxtopk.KVCache.create(
      B, MAX_LEN, HK, D, block_size=C, value_dim=DV
    )
    cache = cache.append(k, v)
    for pol in (
      jaxtopk.Dense(),
      jaxtopk.FixedK(5),
      jaxtopk.Certified(0.05, jaxtopk.DeltaSearch(block_size=C)),
    ):
      out, cert = jaxtopk.decode_attention(q, index, policy=pol)
      want, _ = jaxtopk.decode_attention(q, cache, policy=jaxtopk.Dense())
      np.testing.assert_array_equal(cert.valid, True, err_msg=str(pol))
      self.assertTrue(np.all(np.isfinite(out)))
      if isinstance(pol, jaxtopk.Dense):
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=mag * 1e-5)
    pos = _padded(np.broadcast_to(np.arange(N), (B, 1, 1, N)))
    np.testing.assert_array_equal(
      jaxtopk.certify_selection(q, index, pos).valid, True
    )
    pos = _padded(pos[..., :3])
    out, sel = jaxtopk.grow_selection(q, index, pos, eps=0.01)
    np.testing.assert_array_equal(sel.certificate.valid, True)
    self.assertTrue(np.all(np.isfinite(out)))

  @parameterized.named_parameters(
    ("nan", np.nan), ("inf", np.inf), ("minus_inf", -np.inf)
  )
  def test_non_finite_key_outside_the_set_makes_the_row_invalid(self, bad):
    # Its group's bound is NaN or +inf: the row cannot be certified (it
    # reported valid with tv 1 and an infinite output bound).
    # In batch row 0 (the file's shapes: the other tests' programs).
    rng = np.random.default_rng(1)
    k = rng.normal(size=(B, N, HK, D)).astype(np.float32)
    k[0, 13, 0, 1] = bad
    q = rng.normal(size=(B, 1, H, D)).astype(np.float32)
    v = np.ones((B, N, HK, DV), np.float32)
    index = _index(k, v, None, jnp.float32)
    pos = _padded(np.broadcast_to(np.arange(3), (B, 1, 1, 3)))
    cert = jaxtopk.certify_selection(q, index, pos)
    np.testing.assert_array_equal(cert.valid[0], False)
    self.assertTrue(np.all(np.isnan(cert.tv_bound[0])))
    _, sel = jaxtopk.grow_selection(q, index, pos, eps=0.1, max_groups=0)
    np.testing.assert_array_equal(sel.certificate.valid[0], False)
    # Scoring every group: the key's own logit decides (NaN or +inf:
    # invalid; -inf: a key of zero mass, the row stays valid).
    _, sel = jaxtopk.grow_selection(q, index, pos, eps=1e-6)
    s = _ld_logits(q[:1], k[:1], 1 / np.sqrt(D))[:, 13]
    want = (s == -np.inf) & bool(np.asarray(sel.keep)[0, 0, 0, 13])
    np.testing.assert_array_equal(sel.certificate.valid[0, 0], want)

  @parameterized.named_parameters(("nan", np.nan), ("inf", np.inf))
  def test_non_finite_value_makes_the_full_row_invalid(self, bad):
    # The full-row path reads the value norms stored at build and append:
    # a broken value, built or appended, still invalidates the rows of
    # its kv head (batch row 0), and only those.
    rng = np.random.default_rng(2)
    k = rng.normal(size=(B, N, HK, D)).astype(np.float32)
    v = rng.normal(size=(B, N, HK, DV)).astype(np.float32)
    v[0, 30, 0, 1] = bad  # an appended position of ``grown``
    q = rng.normal(size=(B, 1, H, D)).astype(np.float32)
    built = _index(k, v, None, jnp.float32)
    grown = _index(k, v, jnp.array([21, 21]), jnp.float32)
    grown = grown.append(k[:, 21:33], v[:, 21:33])
    grown = grown.append(k[:, 33:], v[:, 33:])
    for idx in (built, grown):
      self.assertTrue(np.isnan(np.asarray(idx.value_norms[0, 0])).any())
      for policy in (jaxtopk.Dense(), jaxtopk.Certified(0.05, "exact")):
        _, cert = jaxtopk.decode_attention(q, idx, policy=policy)
        np.testing.assert_array_equal(cert.valid[0], False)
        np.testing.assert_array_equal(cert.valid[1], True)

  def test_positions_checked_before_the_int32_cast(self):
    # An int64 position 2**32 + 1 wrapped to 1 and was certified as kept:
    # tv 1e-12 against tau 1. Out of range, it is ignored.
    # (The file's shapes, sets MAX_LEN wide: the other tests' programs.)
    rng = np.random.default_rng(2)
    k = rng.normal(size=(B, N, HK, D)).astype(np.float32)
    q = (3 * rng.normal(size=(B, 1, H, D))).astype(np.float32)
    k[0, 1, 0] = 3 * q[0, 0, 0]  # key 1 holds head 0's mass
    index = _index(k, k[..., :DV], None, jnp.float32)
    big = _padded(np.full((B, 1, 1, 1), 2**32 + 1, np.int64))
    cert = jaxtopk.certify_selection(q, index, big)
    np.testing.assert_array_equal(cert.valid, False)  # nothing real kept
    pos = np.array([[[[0, 2**32 + 1, -(2**32) + 1]]]] * B, np.int64)
    cert = jaxtopk.certify_selection(q, index, _padded(pos))
    np.testing.assert_array_equal(cert.k_kept, 1)
    keep = np.zeros((1, N), bool)
    keep[0, 0] = True
    tau = _tau_ld(_ld_logits(q[:1, :, :1], k[:1], 1 / np.sqrt(D)), keep)
    self.assertGreaterEqual(np.longdouble(float(cert.tv_bound[0, 0, 0])), tau)
    with self.assertRaisesRegex(TypeError, "positions"):
      jaxtopk.certify_selection(q, index, np.zeros((B, 1, 1, 1), bool))

  def test_traced_scale(self):
    k, v, q = _clustered()
    index = _index(k, v, None, jnp.float32)
    pos = _padded(np.zeros((B, 1, 1, 2), np.int32))
    delta = jaxtopk.Certified(0.1, jaxtopk.DeltaSearch(block_size=C))
    calls = {
      "dense": lambda s: jaxtopk.decode_attention(
        q, index, policy=jaxtopk.Dense(), scale=s
      ),
      "delta": lambda s: jaxtopk.decode_attention(
        q, index, policy=delta, scale=s
      ),
      "certify": lambda s: (
        None,
        jaxtopk.certify_selection(q, index, pos, scale=s),
      ),
      "grow": lambda s: jaxtopk.grow_selection(q, index, pos, eps=0.1, scale=s),
    }
    for name, fn in calls.items():
      # Traced 1/sqrt(D) against the default (static) scale: the
      # programs the other tests compile.
      cert = jax.jit(fn)(jnp.float32(1 / np.sqrt(D)))[1]
      cert = getattr(cert, "certificate", cert)
      want = fn(None)[1]
      want = getattr(want, "certificate", want)
      np.testing.assert_allclose(
        cert.tv_bound, want.tv_bound, rtol=1e-5, err_msg=name
      )
      np.testing.assert_array_equal(cert.valid, True, err_msg=name)
      # A traced scale below float32's smallest normal reads 0 on a CPU:
      # rows invalid.
      bad = jax.jit(fn)(jnp.float32(1.1e-38))[1]
      bad = getattr(bad, "certificate", bad)
      np.testing.assert_array_equal(bad.valid, False, err_msg=name)

  def test_build_and_update_arguments_named(self):
    k = np.ones((1, 3, 1, 4), np.float32)
    for lengths, exc, frag in (
      ([3.7], TypeError, "lengths.dtype=float64"),  # truncated silently
      ([5], ValueError, r"lengths=\[5\] must be in \[0, 3\]"),
      ([1, 2], ValueError, "lengths must be"),
    ):
      with self.assertRaisesRegex(exc, frag):
        jaxtopk.IndexedKVCache.build(k, k, lengths=lengths)
    for dt in (np.int32, bool, np.complex64):
      with self.assertRaisesRegex(TypeError, "keys"):
        jaxtopk.IndexedKVCache.build(k.astype(dt), k)
      with self.assertRaisesRegex(TypeError, "values"):
        jaxtopk.IndexedKVCache.build(k, k.astype(dt))
    index = jaxtopk.IndexedKVCache.build(k, k, max_len=8, group_size=4)
    x = np.ones((1, 2, 1, 4), np.float32)
    with self.assertRaisesRegex(ValueError, "num_steps must be"):  # was a
      index.append(x, x, num_steps=np.array([1, 2]))  # vmap
    with self.assertRaisesRegex(TypeError, "keys must be real"):
      index.append(x.astype(np.complex64), x)
    got = index.append(x, x, num_steps=1)
    np.testing.assert_array_equal(got.length, [4])

  def test_arguments_named(self):
    k, v, q = _clustered()
    index = _index(k, v, None, jnp.float32)
    pos = _padded(np.zeros((B, 1, 1, 1), np.int32))
    for scale, exc in ((1.1e-38, ValueError), ("a", TypeError)):
      with self.assertRaisesRegex(exc, "scale"):
        jaxtopk.certify_selection(q, index, pos, scale=scale)
      with self.assertRaisesRegex(exc, "scale"):
        jaxtopk.decode_attention(q, index, policy=jaxtopk.Dense(), scale=scale)
    for dt in (np.int32, np.complex64, bool):
      bad_q = np.ones(q.shape, dt)
      with self.assertRaisesRegex(TypeError, "query"):
        jaxtopk.certify_selection(bad_q, index, pos)
      with self.assertRaisesRegex(TypeError, "query"):
        jaxtopk.decode_attention(bad_q, index, policy=jaxtopk.Dense())
    with self.assertRaisesRegex(TypeError, "eps"):
      jaxtopk.grow_selection(q, index, pos, eps="0.1")
    for eps in (np.float32(0.1), jnp.float32(0.1), np.float64(0.1)):
      _, sel = jaxtopk.grow_selection(
        q, index, pos, eps=eps, max_groups=np.int64(1)
      )
      self.assertEqual(sel.certificate.valid.shape, (B, 1, H))


if __name__ == "__main__":
  absltest.main()
