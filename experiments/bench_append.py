r"""Benchmark: one append to a decode cache in a plain Python loop.

``cache = cache.append(k, v)`` (``KVCache`` and ``IndexedKVCache``) donates
the cache, so XLA updates its buffers in place: a step should cost O(new
steps), flat in the capacity ``max_len``. The copying path it replaced (the
0.1 free functions ``kv_cache_update`` / ``kv_index_update``, here
``append(..., donate=False)``, the same update without donation) copies the
whole cache every step: O(max_len). Both are timed on the same cache shape,
taking turns by rounds of consecutive calls, one appended step per call:

- ``kv_append`` / ``kv_copy``: a ``KVCache`` (keys, values, block boxes,
  value norms, key codes) filled to half its capacity.
- ``paged_append`` / ``paged_copy``: a ``PagedKVCache`` (pages of 64) of
  one sequence, its pool ``max_len / 64`` pages, filled to half (each step
  also looks for a free page: O(pages)).
- ``index_append`` / ``index_copy``: an ``IndexedKVCache`` built on half
  its capacity (each step also searches the nearest of ~``max_len / 32``
  groups: O(groups) work, which grows with max_len, unlike a copy).

Besides the times, ``results.json`` records XLA's own memory analysis of
each compiled append (``jax.stages``: bytes of the cache aliased to the
output, i.e. updated in place, and temporary bytes), which says whether the
donation took effect without any timing. ``metrics.jsonl`` holds one row
per (cache, max_len); ``append_ms.png`` the min times.

Usage (experiments/README.md):
  python -m experiments.bench_append \
    --config=experiments/configs/bench_append.py --workdir=/tmp/bench_append
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxtopk
from experiments import _common
from jaxtopk.attention import _cache
from jaxtopk.attention import _index
from jaxtopk.attention import _paged

NAME = "bench_append"
CACHES = ("kv", "index", "paged")


def _memory(cache, keys, values, donate):
  """XLA's memory analysis of the compiled append (bytes)."""
  if isinstance(cache, jaxtopk.KVCache):
    fn = _cache._append if donate else _cache._update
  elif isinstance(cache, jaxtopk.PagedKVCache):
    fn = _paged._append if donate else _paged._update
  else:
    fn = _index._index_append if donate else _index._index_update
  steps = jnp.ones((keys.shape[0],), jnp.int32)
  m = fn.lower(cache, keys, values, steps).compile().memory_analysis()
  return dict(
    cache_bytes=int(sum(x.nbytes for x in jax.tree.leaves(cache))),
    alias_bytes=int(m.alias_size_in_bytes),
    temp_bytes=int(m.temp_size_in_bytes),
  )


def _time_steps(steppers, rounds, per_round):
  """Each stepper appends one step per call, timed call by call.

  Variants take turns by rounds of ``per_round`` consecutive calls (so load
  spikes hit all alike, while the copying variant's traffic does not sit
  between two calls of the donated one); min and median over all calls.
  """
  for step in steppers.values():  # compile and warm up
    step()
    step()
  ts = {name: [] for name in steppers}
  for _ in range(rounds):
    for name, step in steppers.items():
      for _ in range(per_round):
        t0 = time.perf_counter()
        step()
        ts[name].append(time.perf_counter() - t0)
  return {
    name: dict(min_ms=1e3 * min(t), median_ms=1e3 * float(np.median(t)))
    for name, t in ts.items()
  }


