r"""Benchmark: one decode step over a paged cache holding a ragged batch.

Sequences of different lengths (``config.lengths``) are prefilled in
chunks of ``config.chunk`` tokens (ragged ``num_steps``) into a
``jaxtopk.PagedKVCache`` and, for comparison, into a contiguous
``jaxtopk.KVCache`` holding the same keys. One decode step (one query per
sequence, ``heads`` query heads over ``kv_heads``) is then timed, every
variant jitted and timed round-robin:

- floor:       the logits alone over the contiguous cache (einsum q.K)
- gather:      ``PagedKVCache.gather()`` alone (the pages to a KVCache)
- dense_paged: ``decode_attention(policy=Dense())`` over the pages
- cert_paged:  ``decode_attention(policy=Certified(eps))`` over the pages
               (the default search, ``block_size = page_size``)
- dense_flat / cert_flat: the same over the contiguous cache

Workloads: ``flat``: keys and queries N(0, 1) (logit std 1: most of a
row's keys matter); ``topic``: each page's keys sit near its own random
centre (noise 0.2) and each query aims at one page of its sequence (4x
that page's centre), so a row's mass sits in a page or two.

``results.json`` records min and median times, the ratios to
``dense_paged``, the certificates' kept and scored fractions, the largest
``tv_bound``, whether the paged and contiguous outputs and certificates
agree up to rounding under one strategy (the key-code bound, its
candidates read from the pages; ``Certified(eps)`` itself may choose
differently per layout), the machine and the load;
``metrics.jsonl`` one row per workload; ``ratios.png``.

Part ``chunk``: one prefill chunk of ``config.chunk`` query steps at the
end of a ``KVCache`` of ``config.chunk_keys`` keys (batch 1; the steps
attend causally), per workload (the topic queries each aim at a random
page): ``jax.nn.dot_product_attention`` with the chunk's causal mask over
the same keys, and ``decode_attention`` with Dense(), Certified(eps) and
Certified(eps, Exact()); ratios to Dense() and to jax.nn (``chunk.png``),
the certificates' kept and scored fractions.

Part ``generate``: ``jaxtopk.models.serve`` (continuous batching: chunked
prefill into a paged cache per layer, greedy decode steps, finished
requests released and their pages reused) on a random ``TopKDecoder``,
``config.generate.requests`` prompts of random lengths, dense attention
against ``Certified(eps)``: tokens per second (after a warm-up run of the
same requests, which compiles every shape), steps, the largest
``tv_bound`` of any generated token and how many tokens the two runs
agree on (``generate.png``).

Usage (experiments/README.md):
  python -m experiments.bench_serving \
    --config=experiments/configs/bench_serving.py --workdir=/tmp/bench_serving
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxtopk
from experiments import _common
from jaxtopk import models

NAME = "bench_serving"
VARIANTS = ("floor", "gather", "dense_paged", "cert_paged", "dense_flat",
            "cert_flat")  # fmt: skip
CHUNK_VARIANTS = ("jax_nn", "dense", "cert", "cert_exact")


def _workload(
  name, seed, lengths, heads, kv_heads, head_dim, page_size, q_len=1
):
  """Keys, values ``[b, n_max, hk, d]`` and queries ``[b, q_len, h, d]``."""
  b, n = len(lengths), max(lengths)
  kk, kv, kq, kc, kt = jax.random.split(jax.random.key(seed), 5)
  shape = (b, n, kv_heads, head_dim)
  v = jax.random.normal(kv, shape)
  if name == "flat":
    k = jax.random.normal(kk, shape)
    q = jax.random.normal(kq, (b, q_len, heads, head_dim))
    return k, v, q
  if name != "topic":
    raise ValueError(f"unknown workload {name!r}; use 'flat' or 'topic'")
  pages = -(-n // page_size)
  centre = jax.random.normal(kc, (b, pages, kv_heads, head_dim))
  k = jnp.repeat(centre, page_size, axis=1)[:, :n]
  k = k + 0.2 * jax.random.normal(kk, shape)
  held = jnp.asarray([-(-m // page_size) for m in lengths])  # [b]
  target = jax.random.randint(kt, (b, q_len, heads), 0, 1 << 30)
  target = target % held[:, None, None]
  group = heads // kv_heads
  hk = jnp.arange(heads) // group  # [h]
  aim = centre[jnp.arange(b)[:, None, None], target, hk]  # [b, q_len, h, d]
  q = 4.0 * aim + 0.3 * jax.random.normal(kq, aim.shape)
  return k, v, q


def bench(workload, config):
  """Times every variant on one workload; returns a dict of results."""
  lengths = [int(m) for m in config.lengths]
  b, n = len(lengths), max(lengths)
  hk, d, ps = config.kv_heads, config.head_dim, config.page_size
  k, v, q = _workload(workload, config.seed, lengths, config.heads, hk, d, ps)
  per_seq = -(-n // ps)
  num_pages = sum(-(-m // ps) for m in lengths)
  paged = jaxtopk.PagedKVCache.create(
    b, num_pages, ps, hk, d, max_pages_per_seq=per_seq
  )
  flat = jaxtopk.KVCache.create(b, per_seq * ps, hk, d, block_size=ps)
  lens = np.asarray(lengths)
  for start in range(0, n, config.chunk):
    steps = np.clip(lens - start, 0, config.chunk)
    kc, vc = (
      k[:, start : start + config.chunk],
      v[:, start : start + config.chunk],
    )
    paged = paged.append(kc, vc, num_steps=steps)
    flat = flat.append(kc, vc, num_steps=steps)
  del k, v
  dense = jaxtopk.Dense()
  cert = jaxtopk.Certified(config.eps, jaxtopk.Auto(block_size=ps))
  scale = d**-0.5
  group = config.heads // hk

  @jax.jit
  def floor(q, keys):
    qg = q[:, 0].reshape(b, hk, group, d)
    return jnp.einsum("bkgd,bknd->bkgn", qg, keys) * scale

  def attend(policy):
    return jax.jit(lambda q, c: jaxtopk.decode_attention(q, c, policy=policy))

  dense_fn, cert_fn = attend(dense), attend(cert)
  gather = jax.jit(lambda c: c.gather())
  res = dict(
    workload=workload,
    lengths=lengths,
    heads=config.heads,
    kv_heads=hk,
    head_dim=d,
    page_size=ps,
    num_pages=num_pages,
  )
  res.update(
    _common.time_round_robin(
      dict(
        floor=(floor, (q, flat.keys)),
        gather=(gather, (paged,)),
        dense_paged=(dense_fn, (q, paged)),
        cert_paged=(cert_fn, (q, paged)),
        dense_flat=(dense_fn, (q, flat)),
        cert_flat=(cert_fn, (q, flat)),
      ),
      repeats=config.repeats,
    )
  )
  codes_fn = attend(
    jaxtopk.Certified(
      config.eps, jaxtopk.DeltaSearch(ps, bound=jaxtopk.Codes())
    )
  )
  o_paged, c_paged = codes_fn(q, paged)
  o_flat, c_flat = codes_fn(q, flat)
  # Up to rounding: the pages' code products run page slot by page slot.
  res["paged_equals_flat"] = bool(
    jnp.allclose(o_paged, o_flat, rtol=1e-5, atol=1e-5)
    and jnp.allclose(c_paged.tv_bound, c_flat.tv_bound, rtol=1e-5, atol=0)
    and jnp.array_equal(c_paged.k_kept, c_flat.k_kept)
  )
  _, c_paged = cert_fn(q, paged)
  real = jnp.asarray(lengths, jnp.float32)[:, None, None]
  res["cert_kept_fraction_mean"] = float(jnp.mean(c_paged.k_kept / real))
  res["cert_scored_fraction_mean"] = float(jnp.mean(c_paged.keys_scored / real))
  res["cert_tv_bound_max"] = float(jnp.max(c_paged.tv_bound))
  res["cert_valid"] = bool(jnp.all(c_paged.valid))
  for name in VARIANTS:
    for stat in ("min_ms", "median_ms"):
      res[f"{name}_over_dense_paged_{stat[:-3]}"] = (
        res[name][stat] / res["dense_paged"][stat]
      )
  return res


def chunk(workload, config):
  """One prefill chunk of ``config.chunk`` steps at the end of a cache of
  ``config.chunk_keys`` keys (batch 1): a dict."""
  n, t = config.chunk_keys, config.chunk
  hk, d, ps = config.kv_heads, config.head_dim, config.page_size
  k, v, q = _workload(
    workload, config.seed, [n], config.heads, hk, d, ps, q_len=t
  )
  cache = jaxtopk.KVCache.create(1, n, hk, d, block_size=ps).append(k, v)
  # The chunk's causal mask over the same keys, for jax.nn.
  pos = jnp.arange(n - t, n)[:, None]
  mask = (jnp.arange(n)[None, :] <= pos)[None, None]  # [1, 1, t, n]
  jax_nn = jax.jit(
    lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask)
  )

  def attend(policy):
    return jax.jit(lambda q, c: jaxtopk.decode_attention(q, c, policy=policy))

  policies = dict(
    dense=jaxtopk.Dense(),
    cert=jaxtopk.Certified(config.eps, jaxtopk.Auto(block_size=ps)),
    cert_exact=jaxtopk.Certified(config.eps, jaxtopk.Exact(block_size=ps)),
  )
  fns = {name: attend(p) for name, p in policies.items()}
  res = dict(workload=workload, keys=n, chunk=t, heads=config.heads,
             kv_heads=hk, head_dim=d)  # fmt: skip
  res.update(
    _common.time_round_robin(
      dict(
        jax_nn=(jax_nn, (q, k, v)),
        **{name: (fn, (q, cache)) for name, fn in fns.items()},
      ),
      repeats=config.chunk_repeats,
    )
  )
  want = jax_nn(q, k, v)
  res["dense_max_abs_diff_vs_jax_nn"] = float(
    jnp.max(jnp.abs(fns["dense"](q, cache)[0] - want))
  )
  del want
  for name in ("cert", "cert_exact"):
    _, c = fns[name](q, cache)
    real = (n - t + 1 + jnp.arange(t)).astype(jnp.float32)[None, :, None]
    res[f"{name}_kept_fraction_mean"] = float(jnp.mean(c.k_kept / real))
    res[f"{name}_scored_fraction_mean"] = float(jnp.mean(c.keys_scored / real))
    res[f"{name}_tv_bound_max"] = float(jnp.max(c.tv_bound))
    res[f"{name}_valid"] = bool(jnp.all(c.valid))
  for name in CHUNK_VARIANTS:
    for base in ("dense", "jax_nn"):
      res[f"{name}_over_{base}_min"] = res[name]["min_ms"] / res[base]["min_ms"]
  return res


def generate(config):
  """``serve`` of the same requests, dense then certified; a dict."""
  g = config.generate
  cfg = models.DecoderConfig(
    vocab_size=g.vocab_size,
    num_layers=g.num_layers,
    num_heads=g.num_heads,
    num_kv_heads=g.num_kv_heads,
    model_dim=g.model_dim,
    head_dim=g.head_dim,
    mlp_dim=g.mlp_dim,
  )
  model = models.TopKDecoder(cfg, rngs=nnx.Rngs(config.seed))
  rng = np.random.default_rng(config.seed)
  lengths = rng.integers(g.prompt_min, g.prompt_max + 1, g.requests)
  prompts = [rng.integers(0, g.vocab_size, n).tolist() for n in lengths]
  ps = config.page_size
  kw = dict(
    max_new_tokens=g.max_new_tokens, batch=g.batch, page_size=ps,
    chunk=g.chunk,
  )  # fmt: skip
  res = dict(
    requests=g.requests,
    prompt_tokens=int(np.sum(lengths)),
    max_new_tokens=g.max_new_tokens,
    batch=g.batch,
    chunk=g.chunk,
  )
  runs = {}
  for name, attention in (
    ("dense", None),
    ("certified", jaxtopk.Certified(config.eps, jaxtopk.Auto(block_size=ps))),
  ):
    models.serve(model, prompts, attention=attention, **kw)  # compiles
    out, stats = models.serve(model, prompts, attention=attention, **kw)
    runs[name] = out
    res[name] = dict(
      stats,
      tv_bound_max=float(max(np.max(c.tv_bound) for c in out)),
      all_valid=all(c.valid for c in out),
    )
  same = [
    int(np.sum(np.equal(a.tokens, b.tokens)))
    for a, b in zip(runs["dense"], runs["certified"], strict=True)
  ]
  res["same_tokens_fraction"] = sum(same) / (g.requests * g.max_new_tokens)
  res["certified_over_dense_seconds"] = (
    res["certified"]["seconds"] / res["dense"]["seconds"]
  )
  return res


def run(config, workdir, *, overwrite: bool = False) -> dict:
  """Runs the parts of ``config.parts``; writes the workdir."""
  wd = _common.Workdir(workdir, config, overwrite=overwrite)
  meta = _common.machine_info()
  results = []
  parts = tuple(config.parts)
  unknown = set(parts) - {"paged", "chunk", "generate"}
  if unknown:
    raise ValueError(f"config.parts: unknown {sorted(unknown)}")
  workloads = config.workloads if "paged" in parts else ()
  chunk_loads = config.workloads if "chunk" in parts else ()
  progress = _common.Progress(
    NAME, len(workloads) + len(chunk_loads) + ("generate" in parts)
  )
  for workload in workloads:
    r = bench(workload, config)
    wd.metrics.write("paged_decode", **r)
    results.append(r)
    progress.update(note=workload)
  chunks = []
  for workload in chunk_loads:
    r = chunk(workload, config)
    wd.metrics.write("chunk", **r)
    chunks.append(r)
    progress.update(note=f"chunk {workload}")
  if chunks:
    _common.bar_figure(
      wd.path,
      "chunk",
      {
        r["workload"]: {v: r[f"{v}_over_dense_min"] for v in CHUNK_VARIANTS}
        for r in chunks
      },
      ylabel="time / Dense() over the cache (min)",
      title=(
        f"A {config.chunk}-step chunk onto {config.chunk_keys} cached keys"
      ),
    )
  gen = None
  if "generate" in parts:
    gen = generate(config)
    wd.metrics.write("generate", **gen)
    progress.update(note="generate")
    _common.bar_figure(
      wd.path,
      "generate",
      {
        "tokens/s": {
          name: gen[name]["tokens_per_second"]
          for name in ("dense", "certified")
        }
      },
      ylabel="generated tokens per second",
      title=f"serve: {gen['requests']} requests, batch {gen['batch']}",
    )
  meta.update(
    load_average_after=list(os.getloadavg()),
    layout="PagedKVCache pages vs a contiguous KVCache, float32",
    timing=(
      "jit, 2 warm-up calls, variants timed round-robin, min and median"
      " of config.repeats calls each"
    ),
  )
  record = dict(meta=meta, results=results, chunk=chunks, generate=gen)
  wd.write_json("results.json", record)
  tables = [] if not chunks else [_chunk_table(chunks)]
  if gen is not None:
    tables.append(_generate_table(gen))
  if not results:
    if tables:
      wd.write_summary("\n\n".join(tables))
    return record
  _common.bar_figure(
    wd.path,
    "ratios",
    {
      r["workload"]: {v: r[f"{v}_over_dense_paged_min"] for v in VARIANTS}
      for r in results
    },
    ylabel="time / dense over the pages (min)",
    title=f"One decode step, {len(config.lengths)} ragged sequences",
  )
  paged = _ratio_table(
    results,
    "workload",
    VARIANTS,
    "dense_paged",
    {"scored": "cert_scored_fraction_mean"},
  )
  wd.write_summary("\n\n".join([paged, *tables]))
  return record


def _ratio_table(rows, label, variants, base, columns):
  """One row per workload: each variant's min time over ``base``'s, the
  base's min ms, and ``columns`` (heading: key of the row)."""
  return _common.format_table(
    [
      {
        label: r["workload"],
        **{v: r[f"{v}_over_{base}_min"] for v in variants},
        f"{base}_ms": r[base]["min_ms"],
        **{c: r[key] for c, key in columns.items()},
      }
      for r in rows
    ],
    [label, *variants, f"{base}_ms", *columns],
  )


def _chunk_table(chunks):
  return _ratio_table(
    chunks,
    "chunk_workload",
    CHUNK_VARIANTS,
    "dense",
    {
      "cert_kept": "cert_kept_fraction_mean",
      "cert_scored": "cert_scored_fraction_mean",
    },
  )


def _generate_table(gen):
  return _common.format_table(
    [
      {
        "attention": name,
        "tokens_per_s": gen[name]["tokens_per_second"],
        "seconds": gen[name]["seconds"],
        "steps": gen[name]["steps"],
        "tv_bound_max": gen[name]["tv_bound_max"],
      }
      for name in ("dense", "certified")
    ],
    ["attention", "tokens_per_s", "seconds", "steps", "tv_bound_max"],
  )


if __name__ == "__main__":
  _common.app_main(NAME, run)
