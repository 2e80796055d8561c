"""Benchmark: certified Top-k attention against dense attention.

Parts (``config.parts``; each writes its own rows, so parts can be added):

- ``prefill``: ``jaxtopk.topk_attention`` (XLA blockwise prefill) on
  ``[1, seq, heads, head_dim]``, causal, timed side by side (round-robin,
  ``_common.time_round_robin``) with ``jax.nn.dot_product_attention`` and a
  plain einsum-softmax-einsum, over workloads:

  - ``flat``: iid Gaussian q, k, v (flat rows: the worst case of Top-k);
  - ``topic``: keys in contiguous topic blocks of ``topic_len`` tokens
    (a topic direction times 12, plus noise 0.05); every query of a topic
    block seeks ONE earlier topic (a random earlier topic; the first block
    its own), so its mass sits in one earlier block of keys;
  - ``local_sinks``: RoPE-like locality (logits fall with the distance
    ``|i - j|`` over about ``window`` tokens) plus ``sinks`` attention-sink
    keys at the start that every query attends to;
  - ``minilm``: real all-MiniLM-L6-v2 queries/keys/values of one passage of
    ``minilm_len`` tokens, its 6 layers as the batch, 12 heads of 32,
    bidirectional (not causal) with the padding mask.

  Variants: ``jax_nn`` (the reference of the ratios), ``einsum``, our
  ``Dense()``, ``FixedK(seq // 16)``, ``Certified(eps)`` (the default,
  ``Auto``: the tile search, which scores every block where the bounds
  cannot rule it out), ``Certified(eps, search='exact')`` (every key
  scored) and ``Certified(eps, search='delta')`` (key blocks skipped under
  box bounds).
- ``memory``: peak resident memory (``ru_maxrss``) of one causal
  ``Certified(eps, search=...)`` prefill of ``[1, seq, heads, head_dim]``,
  each in a fresh subprocess (compile included), with its time.
- ``flax``: ``CertifiedTopKAttention`` (Dense, Certified, and Certified
  with ``dense_above``: the training mode) against
  ``nnx.MultiHeadAttention`` with the same weights: causal forward, and a
  training step (gradient of a squared-output loss w.r.t. the parameters),
  each with the time of its first call (trace and compile included).

Every timing is the min (and median) of ``repeats`` interleaved runs after
two warm-ups; ratios are to the reference of the same run. ``results.json``
carries the machine, jax version and load average (``meta``).

Launch (experiments/README.md; ``:smoke`` for a run of seconds):
  python -m experiments.bench_attention \
    --config=experiments/configs/bench_attention.py --workdir=/tmp/ba
"""

import json
import math
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxtopk
from experiments import _common
from jaxtopk import nn as topk_nn

NAME = "bench_attention"
REPO = pathlib.Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------
# Workloads: (q, k, v) [b, t, h, d] float32, plus causal flag and mask.


def flat_workload(key, t, h, d):
  """iid Gaussian q, k, v."""
  kq, kk, kv = jax.random.split(key, 3)
  return [jax.random.normal(x, (1, t, h, d)) for x in (kq, kk, kv)]


