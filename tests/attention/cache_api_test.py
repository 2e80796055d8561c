"""The caches' methods: create/build, append (donating), rebuild, aliases."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx

import jaxtopk
from jaxtopk import nn as topk_nn
from tests import rand
from tests.tolerances import assert_same_up_to_rounding

B, HK, D, DV = 3, 2, 5, 7
N, BS = 48, 8  # capacity and block / group size
S = 13  # positions an index is built on
# Appends are 2 steps and builds S keys throughout: one compilation each.


def _kv(seed, steps):
  kk, kv = jax.random.split(jax.random.key(seed))
  return (
    rand.normal(kk, (B, steps, HK, D)),
    rand.normal(kv, (B, steps, HK, DV)),
  )


def _build(k, v, lengths=None):
  return jaxtopk.IndexedKVCache.build(
    k, v, lengths=lengths, max_len=N, group_size=BS
  )


def _empty(kind):
  if kind == "cache":
    return jaxtopk.KVCache.create(B, N, HK, D, block_size=BS, value_dim=DV)
  return _build(*_kv(9, S), jnp.array([S, 4, 9]))


def _old_append(cache, k, v, num_steps):
  """The deprecated, non-donating free function of each cache type."""
  old = (
    jaxtopk.kv_cache_update
    if isinstance(cache, jaxtopk.KVCache)
    else jaxtopk.kv_index_update
  )
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return old(cache, k, v, num_steps=num_steps)


def _assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert_same_up_to_rounding(x, y)  # NaN == NaN here


def _deleted(tree):
  return [x.is_deleted() for x in jax.tree.leaves(tree)]


KINDS = (("cache", "cache"), ("index", "index"))


class AppendTest(parameterized.TestCase):
  @parameterized.named_parameters(*KINDS)
  def test_same_as_copying_append(self, kind):
    # The donated, in-place update keeps exactly what the copying one
    # computes: every key, code and summary, over ragged appends.
    k, v = _kv(0, 6)
    k = k.at[0, 3, 1, 2].set(jnp.nan)  # a broken key marks its row
    ref, got = _empty(kind), _empty(kind)
    for lo, steps in ((0, [2, 2, 2]), (2, [2, 0, 1]), (4, [2, 1, 0])):
      kk, vv, steps = k[:, lo : lo + 2], v[:, lo : lo + 2], np.array(steps)
      ref = _old_append(ref, kk, vv, steps)
      got = got.append(kk, vv, num_steps=steps)
    _assert_same(got, ref)

  @parameterized.named_parameters(*KINDS)
  def test_old_object_is_deleted_not_reused(self, kind):
    cache = _empty(kind)
    k, v = _kv(1, 2)
    new = cache.append(k, v)
    self.assertTrue(all(_deleted(cache)))
    self.assertFalse(any(_deleted(new)))
    with self.assertRaisesRegex(RuntimeError, r"\.append: .* deleted"):
      cache.append(k, v)
    q = jnp.ones((B, 1, HK, D))
    with self.assertRaisesRegex(RuntimeError, "deleted"):
      jaxtopk.decode_attention(q, cache, policy=jaxtopk.Dense())
    if kind == "index":
      with self.assertRaisesRegex(RuntimeError, "rebuild"):
        cache.rebuild()
    else:
      with self.assertRaisesRegex(RuntimeError, "from_cache"):
        jaxtopk.IndexedKVCache.from_cache(cache, group_size=BS)

  @parameterized.named_parameters(*KINDS)
  def test_under_jit_the_input_stays(self, kind):
    cache = _empty(kind)
    k, v = _kv(2, 2)
    # k and v as arguments: as constants XLA folds their norms at compile
    # time, with another rounding than the update's own (both sound).
    f = jax.jit(lambda c, k, v, n: c.append(k, v, num_steps=n))
    got = f(cache, k, v, jnp.array([2, 1, 0]))
    self.assertFalse(any(_deleted(cache)))
    _assert_same(got, _old_append(cache, k, v, np.array([2, 1, 0])))

  @parameterized.named_parameters(*KINDS)
  def test_bad_append_donates_nothing(self, kind):
    # Refused arguments are named before anything is donated.
    cache = _empty(kind)
    k, v = _kv(3, 2)
    with self.assertRaisesRegex(ValueError, "values must be"):
      cache.append(k, k)
    with self.assertRaisesRegex(ValueError, r"num_steps=\[3, 0, 0\]"):
      cache.append(k, v, num_steps=np.array([3, 0, 0]))
    with self.assertRaisesRegex(TypeError, "keys must be real"):
      cache.append(k.astype(jnp.int32), v)
    self.assertFalse(any(_deleted(cache)))

  @parameterized.named_parameters(*KINDS)
  def test_compiled_append_updates_in_place(self, kind):
    # XLA's memory analysis of the donated append: every byte of the cache
    # is aliased to the output (updated in place), temporaries are small;
    # the copying append aliases nothing (it writes a new cache).
    from jaxtopk.attention import _cache
    from jaxtopk.attention import _index

    cache = _empty(kind)
    k, v = _kv(7, 2)
    steps = jnp.full((B,), 2, jnp.int32)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(cache))
    fns = dict(
      cache=(_cache._append, _cache._update),
      index=(_index._index_append, _index._index_update),
    )[kind]
    donated, copying = (
      f.lower(cache, k, v, steps).compile().memory_analysis() for f in fns
    )
    self.assertEqual(donated.alias_size_in_bytes, nbytes)
    self.assertLess(donated.temp_size_in_bytes, nbytes)
    self.assertEqual(copying.alias_size_in_bytes, 0)

  def test_donation_leaves_other_arrays_alone(self):
    # Arrays the user passed in (lengths) or a rebuild read stay valid.
    k, v = _kv(4, S)
    lengths = jnp.array([S, 4, 9])
    index = _build(k, v, lengths)
    rebuilt = index.rebuild()
    index = index.append(k[:, :2], v[:, :2])
    np.testing.assert_array_equal(lengths, [S, 4, 9])
    np.testing.assert_array_equal(rebuilt.length, [S, 4, 9])
    np.testing.assert_array_equal(index.length, [S + 2, 6, 11])
    cache = _empty("cache").append(k[:, :2], v[:, :2])
    from_cache = jaxtopk.IndexedKVCache.from_cache(cache, group_size=BS)
    cache = cache.append(k[:, :2], v[:, :2])
    np.testing.assert_array_equal(from_cache.length, [2, 2, 2])
    np.testing.assert_array_equal(cache.length, [4, 4, 4])


class CreateTest(parameterized.TestCase):
  @parameterized.parameters(
    (dict(kv_heads=0), "kv_heads=0"),
    (dict(head_dim=True), "head_dim=True"),
    (dict(value_dim=0), "value_dim=0"),
    (dict(max_len=20), "max_len=20"),
  )
  def test_sizes_named(self, kwargs, fragment):
    args = dict(batch=B, max_len=N, kv_heads=HK, head_dim=D) | kwargs
    with self.assertRaisesRegex(ValueError, fragment):
      jaxtopk.KVCache.create(**args, block_size=BS)


class DeprecatedAliasTest(absltest.TestCase):
  def test_aliases_warn_naming_the_method(self):
    k, v = _kv(5, S)
    k2, v2 = k[:, :2], v[:, :2]
    cache = lambda: _empty("cache")
    calls = {
      ("init_kv_cache", "KVCache.create"): lambda: jaxtopk.init_kv_cache(
        B, N, HK, D, block_size=BS, value_dim=DV
      ),
      ("kv_cache_update", "KVCache.append"): lambda: jaxtopk.kv_cache_update(
        cache(), k2, v2
      ),
      ("build_kv_index", "IndexedKVCache.build"): lambda: (
        jaxtopk.build_kv_index(k, v, max_len=N, group_size=BS)
      ),
      ("kv_index_from_cache", "IndexedKVCache.from_cache"): lambda: (
        jaxtopk.kv_index_from_cache(cache().append(k2, v2), group_size=BS)
      ),
      ("kv_index_update", "IndexedKVCache.append"): lambda: (
        jaxtopk.kv_index_update(_build(k, v), k2, v2)
      ),
      ("rebuild_kv_index", "IndexedKVCache.rebuild"): lambda: (
        jaxtopk.rebuild_kv_index(_build(k, v))
      ),
    }
    for (old, new), call in calls.items():
      with self.assertWarnsRegex(DeprecationWarning, rf"{old}.*{new}"):
        call()

  def test_old_update_does_not_donate(self):
    cache = _empty("cache")
    k, v = _kv(6, 2)
    with self.assertWarns(DeprecationWarning):
      jaxtopk.kv_cache_update(cache, k, v)
    self.assertFalse(any(_deleted(cache)))


class FlaxDecodeTest(absltest.TestCase):
  def test_eager_decode_leaves_a_clone_valid(self):
    # The layer appends without donating: a clone shares the cache arrays.
    layer = topk_nn.CertifiedTopKAttention(
      num_heads=2,
      in_features=6,
      policy=jaxtopk.FixedK(2),
      decode=False,
      rngs=nnx.Rngs(0),
    )
    layer.init_cache((3, 4, 6))
    x = jnp.ones((3, 1, 6))
    layer(x, decode=True)
    clone = nnx.clone(layer)
    y1 = layer(x, decode=True)
    y2 = clone(x, decode=True)
    np.testing.assert_array_equal(y1, y2)


if __name__ == "__main__":
  absltest.main()
