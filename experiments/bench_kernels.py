"""Benchmark: Pallas certified Top-k kernels vs dense and XLA Top-k (GPU/TPU).

The kernels' benchmark, side by side in one run, per context length n (default
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

Goals (on a GPU): decode at n = 128K, eps = 0.01, >= 2x faster than
dense cuDNN decode; prefill within 1.3x of dense with every block kept, and
>= 2x faster than dense with 1/8 of the blocks kept.

Keys: ``config.key_layout = "clustered"`` (default) draws each block's keys
around a block centre (local structure, as real caches have, so box bounds
are informative); ``"iid"`` uses independent normal keys (box bounds then
prune little).
A few "needle" blocks per head are aligned with the query (retrieval).

Each timing is the median and min of ``config.repeats`` runs after a
warm-up (compile) run. On CPU the kernels only run in Pallas interpret mode,
whose timings say nothing about speed: the binary then REFUSES to time
anything unless the config is the smoke one, which runs a tiny correctness
check (kernels vs their references) and records no timings. Writes
``results.json`` (device, machine, load), ``metrics.jsonl`` and, with
timings, ``timings.png`` into the workdir.

Launch (GPU; experiments/README.md):
  python -m experiments.bench_kernels \
    --config=experiments/configs/bench_kernels.py --workdir=/tmp/bench_kernels
Smoke (CPU, seconds, correctness only): ``...bench_kernels.py:smoke``.
"""

import jax
import jax.numpy as jnp
from absl import app

import jaxtopk
from experiments import _common
from jaxtopk import kernels

NAME = "bench_kernels"

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


def bench_decode(c, n):
  """Decode timings at ``n`` keys for config ``c``."""
  repeats = c.repeats
  h, hk, d, bk = c.heads, c.kv_heads, c.head_dim, c.block
  q, k, v = make_inputs(
    n, heads=h, kv_heads=hk, d=d, block=bk, keys=c.key_layout, q_len=1
  )
  rec = {}
  for impl in ("cudnn", "xla"):
    f = jax.jit(
      lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
        _bhtd(q), _bhtd(k), _bhtd(v), implementation=impl
      )
    )
    rec[f"dense_{impl}"] = _try(lambda f=f: f(q, k, v), repeats)
  cache = jaxtopk.KVCache.create(1, n, hk, d, block_size=bk, dtype=k.dtype)
  cache = cache.append(_bhtd(k), _bhtd(v))
  pol = jaxtopk.Certified(c.eps, jaxtopk.DeltaSearch(bk))
  xla = jax.jit(lambda q, c: jaxtopk.decode_attention(q, c, policy=pol))
  rec["xla_topk_delta"] = _try(lambda: xla(_bhtd(q), cache), repeats)
  box = cache.box()
  sizes = kernels.decode.BlockSizes(bk, c.splits)
  pal = jax.jit(
    lambda q, k, v, box, vn: kernels.certified_decode(
      q,
      k,
      v,
      eps=c.eps,
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


def bench_prefill(c, n):
  """Prefill timings at ``n`` tokens for config ``c``."""
  repeats = c.repeats
  h, hk, d, bk = c.heads, c.kv_heads, c.head_dim, c.block
  q, k, v = make_inputs(
    n, heads=h, kv_heads=hk, d=d, block=bk, keys=c.key_layout, q_len=n
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
  sizes = kernels.sparse_flash.BlockSizes(bk, bk)
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
      eps=c.eps,
      is_causal=True,
      block_sizes=sizes,
      interpret=INTERPRET,
    )
  )
  rec["pallas_certified_prefill"] = _try(lambda: cert_fn(q, k, v), repeats)
  pol = jaxtopk.Certified(c.eps, jaxtopk.Auto(bk))
  xla = jax.jit(
    lambda q, k, v: jaxtopk.topk_attention(
      _bhtd(q), _bhtd(k), _bhtd(v), policy=pol, is_causal=True
    )
  )
  rec["xla_topk_certified"] = _try(lambda: xla(q, k, v), repeats)
  return rec


def smoke() -> dict:
  """Interpret-mode correctness at a tiny size; records no timings."""
  q, k, v = make_inputs(
    256, heads=2, kv_heads=1, d=16, block=32, keys="clustered", q_len=1
  )
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  sizes = kernels.decode.BlockSizes(32, 2)
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


def _min_times(row):
  return {
    k: v["min_s"]
    for k, v in row.items()
    if isinstance(v, dict) and "min_s" in v
  }


def measure(c, on_row=None) -> dict:
  """The record of config ``c``: timings, or the smoke check on CPU.

  ``on_row(phase, n, row)`` is called as each row is measured, so that a run
  cut short by a time limit keeps the rows it finished.
  """
  backend = jax.default_backend()
  rec = dict(
    device=str(jax.devices()[0].device_kind),
    backend=backend,
    meta=_common.machine_info(),
    layout="head-major [b, h, n, d] for kernels; jax.nn [b, n, h, d] dense",
    eps=c.eps,
    keys=c.key_layout,
  )
  if c.smoke or backend == "cpu":
    rec["timings"] = None
    rec["note"] = (
      "No timings: on CPU the Pallas kernels run in interpret mode, whose"
      " timings are not speed. Correctness check only."
    )
    rec["smoke"] = smoke()
    return rec
  rec["decode"], rec["prefill"] = {}, {}
  progress = _common.Progress(NAME, len(c.lengths))
  for n in c.lengths:
    rec["decode"][n] = bench_decode(c, n)
    if on_row:
      on_row("decode", n, rec["decode"][n])
    if n <= c.prefill_max:
      rec["prefill"][n] = bench_prefill(c, n)
      if on_row:
        on_row("prefill", n, rec["prefill"][n])
    progress.update(note=f"n={n}")
  return rec


def run(config, workdir, *, overwrite: bool = False) -> dict:
  """Runs the benchmark (refuses to time on CPU unless smoke)."""
  if jax.default_backend() == "cpu" and not config.smoke:
    raise app.UsageError(
      "bench_kernels refuses to time Pallas interpret mode on CPU (it is not"
      " speed). Run on a GPU/TPU, or use the :smoke config for a"
      " correctness check."
    )
  wd = _common.Workdir(workdir, config, overwrite=overwrite)
  rec = measure(
    config,
    on_row=lambda phase, n, row: wd.metrics.write(
      phase, n=n, **_min_times(row)
    ),
  )
  if rec.get("smoke"):
    cert = rec["smoke"]["decode_certificate"]
    _common.bar_figure(
      wd.path,
      "smoke",
      {
        "decode kernel": {
          "max |kernel - reference|": rec["smoke"][
            "decode_max_abs_diff_vs_reference"
          ],
          "tv_bound max (eps 0.05)": cert["tv_bound_max"],
        }
      },
      ylabel="value",
      title="Smoke (interpret mode): correctness, no timings",
    )
    wd.metrics.write(
      "smoke",
      **rec["smoke"]["decode_certificate"],
      decode_max_abs_diff_vs_reference=rec["smoke"][
        "decode_max_abs_diff_vs_reference"
      ],
    )
  if rec.get("decode"):
    _common.bar_figure(
      wd.path,
      "timings",
      {f"n={n}": _min_times(row) for n, row in rec["decode"].items()},
      ylabel="decode seconds (min)",
      title=f"{rec['device']}: one decode step",
      log=True,
    )
  wd.write_json("results.json", rec)
  return rec


if __name__ == "__main__":
  _common.app_main(NAME, run)