def topic_workload(seed, t, h, d, topic_len, amp=12.0, noise=0.05):
  """Keys in contiguous topic blocks; each query block seeks one earlier."""
  rng = np.random.default_rng(seed)
  ntop = -(-t // topic_len)
  c = rng.normal(size=(ntop, h, d))
  c /= np.linalg.norm(c, axis=-1, keepdims=True)
  tid = np.arange(t) // topic_len
  seek_of = np.array([rng.integers(0, j) if j else 0 for j in range(ntop)])
  k = amp * c[tid] + noise * rng.normal(size=(t, h, d))
  q = amp * c[seek_of[tid]] + noise * rng.normal(size=(t, h, d))
  v = rng.normal(size=(t, h, d))
  return [jnp.asarray(x[None], jnp.float32) for x in (q, k, v)]


def local_sinks_workload(seed, t, h, d, window, sinks):
  """RoPE-like local attention over ~``window`` tokens plus sink keys.

  Features: ``d // 2 - 1`` rotary pairs with frequencies from 1 down to
  ``1 / window`` (q.k = a sum of cos(w (i - j)), largest at i = j), and
  one pair for the sinks: every query has weight 1 along a sink direction
  that only the first ``sinks`` keys carry.
  """
  rng = np.random.default_rng(seed)
  npair = d // 2 - 1
  w = np.geomspace(1.0, 1.0 / window, npair)
  pos = np.arange(t)[:, None] * w[None, :]  # [t, npair]
  amp = math.sqrt(2.0 * math.sqrt(d) * 8.0 / npair)  # peak logit ~ 16
  rot = np.concatenate([np.cos(pos), np.sin(pos)], -1) * amp  # [t, 2 npair]
  sink_q = np.full((t, 1), 1.0)
  sink_k = np.where(np.arange(t)[:, None] < sinks, 12.0 * math.sqrt(d), 0.0)
  zeros = np.zeros((t, 1))
  q = np.concatenate([rot, sink_q, zeros], -1)
  k = np.concatenate([rot, sink_k, zeros], -1)
  q = np.broadcast_to(q[:, None], (t, h, d)) + 0.05 * rng.normal(size=(t, h, d))
  k = np.broadcast_to(k[:, None], (t, h, d)) + 0.05 * rng.normal(size=(t, h, d))
  v = rng.normal(size=(t, h, d))
  return [jnp.asarray(x[None], jnp.float32) for x in (q, k, v)]


def minilm_workload(max_len):
  """Real MiniLM q, k, v ``[layers, S, 12, 32]`` and the key mask."""
  from experiments import _data

  a = _data.minilm_arrays(1, max_len)
  qkv = [
    jnp.asarray(np.moveaxis(np.asarray(a[n])[:, 0], 1, 2), jnp.float32)
    for n in ("queries", "keys", "values")
  ]  # [L, S, H, dh]
  km = jnp.asarray(np.asarray(a["key_mask"], bool)[0])  # [S]
  mask = jnp.broadcast_to(km, (qkv[0].shape[0], 1, 1, km.shape[0]))
  return qkv, mask, float(a["scale"])


# ---------------------------------------------------------------------------
# Prefill part.


def _einsum_attention(q, k, v, mask, causal, scale):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
  t, n = q.shape[1], k.shape[1]
  ok = jnp.ones((1, 1, t, n), bool) if mask is None else mask
  if causal:
    ok = ok & jnp.tril(jnp.ones((t, n), bool))
  s = jnp.where(ok, s, -jnp.inf)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def prefill_variants(seq, eps):
  """Variant name -> policy (None: a dense baseline)."""
  return {
    "jax_nn": None,
    "einsum": None,
    "dense": jaxtopk.Dense(),
    "fixed_k": jaxtopk.FixedK(max(1, seq // 16)),
    "certified": jaxtopk.Certified(eps),  # the default: Auto
    "certified_exact": jaxtopk.Certified(eps, search="exact"),
    "certified_delta": jaxtopk.Certified(eps, search="delta"),
  }


def time_prefill(name, qkv, mask, causal, scale, eps, repeats, jitted=None):
  """One workload: every variant timed round-robin; the record.

  ``jitted`` (a dict, filled here) holds the jitted variants of earlier
  workloads without a mask: workloads of one shape share their programs.
  """
  q, k, v = qkv
  seq = k.shape[1]
  fns = {}
  for var, policy in prefill_variants(seq, eps).items():
    key = (var, seq, eps, causal, scale)
    if mask is None and jitted is not None and key in jitted:
      fns[var] = (jitted[key], (q, k, v))
      continue
    if var == "jax_nn":
      fn = jax.jit(
        lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, mask=mask, is_causal=causal, scale=scale
        )
      )
    elif var == "einsum":
      fn = jax.jit(
        lambda q, k, v: _einsum_attention(q, k, v, mask, causal, scale)
      )
    else:
      fn = jax.jit(
        lambda q, k, v, policy=policy: jaxtopk.topk_attention(
          q, k, v, policy=policy, mask=mask, is_causal=causal, scale=scale
        )
      )
    fns[var] = (fn, (q, k, v))
    if mask is None and jitted is not None:
      jitted[key] = fn
  load_before = list(os.getloadavg())
  times = _common.time_round_robin(fns, repeats=repeats)
  ref_out = fns["jax_nn"][0](q, k, v)
  base = times["jax_nn"]["min_ms"]
  rows = {}
  for var, t in times.items():
    row = dict(t, ratio_vs_jax_nn=t["min_ms"] / base)
    if var not in ("jax_nn", "einsum"):
      out, cert = fns[var][0](q, k, v)
      row["certificate"] = cert.summary()
      if var == "dense":
        row["max_abs_diff_vs_jax_nn"] = float(jnp.max(jnp.abs(out - ref_out)))
    rows[var] = row
  return dict(
    workload=name,
    shape=list(q.shape),
    kv_len=seq,
    causal=causal,
    load_before=load_before,
    load_after=list(os.getloadavg()),
    variants=rows,
  )


def run_prefill(config):
  c = config.prefill
  key = jax.random.key(config.seed)
  t, h, d = c.seq, c.heads, c.head_dim
  scale = 1.0 / math.sqrt(d)
  out = []
  jitted = {}
  for name in c.workloads:
    mask, causal, sc = None, True, scale
    if name == "flat":
      qkv = flat_workload(key, t, h, d)
    elif name == "topic":
      qkv = topic_workload(config.seed, t, h, d, c.topic_len)
    elif name == "local_sinks":
      qkv = local_sinks_workload(config.seed, t, h, d, c.window, c.sinks)
    elif name == "minilm":
      qkv, mask, sc = minilm_workload(c.minilm_len)
      causal = False
    else:
      raise ValueError(
        f"prefill workload {name=} must be one of flat, topic, local_sinks,"
        " minilm"
      )
    out.append(
      time_prefill(
        name, qkv, mask, causal, sc, config.eps, config.repeats, jitted
      )
    )
  return out


# ---------------------------------------------------------------------------
# Memory part: one prefill in a fresh subprocess, peak RSS.

_MEMORY_SCRIPT = """
import json, resource, sys, time
import jax, jaxtopk
seq, heads, head_dim, eps, search = json.loads(sys.argv[1])
ks = jax.random.split(jax.random.key(0), 3)
q, k, v = [jax.random.normal(x, (1, seq, heads, head_dim)) for x in ks]
policy = jaxtopk.Certified(eps, search=search)
f = jax.jit(lambda q, k, v: jaxtopk.topk_attention(
    q, k, v, policy=policy, is_causal=True))
t0 = time.perf_counter()
out, cert = jax.block_until_ready(f(q, k, v))
dt = time.perf_counter() - t0
print(json.dumps(dict(
    seconds_with_compile=dt,
    peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    certificate=cert.summary())))
"""


def run_memory(config):
  c = config.memory
  rows = []
  env = dict(os.environ, PYTHONPATH=str(REPO))
  for seq in c.seq:
    for search in c.searches:
      arg = json.dumps([seq, c.heads, c.head_dim, config.eps, search])
      res = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, arg],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        check=True,
      )
      r = json.loads(res.stdout.strip().splitlines()[-1])
      rows.append(
        dict(
          seq=seq,
          heads=c.heads,
          head_dim=c.head_dim,
          search=search,
          load=list(os.getloadavg()),
          **r,
        )
      )
  return rows