def _stepper(cache, keys, values, donate):
  """A zero-argument function appending the next step to its own cache."""
  state = dict(cache=cache, t=0)

  def step():
    t = state["t"] % keys.shape[1]
    new = state["cache"].append(
      keys[:, t : t + 1], values[:, t : t + 1], donate=donate
    )
    jax.block_until_ready(new)
    state["cache"], state["t"] = new, state["t"] + 1

  return step, state


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def bench(kind, max_len, config):
  """Times the donated and the copying append at one capacity."""
  heads = config.index_heads if kind == "index" else config.heads
  d = config.head_dim
  # Drawn in numpy: a jax.random draw compiles a program per shape.
  rng = np.random.default_rng(0)

  def normal(*shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)

  fill = max_len // 2
  prefix = (normal(1, fill, heads, d),) * 2
  new = normal(2, 1, 64, heads, d)  # steps to append
  new_k, new_v = new[0], new[1]
  if kind == "kv":
    cache = jaxtopk.KVCache.create(1, max_len, heads, d, block_size=64)
    cache = cache.append(*prefix)
  elif kind == "paged":  # one sequence's pages in a pool of that many
    pages = -(-max_len // 64)
    cache = jaxtopk.PagedKVCache.create(
      1, pages, 64, heads, d, max_pages_per_seq=pages
    )
    cache = cache.append(*prefix)
  else:
    cache = jaxtopk.IndexedKVCache.build(
      *prefix, max_len=max_len, group_size=config.group_size
    )
  res = dict(cache=kind, max_len=max_len, heads=heads, head_dim=d, fill=fill)
  for donate in (True, False):
    mem = _memory(cache, new_k[:, :1], new_v[:, :1], donate)
    res.update(
      {f"{k}_{'append' if donate else 'copy'}": v for k, v in mem.items()}
    )
  steppers, states = {}, {}
  for name, donate in ((f"{kind}_append", True), (f"{kind}_copy", False)):
    steppers[name], states[name] = _stepper(_copy(cache), new_k, new_v, donate)
  del cache
  res.update(_time_steps(steppers, config.rounds, config.per_round))
  a, c = (states[f"{kind}_{s}"]["cache"] for s in ("append", "copy"))
  res["same_result"] = all(
    bool(jnp.array_equal(x, y, equal_nan=True))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(c), strict=True)
  )
  res["length_after"] = int(a.length[0])
  for stat in ("min_ms", "median_ms"):
    res[f"copy_over_append_{stat[:-3]}"] = (
      res[f"{kind}_copy"][stat] / res[f"{kind}_append"][stat]
    )
  return res


def run(config, workdir, *, overwrite: bool = False) -> dict:
  """Times both appends of both caches at each ``config.sizes``."""
  wd = _common.Workdir(workdir, config, overwrite=overwrite)
  meta = _common.machine_info()
  results = []
  progress = _common.Progress(NAME, len(config.sizes) * len(CACHES))
  for kind in CACHES:
    for n in config.sizes:
      r = bench(kind, int(n), config)
      wd.metrics.write("append", **r)
      results.append(r)
      progress.update(note=f"{kind} max_len={n}")
  meta.update(
    load_average_after=list(os.getloadavg()),
    timing=(
      "one appended step per call in a Python loop, 2 warm-up calls,"
      " donated and copying appends in turns of config.per_round calls,"
      " config.rounds turns; min and median over the calls"
    ),
  )
  record = dict(meta=meta, results=results)
  wd.write_json("results.json", record)
  _common.bar_figure(
    wd.path,
    "append_ms",
    {
      f"{r['cache']} n={r['max_len']}": {
        "append (donated)": r[f"{r['cache']}_append"]["min_ms"],
        "copying (0.1 path)": r[f"{r['cache']}_copy"]["min_ms"],
      }
      for r in results
    },
    ylabel="ms per appended step (min)",
    title="One append in a Python loop, by capacity max_len",
    log=True,
  )
  rows = [
    {
      "cache": r["cache"],
      "max_len": r["max_len"],
      "append_ms": r[f"{r['cache']}_append"]["min_ms"],
      "copy_ms": r[f"{r['cache']}_copy"]["min_ms"],
      "copy/append": r["copy_over_append_min"],
      "aliased": r["alias_bytes_append"] / r["cache_bytes_append"],
    }
    for r in results
  ]
  wd.write_summary(
    _common.format_table(
      rows,
      ["cache", "max_len", "append_ms", "copy_ms", "copy/append", "aliased"],
    )
  )
  return record


if __name__ == "__main__":
  _common.app_main(NAME, run)
