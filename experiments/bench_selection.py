r"""Benchmark: certified selection.

Part 1, ``exact``: ``jaxtopk.select(logits, Certified(eps))`` (radix
threshold search, THEORY 6.1, no sort) against the SAME certificate computed
by ``jnp.sort`` + ``cumsum`` (minimal k, its tail mass and keep mask), rows of
n = 4,096 .. 262,144 Gaussian logits (sigma 2.5), 8 rows per call. Goal: >= 3x
faster at n >= 65,536. Both are jitted, timed round-robin; min and median.

Part 2, ``delta``: Delta-Search (``jaxtopk.certified_search``, THEORY 6.2)
keys_scored / n at eps = 0.01, 0.05, 0.1,
- on real attention rows: all-MiniLM-L6-v2 (6 layers x 12 heads) on passages
  of the public-domain text jaxtopk ships (``experiments._real_text``), every
  ``--query_stride``-th real query of every layer, head and text;
- on synthetic rows: 2,048 keys drifting along the sequence (random walks
  of step 0.3, flat rows, and 1.0, peaked rows with tight blocks), Gaussian
  queries.
Beside it: the fraction an oracle needs (exact k_eps / n: no search can keep
fewer than it must score); the library's low-rank Delta-Search
(``Certified(eps, DeltaSearch(bound=LowRank(r)))``, per-key bounds
q_P.k_P + ||q_perp|| ||k_perp|| plus rounding slack, P the top-r
eigenvectors of each row's K^T K), whose keys_scored includes the projected
products as ceil(n r / d) key-equivalents (``lowrank_r{r}``; the q.k
products alone in ``lowrank_r{r}_qk_only``); and the earlier numpy
SIMULATION of the same rule without slack or blocks (``sim_lowrank_r{r}``,
on a subsample of <= 300 rows, projection cost NOT included).
Goal: >= 2x fewer scored keys on average at eps = 0.05 on the real rows.

Usage (experiments/README.md; results.json keeps both parts, the machine
and the load average):
  python -m experiments.bench_selection \
    --config=experiments/configs/bench_selection.py --workdir=/tmp/bench_sel
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import jaxtopk
from experiments import _common
from jaxtopk.selection import threshold

NAME = "bench_selection"


def sort_cumsum_certified(s, eps):
  """Baseline: the minimal certified set by a full sort and a cumsum.

  Returns the keep mask and tau of the kept set, like ``select``.
  """
  asc = jnp.sort(s, axis=-1)  # [r, n] ascending
  m = asc[..., -1:]
  tail = jnp.cumsum(jnp.exp(asc - m), axis=-1)  # mass of the j+1 smallest
  z = tail[..., -1:]
  ok = tail <= eps * z
  j = jnp.sum(ok, axis=-1)  # number of droppable smallest logits
  t = jnp.take_along_axis(asc, jnp.minimum(j, s.shape[-1] - 1)[..., None], -1)
  keep = s >= t
  tau = jnp.where(j > 0, jnp.take_along_axis(tail, (j - 1)[..., None], -1), 0)
  return keep, tau[..., 0] / z[..., 0]


def part_exact(sizes, rows, eps, repeats):
  out = []
  policy = jaxtopk.Certified(eps)
  ours = jax.jit(lambda s: jaxtopk.select(s, policy))
  base = jax.jit(lambda s: sort_cumsum_certified(s, eps))
  for n in sizes:
    s = 2.5 * jax.random.normal(jax.random.key(n), (rows, n))
    r = dict(n=n, rows=rows, eps=eps)
    r.update(
      _common.time_round_robin(
        dict(jaxtopk=(ours, (s,)), sort_cumsum=(base, (s,))),
        repeats=repeats,
      )
    )
    sel = ours(s)
    keep_b, tau_b = base(s)
    r["speedup_min"] = r["sort_cumsum"]["min_ms"] / r["jaxtopk"]["min_ms"]
    r["speedup_median"] = (
      r["sort_cumsum"]["median_ms"] / r["jaxtopk"]["median_ms"]
    )
    r["same_keep_fraction"] = float(jnp.mean(sel.keep == keep_b))
    r["k_kept_mean"] = float(jnp.mean(sel.k_kept))
    r["tv_bound_max"] = float(jnp.max(sel.certificate.tv_bound))
    r["baseline_tau_max"] = float(jnp.max(tau_b))
    print(json.dumps(r), flush=True)
    out.append(r)
  return out


def part_topk(sizes, rows, repeats):
  """Top-k threshold (k = n / 64) of ``rows`` rows: few-pass radix (8-bit
  digits, 4 passes), bit-by-bit radix (32 passes), lax.top_k, full sort."""
  out = []
  thr = threshold.topk_threshold
  for n in sizes:
    k = max(1, n // 64)
    s = 2.5 * jax.random.normal(jax.random.key(n), (rows, n))
    valid = jnp.ones((rows, n), bool)
    kk = jnp.full((rows,), k, jnp.int32)
    bits = dict(few_pass=8, bitwise_radix=1)
    variants = {
      name: jax.jit(
        lambda s, kk, valid, b=b: thr(s, kk, valid, digit_bits=b)[0]
      )
      for name, b in bits.items()
    }
    variants["lax_top_k"] = jax.jit(
      lambda s, kk, valid, k=k: jax.lax.top_k(s, k)[0][:, -1]
    )
    variants["sort"] = jax.jit(
      lambda s, kk, valid, k=k, n=n: jnp.sort(s, axis=-1)[:, n - k]
    )
    args = (s, kk, valid)
    r = dict(n=n, rows=rows, topk=k)
    r.update(
      _common.time_round_robin(
        {name: (fn, args) for name, fn in variants.items()}, repeats=repeats
      )
    )
    ref = variants["sort"](*args)
    r["agree"] = all(
      bool(jnp.all(fn(*args) == ref)) for fn in variants.values()
    )
    for name in ("bitwise_radix", "lax_top_k", "sort"):
      r[f"{name}_over_few_pass_min"] = (
        r[name]["min_ms"] / r["few_pass"]["min_ms"]
      )
    print(json.dumps(r), flush=True)
    out.append(r)
  return out


def _oracle_and_lowrank(q, k, mask, scale, eps, ranks):
  """Exact k_eps / n and the simulated low-rank Delta-Search fraction."""
  s = np.einsum("rd,rnd->rn", q, k) * scale
  res = {"oracle": [], **{f"sim_lowrank_r{r}": [] for r in ranks}}
  for i in range(q.shape[0]):
    m = mask[i]
    n = m.sum()
    si = s[i][m]
    e = np.exp(si - si.max())
    p = np.sort(e)[::-1] / e.sum()
    res["oracle"].append((np.argmax(1 - np.cumsum(p) <= eps) + 1) / n)
    kk = k[i][m]
    _, _, vt = np.linalg.svd(kk - 0.0, full_matrices=False)
    for r in ranks:
      proj = vt[:r].T  # [d, r]
      kp = kk @ proj
      kperp = np.linalg.norm(kk - kp @ proj.T, axis=1)
      qp = q[i] @ proj
      qperp = np.linalg.norm(q[i] - qp @ proj.T)
      u = (kp @ qp + qperp * kperp) * scale
      o = np.argsort(-u)
      eu, es = np.exp(u[o] - si.max()), np.exp(si[o] - si.max())
      suffix = np.concatenate([np.cumsum(eu[::-1])[::-1], [0.0]])
      zs = np.concatenate([[0.0], np.cumsum(es)])
      j = np.argmax(suffix / (zs + suffix) <= eps)
      res[f"sim_lowrank_r{r}"].append(j / n)
  return {key: float(np.mean(v)) for key, v in res.items()}


def _run_search(q, k, mask, scale, policy):
  """keys_scored / n, k_kept / n and float64 soundness of one policy."""
  sel = jaxtopk.certified_search(q, k, policy=policy, mask=mask, scale=scale)
  c = sel.certificate
  v = np.asarray(c.valid)
  n = np.asarray(mask.sum(-1))[v]
  scored = np.asarray(c.keys_scored)[v]
  # Soundness check of every certificate against float64.
  s64 = np.einsum("rd,rnd->rn", q.astype(np.float64), k) * scale
  s64 = np.where(mask, s64, -np.inf)
  e = np.exp(s64 - s64.max(-1, keepdims=True))
  tau = (e * ~np.asarray(sel.keep)).sum(-1) / e.sum(-1)
  return dict(
    n_rows=int(v.sum()),
    mean_keys=float(n.mean()),
    scored=scored,
    n=n,
    keys_scored_fraction=float((scored / n).mean()),
    k_kept_fraction=float((np.asarray(c.k_kept)[v] / n).mean()),
    all_sound=bool(np.all(np.asarray(c.tv_bound)[v] >= tau[v])),
    max_tv_bound=float(np.asarray(c.tv_bound)[v].max()),
  )


def _delta_rows(name, q, k, mask, scale, block_size, ranks, epss):
  out = []
  d = q.shape[-1]
  for eps in epss:
    policy = jaxtopk.Certified(eps, jaxtopk.DeltaSearch(block_size))
    box = _run_search(q, k, mask, scale, policy)
    r = dict(
      rows=name,
      eps=eps,
      n_rows=box["n_rows"],
      mean_keys=box["mean_keys"],
      block_size=block_size,
      keys_scored_fraction=box["keys_scored_fraction"],
      reduction=float(1 / box["keys_scored_fraction"]),
      k_kept_fraction=box["k_kept_fraction"],
      all_sound=box["all_sound"],
      max_tv_bound=box["max_tv_bound"],
    )
    for rank in ranks:
      low = jaxtopk.Certified(
        eps, jaxtopk.DeltaSearch(block_size, jaxtopk.LowRank(rank))
      )
      lr = _run_search(q, k, mask, scale, low)
      cost = -(-lr["n"] * rank // d)  # ceil(n r / d), included in scored
      r[f"lowrank_r{rank}"] = lr["keys_scored_fraction"]
      r[f"lowrank_r{rank}_qk_only"] = float(
        ((lr["scored"] - cost) / lr["n"]).mean()
      )
      r[f"lowrank_r{rank}_reduction"] = float(1 / lr["keys_scored_fraction"])
      r[f"lowrank_r{rank}_all_sound"] = lr["all_sound"]
      r[f"lowrank_r{rank}_max_tv_bound"] = lr["max_tv_bound"]
    sub = slice(None, None, max(1, q.shape[0] // 300))
    r.update(_oracle_and_lowrank(q[sub], k[sub], mask[sub], scale, eps, ranks))
    print(json.dumps(r), flush=True)
    out.append(r)
  return out


def part_delta(config):
  """Part 2: Delta-Search keys scored on MiniLM and synthetic rows."""
  real, meta = [], {}
  if config.minilm:
    real, meta = _part_delta_minilm(
      config.texts, config.query_stride, config.block_size, config.delta_epss
    )
  # Synthetic: keys drifting along the sequence (a random walk of step
  # `walk` per key), head_dim 32, Gaussian queries. A slow walk gives flat
  # rows (like MiniLM's); a fast one gives peaked rows with tight blocks.
  synth = {}
  for walk in config.walks:
    kd, kn, kq = jax.random.split(jax.random.key(0), 3)
    n, d, r = config.synthetic_keys, 32, config.synthetic_rows
    drift = jnp.cumsum(walk * jax.random.normal(kd, (r, n, d)), axis=1)
    keys = np.asarray(drift + 0.3 * jax.random.normal(kn, (r, n, d)))
    qs = np.asarray(jax.random.normal(kq, (r, d)))
    synth[f"walk_{walk}"] = _delta_rows(
      f"synthetic_walk_{walk}",
      qs,
      keys,
      np.ones((r, n), bool),
      d**-0.5,
      config.synthetic_block_size,
      ranks=tuple(config.synthetic_ranks),
      epss=tuple(config.delta_epss),
    )
  return dict(meta=meta, minilm=real, synthetic=synth)


def _part_delta_minilm(texts, stride, block_size, epss):
  from experiments import _attention_rows  # only part 2 needs MiniLM
  from experiments import _real_text

  passages, sources = _real_text.real_text_passages(
    texts, max_words=200, return_sources=True
  )
  rows = _attention_rows.minilm_attention_rows(passages, max_len=256)
  q, k, km = rows["queries"], rows["keys"], rows["key_mask"]
  scale = float(rows["scale"])
  nl, b, h, s, dh = q.shape
  qq = q[:, :, :, ::stride]  # [L, B, H, sq, dh]
  sq = qq.shape[3]
  # One row per (layer, text, head, query); real queries only.
  real_q = km[:, ::stride]  # [B, sq]
  kk = np.broadcast_to(k[:, :, :, None], (nl, b, h, sq, s, dh))
  mm = np.broadcast_to(km[None, :, None, None, :], (nl, b, h, sq, s))
  sel_q = np.broadcast_to(real_q[None, :, None, :], (nl, b, h, sq))
  real = _delta_rows(
    "minilm",
    qq[sel_q],
    kk[sel_q],
    mm[sel_q],
    scale,
    block_size,
    ranks=(4, 8, 16),
    epss=tuple(epss),
  )
  return real, dict(texts=sources, model="all-MiniLM-L6-v2", max_len=256)


def run(config, workdir, *, overwrite: bool = False) -> dict:
  """Runs ``config.parts``; writes results.json, metrics.jsonl, figures."""
  wd = _common.Workdir(workdir, config, overwrite=overwrite)
  result = {"meta": _common.machine_info()}
  result["meta"]["timing"] = (
    "jit, 2 warm-ups, round-robin, min and median of config.repeats"
  )
  if "exact" in config.parts:
    result["exact"] = part_exact(
      [int(x) for x in config.sizes], config.rows, config.eps, config.repeats
    )
    for r in result["exact"]:
      wd.metrics.write("exact", **r)
    _common.bar_figure(
      wd.path,
      "exact_speedup",
      {
        f"n={r['n']}": {"speedup (min)": r["speedup_min"]}
        for r in result["exact"]
      },
      ylabel="sort + cumsum time / select time",
      title=f"Certified({config.eps}) selection vs sort + cumsum",
      log=True,
    )
  if "topk" in config.parts:
    result["topk"] = part_topk(
      [int(x) for x in config.sizes], config.rows, config.repeats
    )
    for r in result["topk"]:
      wd.metrics.write("topk", **r)
  if "delta" in config.parts:
    result["delta"] = part_delta(config)
    rows = result["delta"]["minilm"] + [
      r for rs in result["delta"]["synthetic"].values() for r in rs
    ]
    for r in rows:
      wd.metrics.write("delta", **r)
    _common.bar_figure(
      wd.path,
      "delta_keys_scored",
      {
        f"{r['rows']}\neps={r['eps']}": {
          "delta (box)": r["keys_scored_fraction"],
          "oracle k_eps": r["oracle"],
        }
        for r in rows
      },
      ylabel="fraction of the n keys",
      title="Delta-Search keys scored vs the minimal kept set",
    )
  result["meta"]["load_average_after"] = list(os.getloadavg())
  wd.write_json("results.json", result)
  return result


if __name__ == "__main__":
  _common.app_main(NAME, run)
