r"""Which sound bound lets certified attention read less than dense?

THEORY 3.3 (block and group summaries), 3.5 (key codes), 6.2 (Delta-Search).
For every cache and head (experiments/_kv_caches and below: MiniLM over
long concatenations of real passages, every layer and head; the native
Top-k decoder's caches; synthetic LLM-like caches with attention sinks,
local RoPE heads, retrieval heads, flat rotary heads), three parts:

- ``bounds``: candidate sound upper bounds on the logits of keys not
  scored, compared by honest cost in a float64 simulation of the search
  (units ordered by their bound mass, scored until the unscored bound mass
  U satisfies U <= eps (Z_scored + U); per-key bounds are scored in blocks
  of 16 keys of the sorted order). Cost = keys scored exactly plus every
  summary and code read, in key-equivalents weighted by the share of a
  float32 key's bytes it reads (``COST`` below), and bytes read per key:

  - ``box64``: box (per-dimension min/max) of 64 consecutive positions
    (the KVCache's block summaries, Quest's page bound);
  - ``ball16``: ball (centre, radius) of k-means groups of 16 keys (the
    content index);
  - ``pca{r}``: a per-head rank-r PCA of the keys, q_P.k_P + ||q_perp||
    ||k_perp|| with the exact residual norm kept per key;
  - ``pca8_ball16``: residual balls of groups in the projected space
    (centre and radius of k_P per group, plus the group's largest residual
    norm);
  - ``codes8`` (THEORY 3.5, what the library builds), ``codes8_cs`` (the
    same codes with Cauchy-Schwarz on a stored residual norm), ``codes4``
    (4-bit codes), ``codes8_blk`` (one exponent per block of 64 keys);
  - ``ball16_codes8``: hierarchical: group balls first, the codes of the
    keys of the groups they cannot rule out, then exact scores.

- ``library``: ``jaxtopk.decode_attention`` over a ``KVCache`` of the same
  keys with the default ``Certified(eps)`` (Auto), ``bound='codes'`` and
  ``'exact'``: keys_scored / n from the certificates, tv_bound <= eps, and
  soundness of output_error_bound against the float64 attention output.
- ``windows``: StreamingLLM windows (4 sinks + the last W keys): the
  certified tv bound from the other keys' codes, and from their group
  balls, against the true tau (the goal: <= 2 tau + 0.01 where the window
  holds >= 95% of the mass); in simulation for every cache, and through
  ``jaxtopk.certify_selection`` on a content index (with and without the
  codes) for caches of at most ``window_library_max_heads`` heads.

Outputs: config.json, metrics.jsonl (kinds "head", "library_call",
"window", "window_library"),
summary.txt, bound_study.png (keys scored against the oracle per MiniLM
head), results.json (the per-cache means).

  python -m experiments.bound_study \
    --config=experiments/configs/bound_study.py \
    --workdir=experiments/results/bound_study
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxtopk
from experiments import _common
from experiments import _kv_caches
from jaxtopk.selection import key_codes

NAME = "bound_study"
FAMILIES = (
  "box64",
  "ball16",
  "pca4",
  "pca8",
  "pca8_ball16",
  "codes8",
  "codes8_cs",
  "codes4",
  "codes8_blk",
  "ball16_codes8",
)
SEARCH_BLOCK = 16  # per-key bounds: keys scored in blocks of the sorted order


def cost_per_key(family, d):
  """Key-equivalents read per key by a family's summaries (float32 keys)."""
  return {
    "box64": 2 * d / (64 * d),
    "ball16": (d + 1) / (16 * d),
    "pca4": (4 + 1) / d,
    "pca8": (8 + 1) / d,
    "pca8_ball16": (8 + 2) / (16 * d),
    "codes8": key_codes.code_share(d, jnp.float32),  # what keys_scored counts
    "codes8_cs": key_codes.code_share(d, jnp.float32) + 1 / d,
    "codes4": (d / 2 + 1) / (4 * d),
    "codes8_blk": 1 / 4 + 1 / (64 * 4 * d),
    "ball16_codes8": (d + 1) / (16 * d),  # + codes of expanded groups
  }[family]


# ------------------------------------------------------------- caches


