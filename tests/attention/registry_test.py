"""The registry of attention ops (``attention.registry``): dispatch by name,
sequence and cache type."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import jaxtopk
from jaxtopk.attention import registry
from jaxtopk.selection import UnsupportedPolicyError
from tests import rand

B, T, N, H, HK, D = 1, 3, 8, 2, 1, 4
BS = 4


def _qkv():
  ks = jax.random.split(jax.random.key(0), 3)
  q = rand.normal(ks[0], (B, T, H, D))
  k = rand.normal(ks[1], (B, N, HK, D))
  v = rand.normal(ks[2], (B, N, HK, D))
  return q, k, v


def _cache(k, v):
  cache = jaxtopk.KVCache.create(B, N, HK, D, block_size=BS)
  return cache.append(k, v)


def _equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


class OpsTest(absltest.TestCase):
  def test_registered_paths(self):
    for name in ("xla_prefill", "xla_decode", "index_decode"):
      self.assertIn(name, registry.OPS)
    self.assertIn("pallas", registry.implementations("prefill"))
    self.assertIn("pallas", registry.implementations("decode"))

  def test_refused_policy_falls_through(self):
    q, k, v = _qkv()
    policy = jaxtopk.FixedK(3)  # the Pallas prefill keeps whole blocks
    want = jaxtopk.topk_attention(q, k, v, policy=policy, implementation="xla")
    got = jaxtopk.topk_attention(
      q, k, v, policy=policy, implementation=("pallas", "xla")
    )
    _equal(got, want)

  def test_refused_argument_falls_through(self):
    q, k, v = _qkv()
    bias = jnp.ones((B, H, T, N))
    kw = dict(policy=jaxtopk.Dense(), bias=bias)
    want = jaxtopk.topk_attention(q, k, v, **kw)
    got = jaxtopk.topk_attention(
      q, k, v, implementation=["pallas", "xla"], **kw
    )
    _equal(got, want)

  def test_first_that_takes_the_call_runs(self):
    q, k, v = _qkv()
    # A block the compiled GPU kernels tile too (powers of 2 >= 16).
    kw = dict(policy=jaxtopk.Certified(0.1, jaxtopk.Auto(block_size=16)))
    want = jaxtopk.topk_attention(q, k, v, implementation="pallas", **kw)
    got = jaxtopk.topk_attention(
      q, k, v, implementation=("pallas", "xla"), **kw
    )
    _equal(got, want)

  def test_every_refusal_named(self):
    q, k, v = _qkv()
    with self.assertRaisesRegex(UnsupportedPolicyError, "'pallas'.*'xla'"):
      jaxtopk.topk_attention(
        q,
        k,
        v,
        policy=jaxtopk.Certified(0.1, "mc"),
        implementation=("pallas", "xla"),
      )

  def test_single_name_raises_its_refusal(self):
    q, k, v = _qkv()
    with self.assertRaisesRegex(
      UnsupportedPolicyError,
      r"^FixedK\(topk=3\) is not supported by topk_attention\(implementation="
      r"'pallas'\)",
    ):
      jaxtopk.topk_attention(
        q, k, v, policy=jaxtopk.FixedK(3), implementation="pallas"
      )

  def test_unknown_name_is_never_skipped(self):
    q, k, v = _qkv()
    for implementation in (("cuda", "xla"), (), "cuda", 3):
      with self.assertRaisesRegex(ValueError, "implementation="):
        jaxtopk.topk_attention(
          q, k, v, policy=jaxtopk.Dense(), implementation=implementation
        )

  def test_decode_dispatch_on_cache_type(self):
    q, k, v = _qkv()
    qd = q[:, :1]
    index = jaxtopk.IndexedKVCache.build(k, v, group_size=BS)
    policy = jaxtopk.FixedK(3)
    want = jaxtopk.decode_attention(qd, index, policy=policy)
    refused = registry.UnsupportedCacheError  # a ValueError
    with self.assertRaisesRegex(refused, "IndexedKVCache"):
      jaxtopk.decode_attention(
        qd, index, policy=policy, implementation="pallas"
      )
    got = jaxtopk.decode_attention(
      qd, index, policy=policy, implementation=("pallas", "xla")
    )
    _equal(got, want)
    with self.assertRaisesRegex(refused, "dict"):
      jaxtopk.decode_attention(qd, {}, policy=policy)

  def test_decode_traced_scale_falls_through(self):
    q, k, v = _qkv()
    qd, cache = q[:, :1], _cache(k, v)
    policy = jaxtopk.Dense()

    def run(implementation):
      return jax.jit(
        lambda s: jaxtopk.decode_attention(
          qd, cache, policy=policy, scale=s, implementation=implementation
        )
      )

    scale = jnp.float32(0.5)  # traced: the Pallas decode takes static ones
    _equal(run(("pallas", "xla"))(scale), run("xla")(scale))
    with self.assertRaisesRegex(NotImplementedError, "static"):
      run("pallas")(scale)

  def test_register_implementation_compat(self):
    q, k, v = _qkv()
    calls = []

    def refusing(*args, policy, **kwargs):
      calls.append(policy)
      raise NotImplementedError("refused by the backend itself")

    jaxtopk.attention.register_implementation("refusing", refusing)
    try:
      self.assertIn("refusing", jaxtopk.attention.IMPLEMENTATIONS)
      want = jaxtopk.topk_attention(q, k, v, policy=jaxtopk.Dense())
      got = jaxtopk.topk_attention(
        q, k, v, policy=jaxtopk.Dense(), implementation=("refusing", "xla")
      )
      _equal(got, want)
      self.assertLen(calls, 1)
    finally:
      del registry.OPS["refusing_prefill"]

  def test_decode_op_gets_the_prng_key_as_rng(self):
    q, k, v = _qkv()
    qd, cache = q[:, :1], _cache(k, v)
    search = jaxtopk.MCSearch(block_size=BS, num_samples=2)
    policy = jaxtopk.Certified(0.1, search)
    rng = jax.random.key(3)
    xla = registry.OPS["xla_decode"]
    seen = {}

    def new_style(query, cache, *, policy, scale, rng):
      seen["rng"] = rng
      return xla.fn(query, cache, policy=policy, scale=scale, rng=rng)

    def old_style(query, cache, *, policy, scale, key):
      seen["key"] = key
      return xla.fn(query, cache, policy=policy, scale=scale, rng=key)

    def op(name, fn):
      return registry.AttentionOp(
        name=f"{name}_decode",
        implementation=name,
        kind="decode",
        fn=fn,
        label=name,
        supports=xla.supports,
        cache_types=(jaxtopk.KVCache,),
      )

    want = jaxtopk.decode_attention(qd, cache, policy=policy, rng=rng)
    registry.register(op("new_style", new_style))
    with self.assertWarnsRegex(DeprecationWarning, "key="):
      registry.register(op("old_style", old_style))
    try:
      for name in ("new_style", "old_style"):
        got = jaxtopk.decode_attention(
          qd, cache, policy=policy, rng=rng, implementation=name
        )
        _equal(got, want)
      self.assertIs(seen["rng"], rng)
      self.assertIs(seen["key"], rng)
      # An op rebuilt from the wrapped one is neither warned about nor
      # wrapped again.
      with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        again = dataclasses.replace(
          registry.OPS["old_style_decode"],
          name="again_decode",
          implementation="again",
        )
      registry.register(again)
      got = jaxtopk.decode_attention(
        qd, cache, policy=policy, rng=rng, implementation="again"
      )
      _equal(got, want)
    finally:
      for name in ("new_style", "old_style", "again"):
        registry.OPS.pop(f"{name}_decode", None)

  def test_declarations_checked(self):
    with self.assertRaisesRegex(ValueError, "unknown arguments"):
      registry.AttentionOp(
        name="bad",
        implementation="bad",
        kind="prefill",
        fn=lambda: None,
        label="bad",
        arguments=frozenset({"dropout"}),
      )
    with self.assertRaisesRegex(ValueError, "cache types"):
      registry.AttentionOp(
        name="bad", implementation="bad", kind="decode", fn=None, label="bad"
      )


if __name__ == "__main__":
  absltest.main()