# ---------------------------------------------------------------------------
# Flax part.


def run_flax(config):
  c = config.flax
  x = jax.random.normal(
    jax.random.key(config.seed), (c.batch, c.seq, c.features)
  )
  kwargs = dict(num_heads=c.heads, in_features=c.features, decode=False)
  ref = nnx.MultiHeadAttention(rngs=nnx.Rngs(0), **kwargs)
  layers = {"nnx_multi_head_attention": ref}
  for name, policy in (
    ("topk_dense", jaxtopk.Dense()),
    ("topk_certified", jaxtopk.Certified(config.eps)),
    (
      "topk_certified_dense_above",
      jaxtopk.Certified(config.eps, dense_above=config.flax.dense_above),
    ),
  ):
    layer = topk_nn.CertifiedTopKAttention(
      policy=policy, rngs=nnx.Rngs(1), **kwargs
    )
    nnx.update(layer, nnx.state(ref, nnx.Param))
    layers[name] = layer

  @nnx.jit
  def forward(layer, x):
    return layer(x, is_causal=True)

  @nnx.jit
  def train_step(layer, x):
    def loss(layer):
      return jnp.mean(layer(x, is_causal=True) ** 2)

    return nnx.value_and_grad(loss)(layer)

  fwd = {n: (forward, (m, x)) for n, m in layers.items()}
  stp = {n: (train_step, (m, x)) for n, m in layers.items()}
  load_before = list(os.getloadavg())
  # The first call of each (trace, compile, run): what a user waits for
  # before the first step. Both phases of every layer, before any timing.
  first = {}
  for phase, variants in (("forward", fwd), ("train_step", stp)):
    for n, (fn, args) in variants.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      first[phase, n] = time.perf_counter() - t0
  t_fwd = _common.time_round_robin(fwd, repeats=config.repeats)
  t_stp = _common.time_round_robin(stp, repeats=config.repeats)
  ref_name = "nnx_multi_head_attention"
  rows = dict(
    batch=c.batch,
    seq=c.seq,
    heads=c.heads,
    features=c.features,
    load_before=load_before,
    load_after=list(os.getloadavg()),
    forward={},
    train_step={},
  )
  for phase, times in (("forward", t_fwd), ("train_step", t_stp)):
    base = times[ref_name]["min_ms"]
    for n, t in times.items():
      rows[phase][n] = dict(
        t,
        ratio_vs_mha=t["min_ms"] / base,
        first_call_s=first[phase, n],
        first_call_ratio_vs_mha=first[phase, n] / first[phase, ref_name],
      )
  out_ref = forward(ref, x)
  for n in ("topk_dense", "topk_certified", "topk_certified_dense_above"):
    out = forward(layers[n], x)
    rows["forward"][n]["max_abs_diff_vs_mha"] = float(
      jnp.max(jnp.abs(out - out_ref))
    )
    rows["forward"][n]["certificate"] = (
      layers[n].last_certificate.get_value().summary()
    )
  return rows