def _rope(x, pos, base=10000.0):
  d = x.shape[-1]
  half = d // 2
  theta = base ** (-np.arange(half) / half)
  ang = pos[..., None] * theta
  c, s = np.cos(ang), np.sin(ang)
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], -1)


def llm_like_cache(seed, n, d, num_queries):
  """Synthetic heads of the kinds LLM caches hold, rotary positions.

  Every key and query is a rotary (RoPE) vector plus noise; on top:
  ``sink`` (4 sink keys that every query favours by ~14 logits, the
  StreamingLLM pattern), ``local`` (the RoPE content peaks at the query's
  own position and falls with the distance: a local head), ``sink_local``
  (both), ``retrieval`` (24 keys scattered through the cache share a topic
  the query asks for, ~10 logits up), ``rotary_flat`` (nothing on top:
  flat attention). Sink and topic directions are added after the rotation
  (position-free components).
  """
  rng = np.random.default_rng(seed)
  pos = np.arange(n, dtype=np.float64)
  qpos = np.arange(n - num_queries, n, dtype=np.float64)
  heads, labels = [], []
  scale = 1 / np.sqrt(d)
  for kind in ("sink", "local", "sink_local", "retrieval", "rotary_flat"):
    k = _rope(rng.normal(size=(n, d)) * 0.5, pos)
    q = _rope(rng.normal(size=(num_queries, d)) * 0.5, qpos)
    if kind in ("local", "sink_local"):  # the local_window_cache pattern
      u = rng.normal(size=d) / np.sqrt(d) * 4
      k = k + _rope(np.broadcast_to(u, (n, d)), pos)
      q = q + 10.0 * _rope(np.broadcast_to(u, (num_queries, d)), qpos)
    if kind in ("sink", "sink_local"):
      e = rng.normal(size=d)
      e /= np.linalg.norm(e)
      k[:4] += 8.0 * e
      q = q + 14.0 / (8.0 * scale) * e
    if kind == "retrieval":
      topic = rng.normal(size=d)
      topic /= np.linalg.norm(topic)
      at = rng.choice(n - num_queries, 24, replace=False)
      k[at] += 4.0 * topic
      q = q + 10.0 / (4.0 * scale) * topic
    heads.append((k, q))
    labels.append(kind)
  v = rng.normal(size=(len(heads), n, d))
  return _kv_caches.Cache(
    name="llm_like",
    keys=np.asarray([h[0] for h in heads], np.float32),
    values=np.asarray(v, np.float32),
    queries=np.asarray([h[1] for h in heads], np.float32),
    scale=scale,
    note=(
      f"synthetic rotary heads (sink, local, sink_local, retrieval,"
      f" rotary_flat), n {n}, d {d}; queries at the last {num_queries}"
      " positions"
    ),
    labels=tuple(labels),
  )


def _caches(config, workdir):
  """Yields the enabled caches."""
  for num in config.minilm.num_passages:
    m = config.minilm
    heads = tuple((l_, h) for l_ in range(m.layers) for h in range(m.heads))
    c = _kv_caches.minilm_cache(num, m.max_len, heads, m.query_stride)
    yield _kv_caches.Cache(**{**c.__dict__, "name": f"minilm_{c.n}"})
  if config.decoder.enabled:
    dc = config.decoder
    model, nc, _ = _kv_caches.decoder_params(dc, workdir)
    cache, _ = _kv_caches.decoder_cache(
      model, nc, tuple(dc.tasks), dc.num_sequences, config.seed
    )
    yield cache
  if config.llm_like.enabled:
    c = config.llm_like
    yield llm_like_cache(config.seed, c.n, c.head_dim, c.num_queries)


# ---------------------------------------------------------- bounds (sim)


def _kmeans(x, num, iters, rng):
  c = x[rng.choice(len(x), num, replace=False)].copy()
  xx = np.sum(x * x, 1)[:, None]
  for _ in range(iters):
    a = np.argmin(xx - 2 * x @ c.T + np.sum(c * c, 1)[None], 1)
    sums = np.zeros_like(c)
    np.add.at(sums, a, x)
    cnt = np.bincount(a, minlength=num)[:, None]
    c = np.where(cnt > 0, sums / np.maximum(cnt, 1), c)
  return np.argmin(xx - 2 * x @ c.T + np.sum(c * c, 1)[None], 1), c


