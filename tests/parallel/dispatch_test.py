"""implementation='sharded' of topk_attention / decode_attention: the
registry's sharded ops over the mesh of ``jax.set_mesh``."""

import jax
import numpy as np
from absl.testing import absltest

import jaxtopk
from jaxtopk import parallel
from tests import rand

B, T, N, H, HK, D = 1, 3, 8, 2, 1, 4


def _qkv():
  ks = jax.random.split(jax.random.key(1), 3)
  q = rand.normal(ks[0], (B, T, H, D))
  k = rand.normal(ks[1], (B, N, HK, D))
  v = rand.normal(ks[2], (B, N, HK, D))
  return q, k, v


def _equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


class ShardedDispatchTest(absltest.TestCase):
  def setUp(self):
    super().setUp()
    self.mesh = parallel.make_mesh({"kv": 1}, devices=jax.devices()[:1])

  def test_prefill(self):
    q, k, v = _qkv()
    kw = dict(policy=jaxtopk.FixedK(3), is_causal=True)
    want = parallel.sharded_topk_attention(q, k, v, mesh=self.mesh, **kw)
    with jax.set_mesh(self.mesh):
      got = jaxtopk.topk_attention(q, k, v, implementation="sharded", **kw)
    _equal(got, want)
    # No mesh: a refusal, named; in a sequence the next op runs.
    with self.assertRaisesRegex(NotImplementedError, "jax.set_mesh"):
      jaxtopk.topk_attention(q, k, v, implementation="sharded", **kw)
    _equal(
      jaxtopk.topk_attention(q, k, v, implementation=("sharded", "xla"), **kw),
      jaxtopk.topk_attention(q, k, v, **kw),
    )

  def test_decode(self):
    q, k, v = _qkv()
    cache = jaxtopk.KVCache.create(B, N, HK, D, block_size=4)
    cache = cache.append(k, v)
    policy = jaxtopk.FixedK(3)
    want = parallel.sharded_decode_attention(
      q[:, :1], cache, policy=policy, mesh=self.mesh
    )
    with jax.set_mesh(self.mesh):
      got = jaxtopk.decode_attention(
        q[:, :1], cache, policy=policy, implementation="sharded"
      )
      # Delta-Search is refused by name; the XLA decode takes it.
      delta = jaxtopk.Certified(0.1, jaxtopk.DeltaSearch(block_size=4))
      with self.assertRaisesRegex(
        jaxtopk.UnsupportedPolicyError, "implementation='sharded'"
      ):
        jaxtopk.decode_attention(
          q[:, :1], cache, policy=delta, implementation="sharded"
        )
    _equal(got, want)


if __name__ == "__main__":
  absltest.main()