# ---------------------------------------------------------------------------


def run(config, workdir, *, overwrite: bool = False) -> dict:
  """Runs the configured parts; writes results.json, metrics, figure."""
  wd = _common.Workdir(workdir, config, overwrite=overwrite)
  record = dict(meta=_common.machine_info())
  t0 = time.perf_counter()
  for part in config.parts:
    if part == "prefill":
      record["prefill"] = run_prefill(config)
      for r in record["prefill"]:
        for var, row in r["variants"].items():
          wd.metrics.write(
            "prefill",
            workload=r["workload"],
            variant=var,
            min_ms=row["min_ms"],
            median_ms=row["median_ms"],
            ratio_vs_jax_nn=row["ratio_vs_jax_nn"],
          )
    elif part == "memory":
      record["memory"] = run_memory(config)
      for r in record["memory"]:
        wd.metrics.write(
          "memory",
          seq=r["seq"],
          search=r["search"],
          peak_rss_gib=r["peak_rss_gib"],
          seconds_with_compile=r["seconds_with_compile"],
        )
    elif part == "flax":
      record["flax"] = run_flax(config)
      for phase in ("forward", "train_step"):
        for n, row in record["flax"][phase].items():
          wd.metrics.write(
            "flax",
            phase=phase,
            layer=n,
            min_ms=row["min_ms"],
            median_ms=row["median_ms"],
            ratio_vs_mha=row["ratio_vs_mha"],
            first_call_s=row["first_call_s"],
          )
    else:
      raise ValueError(f"part {part=} must be prefill, memory or flax")
  record["seconds"] = time.perf_counter() - t0
  record["meta"]["load_average_after"] = list(os.getloadavg())
  wd.write_json("results.json", record)
  groups = {}
  for r in record.get("prefill", []):
    groups[r["workload"]] = {
      v: row["ratio_vs_jax_nn"] for v, row in r["variants"].items()
    }
  if "flax" in record:
    for phase in ("forward", "train_step"):
      groups[f"flax_{phase}"] = {
        n: row["ratio_vs_mha"] for n, row in record["flax"][phase].items()
      }
      groups[f"flax_{phase}_first_call"] = {
        n: row["first_call_ratio_vs_mha"]
        for n, row in record["flax"][phase].items()
      }
  _common.bar_figure(
    wd.path,
    "ratios",
    groups or {"none": {}},
    ylabel="time / reference (min)",
    title="prefill vs jax.nn.dot_product_attention; flax vs nnx MHA",
    log=True,
  )
  lines = []
  for r in record.get("prefill", []):
    for var, row in r["variants"].items():
      lines.append(
        dict(
          part="prefill",
          case=r["workload"],
          variant=var,
          min_ms=row["min_ms"],
          ratio=row["ratio_vs_jax_nn"],
        )
      )
  for phase in ("forward", "train_step"):
    for n, row in record.get("flax", {}).get(phase, {}).items():
      lines.append(
        dict(
          part="flax",
          case=phase,
          variant=n,
          min_ms=row["min_ms"],
          ratio=row["ratio_vs_mha"],
        )
      )
  for r in record.get("memory", []):
    lines.append(
      dict(
        part="memory",
        case=f"seq {r['seq']}",
        variant=r["search"],
        min_ms=1e3 * r["seconds_with_compile"],
        ratio=r["peak_rss_gib"],
      )
    )
  wd.write_summary(
    _common.format_table(lines, ("part", "case", "variant", "min_ms", "ratio"))
    + "\n(memory rows: min_ms = seconds with compile x 1e3, ratio = peak"
    " RSS GiB)\n"
  )
  return record


if __name__ == "__main__":
  _common.app_main(NAME, run)
