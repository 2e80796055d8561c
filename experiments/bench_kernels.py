"""Benchmark: Pallas certified Top-k kernels vs dense and XLA Top-k (GPU/TPU).

Issue #4's benchmark, side by side in one run, per context length n (default
8K .. 128K), head_dim 128, on attention with planted retrieval structure:

- decode (one query per head over a head-major KV cache):
  dense ``jax.nn.dot_product_attention`` with implementation='cudnn' and
  'xla', the XLA Top-k path (``jaxtopk.decode_attention`` with
  ``Certified(eps, search='delta')``) and the Pallas kernel
  (``jaxtopk.kernels.certified_decode``);
- prefill (q_len = n, causal): dense cudnn / xla, and the Pallas sparse
  flash kernel with every block kept and with 1/8 of the blocks kept, and the
  full certified pipeline (``certified_sparse_attention``). The XLA Top-k
  prefill materialises [b, h, n, n] logits and is only run while that fits.

Goals (issue #4, on a GPU): decode at n = 128K, eps = 0.01, >= 2x faster than
dense cuDNN decode; prefill within 1.3x of dense with every block kept, and
>= 2x faster than dense with 1/8 of the blocks kept.

Keys: ``--keys=clustered`` (default) draws each block's keys around a block
centre (local structure, as real caches have, so box bounds are informative);
``--keys=iid`` uses independent normal keys (box bounds then prune little).
A few "needle" blocks per head are aligned with the query (retrieval).

Each timing is the median and min of ``--repeats`` runs after a warm-up
(compile) run. On CPU the kernels only run in Pallas interpret mode, whose
timings say nothing about speed: the script then REFUSES to time anything
unless ``--smoke``, which runs a tiny correctness check (kernels vs their
references) and records no timings.

Launch (GPU):
  python -m experiments.bench_kernels --out=/tmp/bench_kernels.json
Smoke (CPU, seconds, correctness only):
  python -m experiments.bench_kernels --out=/tmp/b.json --smoke
"""

import json
import platform

import jax
import jax.numpy as jnp
from absl import app
from absl import flags

import jaxtopk
from experiments import _common
from jaxtopk import kernels

_OUT = flags.DEFINE_string("out", None, "JSON file to write.", required=True)
_LENGTHS = flags.DEFINE_list(
  "lengths", ["8192", "16384", "32768", "65536", "131072"], "Context lengths."
)
_HEADS = flags.DEFINE_integer("heads", 8, "Query heads.")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 8, "KV heads (GQA if fewer).")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head dimension.")
_EPS = flags.DEFINE_float("eps", 0.01, "Certified dropped-mass budget.")
_BLOCK = flags.DEFINE_integer("block", 128, "Key block (and query tile).")
_SPLITS = flags.DEFINE_integer("splits", 16, "Split-K programs per head.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs after warm-up.")
_KEYS = flags.DEFINE_enum("keys", "clustered", ["clustered", "iid"], "Keys.")
_PREFILL_MAX = flags.DEFINE_integer(
  "prefill_max", 32768, "Longest n for the prefill rows (q_len = n)."
)
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny correctness run (CPU ok).")

# Tests set this to exercise the timing code paths on CPU; its timings are
# never written as results (``run`` refuses to time on CPU).
INTERPRET = False


def _try(fn, repeats):
  try:
    return _common.time_call(fn, repeats)
  except Exception as e:  # noqa: BLE001 - record why a baseline cannot run
    return dict(error=f"{type(e).__name__}: {str(e)[:300]}")


