r"""Certified KV retrieval: keys read by searches over a content index.

THEORY 3.3, 6.2, 6.3. For each cache (experiments/_kv_caches:
(a) MiniLM over many real passages, (b) the native Top-k decoder's own
caches, (c) clustered and local-window synthetic caches), the keys are
indexed by content (``jaxtopk.IndexedKVCache.build``) and every decode query
runs

- ``delta``: Delta-Search over the groups (``jaxtopk.decode_attention`` with
  ``Certified(eps, 'delta')`` on the index);
- ``mc``: MC-Search over the groups;
- ``pos_delta``: the position-block Delta-Search of a plain ``KVCache``
  (blocks of consecutive positions, box bounds), same block size;

recording keys_scored / n (q.k products plus the summaries in
key-equivalents), kept keys, the certified tv_bound against the float64
tau of the kept set (sound on EVERY row?), and the oracle k_eps / n (the
fewest keys any certified method must score). Then

- ``window``: ``jaxtopk.certify_selection`` for StreamingLLM windows (the
  first ``window_sinks`` positions plus the last W), certified tv_bound
  next to the true tau, and ``grow_selection`` from the window to eps;
- ``update``: an index built on the first half of a cache and grown by
  ``IndexedKVCache.append`` one step at a time, vs a fresh build and a rebuild;
- ``timing``: decode wall time of one query per head, ours vs the logits
  floor (the q.k einsum over the head-major cache), dense decode and the
  position-block Delta-Search, round robin in one run, with the load.

Outputs: config.json, metrics.jsonl (kinds "cache", "search", "per_head",
"window", "window_grow", "update", "timing", "decoder"), results.json (the
timing rows with ``_common.machine_info()``), decoder_params.npz,
kv_*.png, summary.txt.

  python -m experiments.kv_retrieval --workdir=experiments/results/kv_retrieval
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

import jaxtopk
from experiments import _common
from experiments import _kv_caches
from jaxtopk.attention import _index_decode

NAME = "kv_retrieval"


def _load():
  return (
    open("/proc/loadavg").read().split()[0]
    if os.path.exists("/proc/loadavg")
    else "n/a"
  )


# --------------------------------------------------------------- helpers


def _as_jax(cache):
  """(keys [1, n, H, d], values [1, n, H, dv], query [1, 1, H*Q, d])."""
  k = jnp.asarray(cache.keys).transpose(1, 0, 2)[None]
  v = jnp.asarray(cache.values).transpose(1, 0, 2)[None]
  heads, nq, d = cache.queries.shape
  q = jnp.asarray(cache.queries).reshape(1, 1, heads * nq, d)
  return k, v, q


def _build(cache, group_size, config, k=None, v=None, **kw):
  if k is None:
    k, v, _ = _as_jax(cache)
  tick = time.perf_counter()
  index = jaxtopk.IndexedKVCache.build(
    k,
    v,
    group_size=group_size,
    kmeans_iters=config.kmeans_iters,
    seed=config.seed,
    **kw,
  )
  jax.block_until_ready(index)
  return index, time.perf_counter() - tick


def _logits64(cache):
  """float64 logits ``[H, Q, n]`` (position order)."""
  k = cache.keys.astype(np.float64)
  q = cache.queries.astype(np.float64)
  return np.einsum("hqd,hnd->hqn", q, k) * cache.scale


def _log_tau(s, keep):
  """float64 log tau per row of ``s`` ``[..., n]`` for ``keep``."""
  m = np.max(s, -1, keepdims=True)
  e = np.exp(s - m)
  tail = np.sum(np.where(keep, 0.0, e), -1)
  with np.errstate(divide="ignore"):
    return np.log(tail) - np.log(np.sum(e, -1))


def _k_eps(s, eps):
  """Fewest keys of each row of ``s`` ``[..., n]`` with tau <= eps."""
  srt = -np.sort(-s, -1)
  e = np.exp(srt - srt[..., :1])
  cum = np.cumsum(e, -1)
  need = (1 - eps) * cum[..., -1:]
  return np.sum(cum < need, -1) + 1


def _slot_positions(index):
  """``[H, G * C]`` position of every slot (-1 empty)."""
  return np.asarray(index.position[0]).reshape(index.position.shape[1], -1)


def _search(cache, index, eps, search, config, s64):
  """Runs one search on every query; returns per-row numpy arrays."""
  _, _, q = _as_jax(cache)
  c = index.group_size
  if search == "mc":
    strategy = jaxtopk.MCSearch(c, config.mc_delta, config.mc_samples)
  else:
    strategy = jaxtopk.DeltaSearch(block_size=c)
  pol = jaxtopk.Certified(0.5, strategy)
  _, cert, scored = _index_decode._search_decode(  # scored: kept groups
    q,
    index,
    jax.random.key(config.seed),
    jnp.float32(eps),
    policy=pol,
    scale=cache.scale,
  )
  heads, nq, n = s64.shape
  scored = np.asarray(scored[0]).reshape(heads, nq, -1)  # [H, Q, G]
  slot_pos = _slot_positions(index)  # [H, G*C]
  keep = np.zeros((heads, nq, n), bool)
  for h in range(heads):
    kept_slots = np.repeat(scored[h], c, -1) & (slot_pos[h] >= 0)  # [Q, GC]
    for i in range(nq):
      keep[h, i, slot_pos[h][kept_slots[i]]] = True
  return _rows(cert, heads, nq, s64, keep)


def _rows(cert, heads, nq, s64, keep):
  tv = np.asarray(cert.tv_bound).reshape(heads, nq)
  log_tv = np.asarray(cert.log_tv_bound).reshape(heads, nq)
  lt = _log_tau(s64, keep)
  return dict(
    tv=tv,
    tau=np.exp(lt),
    sound=(log_tv >= lt) & (tv >= np.exp(lt)),
    valid=np.asarray(cert.valid).reshape(heads, nq),
    scored=np.asarray(cert.keys_scored).reshape(heads, nq),
    kept=np.asarray(cert.k_kept).reshape(heads, nq),
  )


def _pos_cache(cache, block_size):
  k, v, _ = _as_jax(cache)
  heads, n, d = cache.keys.shape
  n_cap = -(-n // block_size) * block_size
  kv = jaxtopk.KVCache.create(
    1, n_cap, heads, d, block_size=block_size, value_dim=v.shape[-1]
  )
  return kv.append(k, v)


def _pos_search(cache, kv, eps, block_size):
  _, _, q = _as_jax(cache)
  pol = jaxtopk.Certified(eps, jaxtopk.DeltaSearch(block_size))
  _, cert = jaxtopk.decode_attention(q, kv, policy=pol, scale=cache.scale)
  heads, nq, _ = cache.queries.shape
  return dict(
    tv=np.asarray(cert.tv_bound).reshape(heads, nq),
    scored=np.asarray(cert.keys_scored).reshape(heads, nq),
    kept=np.asarray(cert.k_kept).reshape(heads, nq),
    valid=np.asarray(cert.valid).reshape(heads, nq),
  )


def _summary(r, n):
  out = dict(
    scored_frac=float(np.mean(r["scored"]) / n),
    scored_frac_max=float(np.max(r["scored"]) / n),
    kept_frac=float(np.mean(r["kept"]) / n),
    tv_bound_mean=float(np.mean(r["tv"])),
    tv_bound_max=float(np.max(r["tv"])),
    valid_rows=int(np.sum(r["valid"])),
    rows=int(r["valid"].size),
  )
  if "tau" in r:
    out.update(
      tau_mean=float(np.mean(r["tau"])),
      tau_max=float(np.max(r["tau"])),
      sound_rows=int(np.sum(r["sound"] | ~r["valid"])),
    )
  return out


# ------------------------------------------------------------ measurements


def measure_searches(cache, config, writer, index, s64):
  """Delta, MC and position-block Delta-Search at every eps."""
  n = cache.n
  heads = cache.keys.shape[0]
  c = index.group_size
  groups = np.sum(np.asarray(index.count[0]) > 0, -1)  # [H]
  summary_frac = float(np.mean(groups + 2) / n)
  kv = _pos_cache(cache, c)
  out = []
  for eps in config.eps:
    k_eps = _k_eps(s64, eps) / n  # [H, Q]
    res = {
      "delta": _search(cache, index, eps, "delta", config, s64),
      "mc": _search(cache, index, eps, "mc", config, s64),
      "pos_delta": _pos_search(cache, kv, eps, c),
    }
    for method, r in res.items():
      rec = writer.write(
        "search",
        cache=cache.name,
        eps=eps,
        method=method,
        n=n,
        group_size=c,
        k_eps_frac=float(np.mean(k_eps)),
        summary_frac=summary_frac if method != "pos_delta" else 0.0,
        **_summary(r, n),
      )
      out.append(rec)
      if method == "delta":
        for h in range(heads):
          writer.write(
            "per_head",
            cache=cache.name,
            eps=eps,
            label=cache.labels[h],
            scored_frac=float(np.mean(res["delta"]["scored"][h]) / n),
            kept_frac=float(np.mean(res["delta"]["kept"][h]) / n),
            k_eps_frac=float(np.mean(k_eps[h])),
          )
    logging.info(
      "%s eps=%g: delta %.3f mc %.3f pos %.3f of n (k_eps %.3f)",
      cache.name,
      eps,
      np.mean(res["delta"]["scored"]) / n,
      np.mean(res["mc"]["scored"]) / n,
      np.mean(res["pos_delta"]["scored"]) / n,
      np.mean(k_eps),
    )
  return out


def measure_windows(cache, windows, config, writer, index, s64):
  """certify_selection and grow_selection for sinks + recent windows."""
  _, _, q = _as_jax(cache)
  n = cache.n
  heads, nq, _ = s64.shape
  out = []
  width = config.window_sinks + max(windows, default=0)
  for w in windows:
    if w + config.window_sinks >= n:
      continue
    pos = np.full(width, -1, np.int32)  # one width: one compilation
    pos[: config.window_sinks + w] = np.concatenate(
      [np.arange(config.window_sinks), np.arange(n - w, n)]
    )
    keep = np.zeros(n, bool)
    keep[pos[pos >= 0]] = True
    cert = jaxtopk.certify_selection(
      q, index, pos[None, None, None], scale=cache.scale
    )
    r = _rows(cert, heads, nq, s64, np.broadcast_to(keep, s64.shape))
    # Rows whose window holds >= 95% of the mass, and those of them whose
    # certificate is within 2 tau + 0.01 (the tightness goal).
    held = r["tau"] <= 0.05
    rec = writer.write(
      "window",
      cache=cache.name,
      window=int(w),
      sinks=config.window_sinks,
      n=n,
      **_summary(r, n),
      tv_over_tau_median=float(
        np.median(r["tv"] / np.maximum(r["tau"], 1e-300))
      ),
      held_rows=int(held.sum()),
      within_2tau_rows=int((held & (r["tv"] <= 2 * r["tau"] + 0.01)).sum()),
    )
    out.append((rec, r))
    for eps in config.eps:
      _, sel = jaxtopk.grow_selection(
        q, index, pos[None, None, None], eps=eps, scale=cache.scale
      )
      gk = np.asarray(sel.keep)[0, 0].reshape(heads, nq, -1)[..., :n]
      g = _rows(sel.certificate, heads, nq, s64, gk)
      writer.write(
        "window_grow",
        cache=cache.name,
        window=int(w),
        eps=eps,
        n=n,
        **_summary(g, n),
      )
  return out


def measure_update(cache, group_size, config, writer):
  """Index grown by appends vs a fresh build vs a rebuild (eps 0.05)."""
  k, v, q = _as_jax(cache)
  n = cache.n
  n0 = max(1, int(n * config.update_fraction))
  grown, _ = _build(cache, group_size, config, k[:, :n0], v[:, :n0], max_len=n)
  tick = time.perf_counter()
  grown = grown.append(k[:, n0:], v[:, n0:])
  jax.block_until_ready(grown)
  append_s = time.perf_counter() - tick
  fresh, _ = _build(cache, group_size, config)
  rebuilt = grown.rebuild(seed=config.seed)
  pol = jaxtopk.Certified(0.05, jaxtopk.DeltaSearch(group_size))
  rec = dict(cache=cache.name, n=n, built_on=n0, append_s=append_s)
  for name, idx in (("grown", grown), ("fresh", fresh), ("rebuilt", rebuilt)):
    _, cert = jaxtopk.decode_attention(q, idx, policy=pol, scale=cache.scale)
    rec[f"{name}_scored_frac"] = float(np.mean(cert.keys_scored) / n)
    rec[f"{name}_groups"] = int(np.sum(np.asarray(idx.count) > 0))
    rec[f"{name}_radius_mean"] = float(
      np.sum(idx.radius) / max(1, np.sum(np.asarray(idx.count) > 0))
    )
  rec["spilled_frac"] = float(np.mean(grown.spilled) / (n - n0))
  return writer.write("update", **rec)


def measure_timing(name, cache, index, config, writer, eps, note=""):
  """One decode query per head: ours vs floor, dense, position Delta."""
  k, v, _ = _as_jax(cache)
  heads, _, d = cache.queries.shape
  q = jnp.asarray(cache.queries[:, 0])[None, None]  # [1, 1, H, d]
  kh = jnp.swapaxes(k, 1, 2)  # [1, H, n, d] head-major
  kv = _pos_cache(cache, index.group_size)
  pol = jaxtopk.Certified(eps, jaxtopk.DeltaSearch(index.group_size))
  scale = cache.scale

  @jax.jit
  def floor(q, kh):
    return jnp.einsum("bhd,bhnd->bhn", q[:, 0], kh) * scale

  ours = jax.jit(
    lambda q, i: jaxtopk.decode_attention(q, i, policy=pol, scale=scale)
  )
  pos = jax.jit(
    lambda q, c: jaxtopk.decode_attention(q, c, policy=pol, scale=scale)
  )
  dense = jax.jit(
    lambda q, c: jaxtopk.decode_attention(
      q, c, policy=jaxtopk.Dense(), scale=scale
    )
  )
  _, cert = ours(q, index)
  _, pcert = pos(q, kv)
  load0 = _load()
  t = _common.time_round_robin(
    {
      "floor": (floor, (q, kh)),
      "ours": (ours, (q, index)),
      "dense": (dense, (q, kv)),
      "pos_delta": (pos, (q, kv)),
    },
    repeats=config.timing_repeats,
  )
  n = cache.n
  return writer.write(
    "timing",
    cache=name,
    note=note,
    n=n,
    heads=heads,
    head_dim=d,
    eps=eps,
    floor_ms=t["floor"]["min_ms"],
    ours_ms=t["ours"]["min_ms"],
    dense_ms=t["dense"]["min_ms"],
    pos_delta_ms=t["pos_delta"]["min_ms"],
    ours_over_floor=t["ours"]["min_ms"] / t["floor"]["min_ms"],
    ours_over_floor_median=t["ours"]["median_ms"] / t["floor"]["median_ms"],
    pos_delta_over_floor=t["pos_delta"]["min_ms"] / t["floor"]["min_ms"],
    dense_over_floor=t["dense"]["min_ms"] / t["floor"]["min_ms"],
    scored_frac_mean=float(np.mean(cert.keys_scored) / n),
    scored_frac_max=float(np.max(cert.keys_scored) / n),
    pos_delta_scored_frac=float(np.mean(pcert.keys_scored) / n),
    load_before=load0,
    load_after=_load(),
  )


# ------------------------------------------------------------------ run


def _caches(config, workdir, writer):
  """Yields (cache, group_size, windows) for the enabled caches."""
  if config.minilm.enabled:
    m = config.minilm
    cache = _kv_caches.minilm_cache(
      m.num_passages, m.max_len, tuple(map(tuple, m.heads)), m.query_stride
    )
    yield cache, m.group_size, m.windows
  if config.decoder.enabled:
    dc = config.decoder
    model, nc, secs = _kv_caches.decoder_params(dc, workdir)
    cache, acc = _kv_caches.decoder_cache(
      model, nc, tuple(dc.tasks), dc.num_sequences, config.seed
    )
    writer.write(
      "decoder",
      seq_len=nc.seq_len,
      params_s=secs,
      **{f"acc_{k}": v for k, v in acc.items()},
    )
    yield cache, dc.group_size, dc.windows
  if config.clustered.enabled:
    c = config.clustered
    yield (
      _kv_caches.clustered_cache(
        config.seed,
        c.n,
        c.head_dim,
        c.heads,
        c.cluster_size,
        c.spread,
        c.sigma,
        c.qnoise,
      ),
      c.group_size,
      (),
    )
  if config.local.enabled:
    c = config.local
    yield (
      _kv_caches.local_window_cache(
        config.seed,
        c.n,
        c.head_dim,
        c.heads,
        c.num_queries,
        config.window_sinks,
        c.strength,
      ),
      c.group_size,
      c.windows,
    )


def run(config, workdir, *, overwrite: bool = False) -> dict:
  """Runs every measurement; returns a small summary dict."""
  wd = _common.Workdir(workdir, config, overwrite=overwrite)
  workdir, writer = wd.path, wd.metrics
  meta_before = _common.machine_info()
  searches, windows, updates, timings = [], [], [], []
  for cache, group_size, wins in _caches(config, workdir, writer):
    index, build_s = _build(cache, group_size, config)
    writer.write(
      "cache",
      cache=cache.name,
      note=cache.note,
      n=cache.n,
      heads=cache.keys.shape[0],
      queries=cache.queries.shape[1],
      head_dim=cache.keys.shape[2],
      group_size=group_size,
      groups=int(np.sum(np.asarray(index.count) > 0)),
      build_s=build_s,
      load=_load(),
    )
    s64 = _logits64(cache)
    searches += measure_searches(cache, config, writer, index, s64)
    windows += measure_windows(cache, wins, config, writer, index, s64)
    updates.append(measure_update(cache, group_size, config, writer))
    if config.timing.per_cache:
      timings.append(
        measure_timing(
          cache.name, cache, index, config, writer, config.timing.eps
        )
      )
    logging.info("%s done (load %s)", cache.name, _load())
  if config.timing.enabled:
    t = config.timing
    index = None
    for qn in t.qnoise:  # same keys (same seed), flatter and flatter queries
      cache = _kv_caches.clustered_cache(
        config.seed + 1, t.n, t.head_dim, t.heads, 64, 0.1, 3.0, qn
      )
      if index is None:
        index, build_s = _build(cache, t.group_size, config)
      timings.append(
        measure_timing(
          f"clustered{t.n}",
          cache,
          index,
          config,
          writer,
          t.eps,
          note=f"qnoise={qn} build_s={build_s:.1f}",
        )
      )
  _figures(wd, searches, windows, timings)
  wd.write_json(
    "results.json",
    dict(
      meta=_common.machine_info(),
      load_before=meta_before["load_average_1_5_15"],
      results=timings,
    ),
  )
  wd.write_summary(_tables(searches, windows, updates, timings))
  return dict(searches=len(searches), windows=len(windows))


# --------------------------------------------------------------- report


def _tables(searches, windows, updates, timings):
  parts = [
    "Searches (fractions of n; scored includes the summaries):",
    _common.format_table(
      searches,
      [
        "cache",
        "eps",
        "method",
        "scored_frac",
        "scored_frac_max",
        "kept_frac",
        "k_eps_frac",
        "summary_frac",
        "tv_bound_max",
        "tau_max",
        "sound_rows",
        "rows",
      ],
    ),
    "",
    "StreamingLLM windows (sinks + last W): certified tv_bound vs true tau:",
    _common.format_table(
      [r for r, _ in windows],
      [
        "cache",
        "window",
        "tv_bound_mean",
        "tau_mean",
        "tv_bound_max",
        "tau_max",
        "tv_over_tau_median",
        "held_rows",
        "within_2tau_rows",
        "sound_rows",
        "rows",
      ],
    ),
    "",
    "Appends vs fresh build vs rebuild (Delta-Search, eps 0.05):",
    _common.format_table(
      updates,
      [
        "cache",
        "n",
        "built_on",
        "grown_scored_frac",
        "fresh_scored_frac",
        "rebuilt_scored_frac",
        "spilled_frac",
        "grown_groups",
        "fresh_groups",
      ],
    ),
    "",
    "Decode time, one query per head (min ms; ratios to the floor):",
    _common.format_table(
      timings,
      [
        "cache",
        "note",
        "n",
        "heads",
        "floor_ms",
        "ours_ms",
        "ours_over_floor",
        "dense_over_floor",
        "pos_delta_over_floor",
        "scored_frac_max",
        "load_before",
        "load_after",
      ],
    ),
  ]
  return "\n".join(parts)


def _figures(wd, searches, windows, timings):
  caches = list(dict.fromkeys(r["cache"] for r in searches))
  if caches:
    fig, axes = _common.new_figure(ncols=len(caches))
    for ax, name in zip(axes[0], caches, strict=True):
      rows = [r for r in searches if r["cache"] == name]
      for method, style in (
        ("delta", "o-"),
        ("mc", "s-"),
        ("pos_delta", "^--"),
      ):
        rr = [r for r in rows if r["method"] == method]
        ax.plot(
          [r["eps"] for r in rr],
          [r["scored_frac"] for r in rr],
          style,
          label=method,
        )
      rr = [r for r in rows if r["method"] == "delta"]
      ax.plot(
        [r["eps"] for r in rr],
        [r["k_eps_frac"] for r in rr],
        "k:",
        label="k_eps (oracle)",
      )
      ax.set_xscale("log")
      ax.set_ylim(0, 1.1)
      ax.set_title(name)
      ax.set_xlabel("eps")
      ax.set_ylabel("keys scored / n")
      ax.legend(fontsize=7)
    wd.save_figure(fig, "kv_scored")
  if windows:
    fig, axes = _common.new_figure()
    ax = axes[0, 0]
    for rec, r in windows:
      ax.loglog(
        np.maximum(r["tau"].ravel(), 1e-30),
        np.maximum(r["tv"].ravel(), 1e-30),
        ".",
        ms=3,
        label=f"{rec['cache']} W={rec['window']}",
      )
    ax.plot([1e-30, 1], [1e-30, 1], "k-", lw=0.5)
    ax.set_xlabel("true tau (float64)")
    ax.set_ylabel("certified tv_bound")
    ax.set_title("certify_selection, sinks + window")
    ax.legend(fontsize=6)
    wd.save_figure(fig, "kv_windows")
  if timings:
    fig, axes = _common.new_figure(size=(7, 3.5))
    ax = axes[0, 0]
    names = [f"{r['cache']}\n{r['note'][:12]}" for r in timings]
    x = np.arange(len(timings))
    for i, (key, lab) in enumerate(
      (
        ("ours_over_floor", "ours"),
        ("dense_over_floor", "dense"),
        ("pos_delta_over_floor", "position Delta"),
      )
    ):
      ax.bar(x + 0.27 * (i - 1), [r[key] for r in timings], 0.27, label=lab)
    ax.axhline(1.0, color="k", lw=0.5)
    ax.axhline(0.7, color="r", lw=0.5, ls="--")
    ax.set_yscale("log")
    ax.set_xticks(x, names, fontsize=6)
    ax.set_ylabel("time / logits floor")
    ax.legend(fontsize=7)
    wd.save_figure(fig, "kv_timing")


if __name__ == "__main__":
  _common.app_main(NAME, run)