def _codes(k, bits, block=None):
  """(k_hat, step per key) of power-of-two codes (THEORY 3.5)."""
  qmax = 2 ** (bits - 1) - 1
  a = np.abs(k).max(-1)
  if block:
    a = np.repeat(np.maximum.reduceat(a, np.arange(0, len(a), block)), block)[
      : len(a)
    ]
  step = 2.0 ** np.ceil(np.log2(np.maximum(a, 1e-30) / qmax))
  return np.round(k / step[:, None]) * step[:, None], step


def _keys_scored_perkey(s, u, eps):
  """Keys scored when every key has bound u: [r, n] -> [r]."""
  n = s.shape[-1]
  out = np.empty(len(s))
  idx = np.minimum(np.arange(0, -(-n // SEARCH_BLOCK) + 1) * SEARCH_BLOCK, n)
  for r in range(len(s)):
    o = np.argsort(-u[r])
    m = u[r, o[0]]
    cu = np.concatenate([[0.0], np.cumsum(np.exp(u[r, o] - m))])
    cs = np.concatenate([[0.0], np.cumsum(np.exp(s[r, o] - m))])[idx]
    rest = cu[-1] - cu[idx]
    out[r] = idx[np.argmax(rest <= eps * (cs + rest))]
  return out


def _keys_scored_groups(s, ug, grp, eps, inner=None, frac=0.1):
  """Units = groups (bounds ug [r, G], members grp [n]): scored groups'
  keys count 1 each; with ``inner`` [r, n] per-key bounds, a group is
  first opened to its keys' bounds (cost counted by the caller), which are
  then scored per key (``frac``: share of the budget left to unopened
  groups). Returns (keys scored, keys opened) per row."""
  num = ug.shape[1]
  cnt = np.bincount(grp, minlength=num)
  scored = np.empty(len(s))
  opened = np.zeros(len(s))
  for r in range(len(s)):
    m = max(ug[r].max(), s[r].max())
    z = np.exp(s[r] - m).sum()
    mass = cnt * np.exp(ug[r] - m)
    o = np.argsort(-mass)
    rest = np.concatenate([np.cumsum(mass[o][::-1])[::-1], [0.0]])
    zg = np.concatenate(
      [
        [0.0],
        np.cumsum(np.bincount(grp, weights=np.exp(s[r] - m), minlength=num)[o]),
      ]
    )
    if inner is None:
      j = np.argmax(rest <= eps * (zg + rest))
      scored[r] = cnt[o[:j]].sum()
      continue
    j = np.argmax(rest <= frac * eps * z)
    keys = np.isin(grp, o[:j])
    opened[r] = keys.sum()
    ui, si = inner[r, keys], s[r, keys]
    oo = np.argsort(-ui)
    cu = np.concatenate([[0.0], np.cumsum(np.exp(ui[oo] - m))])
    cs = np.concatenate([[0.0], np.cumsum(np.exp(si[oo] - m))])
    restk = cu[-1] - cu + rest[j]
    ok = restk <= eps * (cs + restk)
    jj = np.argmax(ok) if ok.any() else len(ui)
    scored[r] = min(len(ui), -(-jj // SEARCH_BLOCK) * SEARCH_BLOCK)
  return scored, opened


def _k_eps(s, eps):
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  c = np.cumsum(-np.sort(-p, -1), -1)
  return np.sum(c < 1 - eps, -1) + 1


def head_bounds(k, q, scale, eps, rng, config):
  """Every family's keys scored / n (cost included) for one head."""
  n, d = k.shape
  s = scale * q @ k.T  # [r, n] float64
  qn = np.linalg.norm(q, axis=-1)
  ql1 = np.abs(q).sum(-1)
  out = {"k_eps": _k_eps(s, eps) / n}
  # box64: position blocks.
  nb = -(-n // 64)
  kb = np.pad(k, ((0, nb * 64 - n), (0, 0)), mode="edge").reshape(nb, 64, d)
  lo, hi = kb.min(1), kb.max(1)
  ub = scale * (np.maximum(q, 0) @ hi.T + np.minimum(q, 0) @ lo.T)
  blk = np.minimum(np.arange(n) // 64, nb - 1)
  out["box64"] = _keys_scored_groups(s, ub, blk, eps)[0] / n
  # ball16: k-means groups.
  grp, cen = _kmeans(k, max(1, n // 16), config.kmeans_iters, rng)
  rad = np.zeros(len(cen))
  np.maximum.at(rad, grp, np.linalg.norm(k - cen[grp], axis=1))
  ug = scale * (q @ cen.T + qn[:, None] * rad[None])
  out["ball16"] = _keys_scored_groups(s, ug, grp, eps)[0] / n
  # PCA.
  _, vecs = np.linalg.eigh(k.T @ k)
  for r_ in (4, 8):
    p = vecs[:, -r_:]
    kp, qp = k @ p, q @ p
    kr = np.linalg.norm(k - kp @ p.T, axis=-1)
    qr = np.linalg.norm(q - qp @ p.T, axis=-1)
    u = scale * (qp @ kp.T + qr[:, None] * kr[None])
    out[f"pca{r_}"] = _keys_scored_perkey(s, u, eps) / n
    if r_ == 8:  # residual balls of groups in the projected space
      cp = np.zeros((len(cen), r_))
      np.add.at(cp, grp, kp)
      cp /= np.maximum(np.bincount(grp, minlength=len(cen)), 1)[:, None]
      rp = np.zeros(len(cen))
      np.maximum.at(rp, grp, np.linalg.norm(kp - cp[grp], axis=1))
      rr = np.zeros(len(cen))
      np.maximum.at(rr, grp, kr)
      qpn = np.linalg.norm(qp, axis=-1)
      ugp = scale * (qp @ cp.T + qpn[:, None] * rp[None] + qr[:, None] * rr)
      out["pca8_ball16"] = _keys_scored_groups(s, ugp, grp, eps)[0] / n
  # Codes.
  kh, step = _codes(k, 8)
  u8 = scale * (q @ kh.T + 0.5 * ql1[:, None] * step[None])
  out["codes8"] = _keys_scored_perkey(s, u8, eps) / n
  res = np.linalg.norm(k - kh, axis=-1)
  u = scale * (q @ kh.T + qn[:, None] * res[None])
  out["codes8_cs"] = _keys_scored_perkey(s, u, eps) / n
  kh4, step4 = _codes(k, 4)
  u = scale * (q @ kh4.T + 0.5 * ql1[:, None] * step4[None])
  out["codes4"] = _keys_scored_perkey(s, u, eps) / n
  khb, stepb = _codes(k, 8, block=64)
  u = scale * (q @ khb.T + 0.5 * ql1[:, None] * stepb[None])
  out["codes8_blk"] = _keys_scored_perkey(s, u, eps) / n
  sc, opened = _keys_scored_groups(s, ug, grp, eps, inner=u8)
  out["ball16_codes8"] = (sc + opened * cost_per_key("codes8", d)) / n
  for f in FAMILIES:
    out[f] = out[f] + cost_per_key(f, d)
  # The median slack of the codes bound over the keys (logits).
  out["codes8_slack_median"] = float(np.median(u8 - s))
  out["ball16_slack_median"] = float(np.median(ug[:, grp] - s))
  return out, s, u8, ug, grp


# ------------------------------------------------------------ library


def _kv(cache):
  """A KVCache of every head of ``cache`` (one kv head per head)."""
  h, n, d = cache.keys.shape
  bs = 64
  max_len = -(-n // bs) * bs
  kv = jaxtopk.KVCache.create(
    1, max_len, h, d, block_size=bs, value_dim=cache.values.shape[-1]
  )
  return kv.append(
    jnp.asarray(np.swapaxes(cache.keys, 0, 1))[None],
    jnp.asarray(np.swapaxes(cache.values, 0, 1))[None],
  )


def library_rows(cache, eps, writer):
  """Keys scored by decode_attention (Auto, codes, exact) per head."""
  kv = _kv(cache)
  h, n, _ = cache.keys.shape
  nq = cache.queries.shape[1]
  k64 = cache.keys.astype(np.float64)
  v64 = cache.values.astype(np.float64)
  policies = {
    "auto": jaxtopk.Certified(eps),
    "codes": jaxtopk.Certified(eps, jaxtopk.DeltaSearch(bound=jaxtopk.Codes())),
    "exact": jaxtopk.Certified(eps, "exact"),
  }
  out = {}
  for name, policy in policies.items():
    fn = jax.jit(
      lambda q, c, p=policy: jaxtopk.decode_attention(
        q, c, policy=p, scale=cache.scale
      )
    )
    scored = np.zeros((h, nq))
    tv = np.zeros((h, nq))
    sound = np.ones((h, nq), bool)
    tick = time.time()
    for j in range(nq):
      q = cache.queries[:, j]  # [h, d]
      o, cert = fn(jnp.asarray(q)[None, None], kv)
      o = np.asarray(o[0, 0], np.float64)
      scored[:, j] = np.asarray(cert.keys_scored[0, 0]) / n
      tv[:, j] = np.asarray(cert.tv_bound[0, 0])
      s = cache.scale * np.einsum("hd,hnd->hn", q.astype(np.float64), k64)
      p = np.exp(s - s.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      ref = np.einsum("hn,hnd->hd", p, v64)
      err = np.linalg.norm(ref - o, axis=-1)
      bound = np.asarray(cert.output_error_bound[0, 0], np.float64)
      rnd = 1e-5 * np.maximum(np.linalg.norm(o, axis=-1), 1e-30)
      sound[:, j] = np.asarray(cert.valid[0, 0]) & (bound >= err - rnd)
    out[name] = dict(scored=scored, tv=tv, sound=sound)
    writer.write(
      "library_call",
      cache=cache.name,
      policy=name,
      seconds=time.time() - tick,
      load=_load(),
    )
  return out


def _load():
  return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


# ------------------------------------------------------------ windows


def window_rows(cache, s, u8, ug, grp, head, writer, windows, sinks):
  """Certified tv bounds of StreamingLLM windows vs the truth."""
  n = s.shape[-1]
  for w in windows:
    if w + sinks >= n:
      continue
    sel = np.zeros(n, bool)
    sel[:sinks] = True
    sel[n - w :] = True
    m = np.maximum(s.max(-1), u8.max(-1))[:, None]
    z_sel = np.exp(s - m)[:, sel].sum(-1)
    z_out = np.exp(s - m)[:, ~sel].sum(-1)
    tau = z_out / (z_sel + z_out)
    u_codes = np.exp(u8 - m)[:, ~sel].sum(-1)
    cnt_out = np.bincount(grp[~sel], minlength=ug.shape[1])
    u_ball = (cnt_out[None] * np.exp(np.minimum(ug - m, 80))).sum(-1)
    for r in range(len(s)):
      writer.write(
        "window",
        cache=cache.name,
        head=cache.labels[head],
        window=w,
        tau=float(tau[r]),
        tv_codes=float(u_codes[r] / (z_sel[r] + u_codes[r])),
        tv_ball=float(min(1.0, u_ball[r] / (z_sel[r] + u_ball[r]))),
      )


def window_library_rows(cache, config, writer):
  """``jaxtopk.certify_selection`` of the windows on a content index of the
  cache (ball bounds alone, and with the codes: the library's default)."""
  h, n, d = cache.keys.shape
  index = jaxtopk.IndexedKVCache.build(
    jnp.asarray(np.swapaxes(cache.keys, 0, 1))[None],
    jnp.asarray(np.swapaxes(cache.values, 0, 1))[None],
    group_size=config.window_group_size,
    kmeans_iters=config.kmeans_iters,
  )
  k64 = cache.keys.astype(np.float64)
  for w in config.windows:
    if w + config.window_sinks >= n:
      continue
    sel = np.zeros(n, bool)
    sel[: config.window_sinks] = True
    sel[n - w :] = True
    pos = jnp.asarray(np.nonzero(sel)[0], jnp.int32)[None, None, None]
    for j in range(cache.queries.shape[1]):
      q = cache.queries[:, j]
      s = cache.scale * np.einsum("hd,hnd->hn", q.astype(np.float64), k64)
      p = np.exp(s - s.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      tau = p[:, ~sel].sum(-1)
      certs = {
        codes: jaxtopk.certify_selection(
          jnp.asarray(q)[None, None], index, pos, scale=cache.scale,
          codes=codes,
        )
        for codes in (False, True)
      }  # fmt: skip
      for i in range(h):
        tv = {c: float(certs[c].tv_bound[0, 0, i]) for c in certs}
        writer.write(
          "window_library",
          cache=cache.name,
          head=cache.labels[i],
          window=w,
          tau=float(tau[i]),
          tv_codes=tv[True],
          tv_ball=tv[False],
          sound=bool(tv[True] >= tau[i] - 1e-6 and tv[False] >= tau[i] - 1e-6),
          scored_codes=float(certs[True].keys_scored[0, 0, i]) / n,
        )


# ---------------------------------------------------------------- run


def run(config, workdir, *, overwrite: bool = False) -> dict:
  """Every part on every cache; returns the per-cache means."""
  wd = _common.Workdir(workdir, config, overwrite=overwrite)
  rng = np.random.default_rng(config.seed)
  results = {}
  for cache in _caches(config, workdir):
    h, n, d = cache.keys.shape
    nq = min(cache.queries.shape[1], config.max_queries)
    cache = _kv_caches.Cache(
      **{**cache.__dict__, "queries": cache.queries[:, :nq]}
    )
    lib = library_rows(cache, config.eps, wd.metrics) if config.library else {}
    prog = _common.Progress(f"bounds {cache.name}", h)
    rows = []
    for i in range(h):
      k = cache.keys[i].astype(np.float64)
      q = cache.queries[i].astype(np.float64)
      res, s, u8, ug, grp = head_bounds(
        k, q, cache.scale, config.eps, rng, config
      )
      row = dict(cache=cache.name, head=cache.labels[i], n=n, d=d)
      row.update({f: float(np.mean(v)) for f, v in res.items()})
      row["k_eps_max"] = float(np.max(res["k_eps"]))
      for name, r in lib.items():
        row[f"lib_{name}"] = float(np.mean(r["scored"][i]))
        row[f"lib_{name}_tv_max"] = float(np.max(r["tv"][i]))
        row[f"lib_{name}_sound"] = float(np.mean(r["sound"][i]))
      # Bytes read per key (float32 keys of d * 4 bytes).
      row["bytes_codes8"] = row["codes8"] * 4 * d
      if "lib_auto" in row:
        row["bytes_lib_auto"] = row["lib_auto"] * 4 * d
      rows.append(row)
      wd.metrics.write("head", **row)
      if config.windows:
        window_rows(
          cache, s, u8, ug, grp, i, wd.metrics, config.windows,
          config.window_sinks,
        )  # fmt: skip
      prog.update()
    if config.windows and h <= config.window_library_max_heads:
      window_library_rows(cache, config, wd.metrics)
    results[cache.name] = _means(rows)
  wd.write_json("results.json", dict(meta=_common.machine_info(), **results))
  text = _tables(wd, results)
  wd.write_summary(text)
  _figure(wd)
  return results


def _means(rows):
  keys = [k for k in rows[0] if isinstance(rows[0][k], float)]
  ke = np.array([r["k_eps"] for r in rows])
  peaked = ke <= 0.25
  out = {"heads": len(rows), "peaked_heads": int(peaked.sum())}
  for k in keys:
    v = np.array([r[k] for r in rows])
    out[k] = float(v.mean())
    out[f"{k}_max"] = float(v.max())
    if peaked.any():
      out[f"{k}_peaked"] = float(v[peaked].mean())
  return out


def _tables(wd, results):
  lines = []
  cols = ["k_eps", *FAMILIES]
  rows = []
  for name, r in results.items():
    for sub in ("", "_peaked"):
      if f"k_eps{sub}" not in r:
        continue
      row = {"cache": name + (" (k_eps<=.25)" if sub else " (all)")}
      for c in cols + ["lib_auto", "lib_codes", "lib_exact"]:
        if f"{c}{sub}" in r:
          row[c] = r[f"{c}{sub}"]
      rows.append(row)
  lines.append(
    "keys scored / n (summaries and codes included), mean over heads"
  )
  lines.append(
    _common.format_table(
      rows, ["cache", *cols, "lib_auto", "lib_codes", "lib_exact"]
    )
  )
  lib = [
    dict(
      cache=name,
      auto_max=r.get("lib_auto_max"),
      codes_max=r.get("lib_codes_max"),
      tv_max=r.get("lib_auto_tv_max_max"),
      sound_min=min(
        r.get(f"lib_{p}_sound", 1.0) for p in ("auto", "codes", "exact")
      ),
    )
    for name, r in results.items()
    if "lib_auto" in r
  ]
  if lib:
    lines.append("\nlibrary: worst head, largest tv_bound, sound fraction")
    lines.append(
      _common.format_table(lib, ["cache", "auto_max", "codes_max", "tv_max",
                                 "sound_min"])
    )  # fmt: skip
  win = _common.read_metrics(wd.path, "window")
  if win:
    held = [w for w in win if w["tau"] <= 0.05]
    agg = {}
    for w in held:
      a = agg.setdefault((w["cache"], w["window"]), [])
      a.append(w)
    wrows = []
    for (c, w), ws in agg.items():
      tau = np.array([x["tau"] for x in ws])
      tvc = np.array([x["tv_codes"] for x in ws])
      tvb = np.array([x["tv_ball"] for x in ws])
      wrows.append(
        dict(
          cache=c,
          window=w,
          rows=len(ws),
          tau_mean=float(tau.mean()),
          tv_codes_mean=float(tvc.mean()),
          tv_ball_mean=float(tvb.mean()),
          codes_goal=float(np.mean(tvc <= 2 * tau + 0.01)),
        )
      )
    lines.append(
      "\nwindows holding >= 95% of the mass: certified tv vs tau (goal"
      " tv <= 2 tau + 0.01: fraction of rows meeting it)"
    )
    lines.append(
      _common.format_table(
        wrows,
        ["cache", "window", "rows", "tau_mean", "tv_codes_mean",
         "tv_ball_mean", "codes_goal"],
      )
    )  # fmt: skip
  wl = _common.read_metrics(wd.path, "window_library")
  if wl:
    agg = {}
    for w in wl:
      agg.setdefault((w["cache"], w["head"], w["window"]), []).append(w)
    wrows = []
    for (c, hd, w), ws in agg.items():
      tau = np.array([x["tau"] for x in ws])
      tvc = np.array([x["tv_codes"] for x in ws])
      tvb = np.array([x["tv_ball"] for x in ws])
      wrows.append(
        dict(
          cache=c,
          head=hd,
          window=w,
          tau_mean=float(tau.mean()),
          tv_codes_mean=float(tvc.mean()),
          tv_ball_mean=float(tvb.mean()),
          held=float(np.mean(tau <= 0.05)),
          goal=(
            float(np.mean((tvc <= 2 * tau + 0.01)[tau <= 0.05]))
            if np.any(tau <= 0.05)
            else float("nan")
          ),
          sound=float(np.mean([x["sound"] for x in ws])),
        )
      )
    lines.append(
      "\ncertify_selection (library) of the windows: mean tau and tv"
      " (codes: the default; ball: codes=False); held = rows where the window"
      " holds >= 95%; goal = fraction of those rows with tv <= 2 tau + 0.01"
      " (nan: none)"
    )
    lines.append(
      _common.format_table(
        wrows,
        ["cache", "head", "window", "tau_mean", "tv_codes_mean",
         "tv_ball_mean", "held", "goal", "sound"],
      )
    )  # fmt: skip
  return "\n".join(lines)


def _figure(wd):
  rows = _common.read_metrics(wd.path, "head")
  if not rows:
    return
  fig, axes = _common.new_figure(size=(5, 4))
  ax = axes[0, 0]
  names = sorted({r["cache"] for r in rows})
  mini = [r for r in rows if r["cache"].startswith("minilm")] or rows
  ke = np.array([r["k_eps"] for r in mini])
  for fam, mk in (("ball16", "s"), ("pca8", "^"), ("codes8", "o")):
    ax.scatter(ke, [r[fam] for r in mini], s=10, marker=mk, label=fam)
  if "lib_auto" in mini[0]:
    ax.scatter(ke, [r["lib_auto"] for r in mini], s=10, marker="x",
               label="library Certified(eps)")  # fmt: skip
  ax.plot([0, 1], [0, 1], "k:", lw=1, label="oracle k_eps")
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_xlabel("oracle k_eps / n")
  ax.set_ylabel("keys scored / n (cost included)")
  ax.set_title(f"{', '.join(n for n in names if n.startswith('minilm'))}")
  ax.legend(fontsize=7)
  wd.save_figure(fig, "bound_study")


if __name__ == "__main__":
  _common.app_main(NAME, run)
