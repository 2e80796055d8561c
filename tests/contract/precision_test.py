"""Every product a certificate rests on runs at full float32 precision.

On GPU and TPU the DEFAULT matmul precision is not float32: TF32 passes on
an H100 (an f32 einsum over q, k ~ 4 N(0, 1), d = 128 had a logit error of
0.023, 5.8x ``core.logit_error_of``), bfloat16 passes on a TPU; the
certificates' rounding bound (THEORY 3.4) covers full float32 products
only. So every certificate-producing public path is exported here for
'cuda' and 'tpu' (``jax.export`` on CPU) and its StableHLO is read: every
floating ``dot_general`` must carry ``precision = [HIGHEST, HIGHEST]``
(``core.PRECISION``), except products under the name scope ``rank_only``
(they only order keys, e.g. the low-rank projection, whose bound is sound
for any projection).
"""

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

import jaxtopk
from jaxtopk.selection import core

B, T, H, HK, D, N, E, BS = 1, 3, 2, 1, 8, 16, 4, 4
_DOT = re.compile(r"stablehlo\.dot_general .*loc\((#loc\d+)\)")
_LOC = re.compile(r"^(#loc\d+) = loc\((.*)\)$")


def _inputs():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, N, HK, D)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, N, HK, E)), jnp.float32)
  return q, k, v


def _cache(k, v):
  cache = jaxtopk.KVCache.create(B, N, HK, D, block_size=BS, value_dim=E)
  return cache.append(k, v)


@functools.cache
def _data():
  """The inputs, cache and index of every path: built on first use, not
  when pytest collects the module (every xdist worker collects it)."""
  q, k, v = _inputs()
  rows_q = q.reshape(-1, D)
  rows_k = jnp.broadcast_to(k[0, :, 0], (rows_q.shape[0], N, D))
  return types.SimpleNamespace(
    q=q,
    k=k,
    v=v,
    q1=q[:, :1],
    cache=_cache(k, v),
    index=jaxtopk.IndexedKVCache.build(k, v, group_size=BS),
    pos=jnp.zeros((B, 1, 1, 3), jnp.int32),
    key=jax.random.key(0),
    rows_q=rows_q,
    rows_k=rows_k,
    rows_v=jnp.broadcast_to(v[0, :, 0], (rows_q.shape[0], N, E)),
    logits=jnp.einsum("rd,rnd->rn", rows_q, rows_k, precision=core.PRECISION),
  )


def _paths():
  """name -> a function of no argument running one certified path."""
  x = _data
  delta = jaxtopk.Certified(0.1, jaxtopk.DeltaSearch(block_size=BS))
  mc = jaxtopk.Certified(0.1, jaxtopk.MCSearch(block_size=BS, num_samples=2))
  lowrank = jaxtopk.Certified(
    0.1, jaxtopk.DeltaSearch(block_size=BS, bound=jaxtopk.LowRank(2))
  )
  paths = {}
  for name, pol in (
    ("dense", jaxtopk.Dense()),
    ("fixed_k", jaxtopk.FixedK(3)),
    ("exact", jaxtopk.Certified(0.1, jaxtopk.Auto(block_size=BS))),
    ("delta", delta),
  ):
    paths[f"topk_attention_{name}"] = lambda pol=pol: jaxtopk.topk_attention(
      x().q, x().k, x().v, policy=pol
    )
  for name, pol in (
    ("fixed_k", jaxtopk.FixedK(3)),
    ("exact", jaxtopk.Certified(0.1, jaxtopk.Auto(block_size=BS))),
    ("delta", delta),
    ("mc", mc),
  ):
    paths[f"decode_kvcache_{name}"] = lambda pol=pol: jaxtopk.decode_attention(
      x().q1, x().cache, policy=pol, rng=x().key
    )
    paths[f"decode_index_{name}"] = lambda pol=pol: jaxtopk.decode_attention(
      x().q1, x().index, policy=pol, rng=x().key
    )
  paths["certify_selection"] = lambda: jaxtopk.certify_selection(
    x().q1, x().index, x().pos
  )
  paths["grow_selection"] = lambda: jaxtopk.grow_selection(
    x().q1, x().index, x().pos, eps=0.1
  )
  for name, pol in (
    ("exact", jaxtopk.Certified(0.1, jaxtopk.Auto(block_size=BS))),
    ("delta", delta),
    ("mc", mc),
    ("lowrank", lowrank),
  ):
    paths[f"certified_search_{name}"] = lambda pol=pol: (
      jaxtopk.certified_search(
        x().rows_q, x().rows_k, policy=pol, values=x().rows_v, rng=x().key
      )
    )
  paths["select"] = lambda: jaxtopk.select(
    x().logits, jaxtopk.Certified(0.1), values=x().rows_v
  )
  return paths


PATHS = _paths()


def _unpinned_dots(text):
  """Floating dot_generals without HIGHEST precision outside ``rank_only``:
  a list of their location names."""
  locs = {}
  for line in text.splitlines():
    m = _LOC.match(line.strip())
    if m:
      locs[m.group(1)] = m.group(2)

  def name_of(loc):
    seen = set()
    out = []
    while loc in locs and loc not in seen:  # follow nested locations
      seen.add(loc)
      out.append(locs[loc])
      nxt = re.findall(r"#loc\d+", locs[loc])
      if not nxt:
        break
      loc = nxt[0]
    return " <- ".join(out)

  bad = []
  for line in text.splitlines():
    if "stablehlo.dot_general" not in line:
      continue
    types = line.split(" : ")[-1]
    if not re.search(r"x(f32|f64|bf16|f16)>", types):
      continue  # integer products: exact at any precision
    if "precision = [HIGHEST, HIGHEST]" in line:
      continue
    m = _DOT.search(line)
    where = name_of(m.group(1)) if m else line.strip()
    if "rank_only" in where:
      continue
    bad.append(where)
  return bad


class PrecisionTest(parameterized.TestCase):
  def setUp(self):
    super().setUp()
    _data()  # built outside any trace (the paths run under jit)

  @parameterized.named_parameters(*[(name, name) for name in PATHS])
  def test_certificate_products_at_highest_precision(self, name):
    exported = jax.export.export(
      jax.jit(PATHS[name]), platforms=("cuda", "tpu")
    )()
    text = exported.mlir_module()
    if name != "select":  # select is given its logits: no product at all
      self.assertTrue("stablehlo.dot_general" in text, name)
    bad = _unpinned_dots(text)
    self.assertEmpty(
      bad, f"{name}: dot_general below HIGHEST:\n" + "\n".join(bad)
    )

  def test_the_check_can_fail(self):
    def fn():
      x = jnp.ones((3, 4))
      return jnp.einsum("ij,kj->ik", x, x)  # default precision

    text = jax.export.export(jax.jit(fn), platforms=("cuda", "tpu"))()
    self.assertLen(_unpinned_dots(text.mlir_module()), 2)  # one per platform


if __name__ == "__main__":
  absltest.main()
