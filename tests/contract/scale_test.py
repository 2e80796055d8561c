"""A logit scale below float32's smallest normal, on every public path.

A CPU reads a subnormal scale (1.1e-38) as 0: every logit reads 0 while the
exact ones are of order one (q, k ~ 1e19), and tv_bound was 0.94 against a
true tau of 0.99. A static scale below ``core.MIN_SCALE`` is refused by name
on every path; a traced one makes its rows invalid.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

import jaxtopk
from jaxtopk import parallel
from jaxtopk.selection import core

SUB = 1.1e-38  # subnormal in float32
D, N = 4, 8


def _inputs():
  rng = np.random.default_rng(0)
  q = (1e19 * rng.normal(size=(1, 2, 2, D))).astype(np.float32)
  k = (6e18 * rng.normal(size=(1, N, 1, D))).astype(np.float32)
  v = rng.normal(size=(1, N, 1, 3)).astype(np.float32)
  return q, k, v


@functools.cache
def _data():
  """Inputs, cache, index and mesh: built on first use, not when pytest
  collects the module (every xdist worker collects it)."""
  q, k, v = _inputs()
  cache = jaxtopk.KVCache.create(1, N, 1, D, block_size=4, value_dim=3)
  return types.SimpleNamespace(
    q=q,
    k=k,
    v=v,
    q1=q[:, :1],
    cache=cache.append(k, v),
    index=jaxtopk.IndexedKVCache.build(k, v, group_size=4),
    pos=np.zeros((1, 1, 1, 1), np.int32),
    mesh=parallel.make_mesh({"kv": 1}),
  )


def _paths():
  """name -> fn(scale) running one public path."""
  x = _data
  delta = jaxtopk.Certified(0.1, jaxtopk.DeltaSearch(block_size=4))
  return {
    "topk_attention": lambda s: jaxtopk.topk_attention(
      x().q, x().k, x().v, policy=jaxtopk.FixedK(1), scale=s
    ),
    "decode_kvcache": lambda s: jaxtopk.decode_attention(
      x().q1, x().cache, policy=delta, scale=s
    ),
    "decode_index": lambda s: jaxtopk.decode_attention(
      x().q1, x().index, policy=delta, scale=s
    ),
    "certify_selection": lambda s: jaxtopk.certify_selection(
      x().q1, x().index, x().pos, scale=s
    ),
    "grow_selection": lambda s: jaxtopk.grow_selection(
      x().q1, x().index, x().pos, eps=0.1, scale=s
    ),
    "sharded_topk_attention": lambda s: parallel.sharded_topk_attention(
      x().q, x().k, x().v, policy=jaxtopk.FixedK(1), mesh=x().mesh, scale=s
    ),
    "certified_search": lambda s: jaxtopk.certified_search(
      x().q[0, 0],
      jnp.broadcast_to(x().k[0, :, 0], (2, N, D)),
      policy=delta,
      scale=s,
    ),
  }


PATHS = _paths()


def _cert(result):
  if isinstance(result, tuple):
    result = result[1]
  return getattr(result, "certificate", result)


class SubnormalScaleTest(parameterized.TestCase):
  def setUp(self):
    super().setUp()
    _data()  # built outside any trace (the paths run under jit)

  @parameterized.named_parameters(*[(n, n) for n in PATHS])
  def test_static_subnormal_scale_refused(self, name):
    with self.assertRaisesRegex(ValueError, r"scale=1\.1e-38"):
      PATHS[name](SUB)
    with self.assertRaisesRegex(ValueError, "scale"):
      PATHS[name](np.float32(1e-40))

  @parameterized.named_parameters(
    *[
      (n, n)
      for n in ("topk_attention", "decode_kvcache", "sharded_topk_attention")
    ]
  )
  def test_traced_subnormal_scale_makes_rows_invalid(self, name):
    # (The index paths: tests/attention/index_test.py, test_traced_scale.)
    fn = jax.jit(lambda s: _cert(PATHS[name](s)))
    bad = fn(jnp.float32(SUB))
    np.testing.assert_array_equal(bad.valid, False)
    self.assertTrue(np.all(np.isnan(bad.tv_bound)))
    ok = fn(jnp.float32(core.MIN_SCALE * 4))  # normal: certified
    np.testing.assert_array_equal(ok.valid, True)


if __name__ == "__main__":
  absltest.main()