def make_inputs(n, *, heads, kv_heads, d, block, keys, q_len, seed=0):
  """Head-major q [1, h, q_len, d], k/v [1, h_kv, n, d] (bf16), planted.

  Every head has 4 needle blocks whose keys point along that head's query
  direction, so a few blocks hold most of the softmax mass.
  """
  ks = jax.random.split(jax.random.key(seed), 6)
  nb = n // block
  if keys == "clustered":
    centre = jax.random.normal(ks[0], (1, kv_heads, nb, d))
    k = jnp.repeat(centre, block, axis=2)
    k = k + 0.3 * jax.random.normal(ks[1], (1, kv_heads, n, d))
  else:
    k = jax.random.normal(ks[1], (1, kv_heads, n, d))
  qdir = jax.random.normal(ks[2], (1, kv_heads, 1, d))
  qdir = qdir / jnp.linalg.norm(qdir, axis=-1, keepdims=True)
  needles = jax.random.choice(ks[3], nb, (min(4, nb),), replace=False)
  pos = (needles[:, None] * block + jnp.arange(block)).reshape(-1)
  k = k.at[:, :, pos].set(
    4.0 * jnp.sqrt(d) * qdir
    + 0.3 * jax.random.normal(ks[4], (1, kv_heads, pos.size, d))
  )
  g = heads // kv_heads
  q = jnp.repeat(qdir, g, axis=1) * 3.0
  q = q + 0.1 * jax.random.normal(ks[5], (1, heads, q_len, d))
  v = jax.random.normal(ks[0], (1, kv_heads, n, d))
  return (x.astype(jnp.bfloat16) for x in (q, k, v))


def _bhtd(x):
  return jnp.swapaxes(x, 1, 2)  # head-major -> jax.nn layout


def bench_decode(n, repeats):
  h, hk, d, bk = _HEADS.value, _KV_HEADS.value, _HEAD_DIM.value, _BLOCK.value
  q, k, v = make_inputs(
    n, heads=h, kv_heads=hk, d=d, block=bk, keys=_KEYS.value, q_len=1
  )
  rec = {}
  for impl in ("cudnn", "xla"):
    f = jax.jit(
      lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
        _bhtd(q), _bhtd(k), _bhtd(v), implementation=impl
      )
    )
    rec[f"dense_{impl}"] = _try(lambda f=f: f(q, k, v), repeats)
  cache = jaxtopk.init_kv_cache(1, n, hk, d, block_size=bk, dtype=k.dtype)
  cache = jaxtopk.kv_cache_update(cache, _bhtd(k), _bhtd(v))
  pol = jaxtopk.Certified(_EPS.value, search="delta", block_size=bk)
  xla = jax.jit(lambda q, c: jaxtopk.decode_attention(q, c, policy=pol))
  rec["xla_topk_delta"] = _try(lambda: xla(_bhtd(q), cache), repeats)
  box = cache.box()
  sizes = kernels.DecodeSizes(bk, _SPLITS.value)
  pal = jax.jit(
    lambda q, k, v, box, vn: kernels.certified_decode(
      q,
      k,
      v,
      eps=_EPS.value,
      summary=box,
      value_norms=vn,
      block_sizes=sizes,
      interpret=INTERPRET,
    )
  )
  args = (q[:, :, 0], k, v, box, cache.vnorm)
  rec["pallas_certified_decode"] = _try(lambda: pal(*args), repeats)
  try:
    _, cert = pal(*args)
    rec["pallas_certificate"] = cert.summary()
  except Exception as e:  # noqa: BLE001
    rec["pallas_certificate"] = dict(error=str(e)[:300])
  return rec


def bench_prefill(n, repeats):
  h, hk, d, bk = _HEADS.value, _KV_HEADS.value, _HEAD_DIM.value, _BLOCK.value
  q, k, v = make_inputs(
    n, heads=h, kv_heads=hk, d=d, block=bk, keys=_KEYS.value, q_len=n
  )
  rec = {}
  for impl in ("cudnn", "xla"):
    f = jax.jit(
      lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
        _bhtd(q), _bhtd(k), _bhtd(v), is_causal=True, implementation=impl
      )
    )
    rec[f"dense_{impl}"] = _try(lambda f=f: f(q, k, v), repeats)
  nqt = nkb = n // bk
  sizes = kernels.SparseFlashSizes(bk, bk)
  for name, keep in (("all", nkb), ("eighth", max(1, nkb // 8))):
    # Causal: tile t may use blocks 0..t; keep the last `keep` of them.
    t = jnp.arange(nqt)[:, None]
    j = jnp.arange(keep)[None, :]
    idx = jnp.clip(t - keep + 1 + j, 0, t).astype(jnp.int32)
    cnt = jnp.minimum(t[:, 0] + 1, keep).astype(jnp.int32)
    idx = jnp.broadcast_to(idx, (1, h, nqt, keep))
    cnt = jnp.broadcast_to(cnt, (1, h, nqt))
    f = jax.jit(
      lambda q, k, v, i, c: kernels.sparse_flash_attention(
        q, k, v, i, c, is_causal=True, block_sizes=sizes, interpret=INTERPRET
      )
    )
    rec[f"pallas_sparse_flash_{name}_blocks"] = _try(
      lambda f=f, i=idx, c=cnt: f(q, k, v, i, c), repeats
    )
  cert_fn = jax.jit(
    lambda q, k, v: kernels.certified_sparse_attention(
      q,
      k,
      v,
      eps=_EPS.value,
      is_causal=True,
      block_sizes=sizes,
      interpret=INTERPRET,
    )
  )
  rec["pallas_certified_prefill"] = _try(lambda: cert_fn(q, k, v), repeats)
  if n * n * h * 4 <= 8 * 2**30:
    pol = jaxtopk.Certified(_EPS.value, block_size=bk)
    xla = jax.jit(
      lambda q, k, v: jaxtopk.topk_attention(
        _bhtd(q), _bhtd(k), _bhtd(v), policy=pol, is_causal=True
      )
    )
    rec["xla_topk_certified"] = _try(lambda: xla(q, k, v), repeats)
  else:
    rec["xla_topk_certified"] = dict(skipped="[b, h, n, n] logits > 8 GiB")
  return rec


def smoke() -> dict:
  """Interpret-mode correctness at a tiny size; records no timings."""
  q, k, v = make_inputs(
    256, heads=2, kv_heads=1, d=16, block=32, keys="clustered", q_len=1
  )
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  sizes = kernels.DecodeSizes(32, 2)
  out, cert = kernels.certified_decode(
    q[:, :, 0], k, v, eps=0.05, block_sizes=sizes, interpret=True
  )
  ref, _, _ = kernels.certified_decode_reference(
    q[:, :, 0], k, v, eps=0.05, block_sizes=sizes
  )
  return dict(
    decode_max_abs_diff_vs_reference=float(jnp.max(jnp.abs(out - ref))),
    decode_certificate=cert.summary(),
  )


def run(smoke_only: bool) -> dict:
  backend = jax.default_backend()
  rec = dict(
    device=str(jax.devices()[0].device_kind),
    backend=backend,
    jax=jax.__version__,
    host=platform.node(),
    layout="head-major [b, h, n, d] for kernels; jax.nn [b, n, h, d] dense",
    eps=_EPS.value,
    keys=_KEYS.value,
  )
  if smoke_only or backend == "cpu":
    rec["timings"] = None
    rec["note"] = (
      "No timings: on CPU the Pallas kernels run in interpret mode, whose"
      " timings are not speed. Correctness check only."
    )
    rec["smoke"] = smoke()
    return rec
  rec["decode"], rec["prefill"] = {}, {}
  for n in map(int, _LENGTHS.value):
    rec["decode"][n] = bench_decode(n, _REPEATS.value)
    if n <= _PREFILL_MAX.value:
      rec["prefill"][n] = bench_prefill(n, _REPEATS.value)
  return rec


def main(argv):
  del argv
  if jax.default_backend() == "cpu" and not _SMOKE.value:
    raise app.UsageError(
      "bench_kernels refuses to time Pallas interpret mode on CPU (it is not"
      " speed). Run on a GPU/TPU, or pass --smoke for a correctness check."
    )
  rec = run(_SMOKE.value)
  with open(_OUT.value, "w") as f:
    json.dump(rec, f, indent=1, default=str)
  print(json.dumps(rec, indent=1, default=str)[:4000])


if __name__ == "__main__":
  app.run(main)
