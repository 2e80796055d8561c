"""Benchmark: CertifiedTopKAttention against nnx.MultiHeadAttention.

Same parameters, same inputs, jitted with ``nnx.jit``; layout [batch, seq,
features] at the layer boundary for both (the layer's own API). Times:

- ``prefill``: a causal self-attention forward over ``seq`` tokens, for
  nnx.MultiHeadAttention (jax.nn dot-product attention) and for the Top-k
  layer with Dense(), FixedK(seq // 16) and Certified(eps).
- ``decode``: one decode step with a cache filled to ``seq`` positions, for
  nnx.MultiHeadAttention (its [batch, len, heads, dim] cache) and the Top-k
  layer (jaxtopk.KVCache, head-major, decode_attention).

Each figure is the median and min of ``--repeats`` runs after one warm-up
(compile) run; the machine is shared, so the min is the cleaner figure. The
decode timings include restoring the filled cache (``nnx.update``, outside
jit) before each step, for both layers. The record also carries the
certificate summary of the timed Top-k runs and the command line. Writes one
``results.json`` (with the machine and load), ``metrics.jsonl`` and
``timings.png`` in the workdir.

Launch (experiments/README.md; ``:smoke`` for a run of seconds):
  python -m experiments.bench_flax_layers \
    --config=experiments/configs/bench_flax_layers.py --workdir=/tmp/bfl
"""

import os
import platform

import jax
import jax.numpy as jnp
from flax import nnx

import jaxtopk
from experiments import _common
from jaxtopk import nn as topk_nn

NAME = "bench_flax_layers"


@nnx.jit
def _forward(layer, x):
  return layer(x, is_causal=True)


@nnx.jit
def _step(layer, x):
  return layer(x, decode=True)


def _layers(policy, features, heads):
  kwargs = dict(num_heads=heads, in_features=features, decode=False)
  ref = nnx.MultiHeadAttention(rngs=nnx.Rngs(0), **kwargs)
  if policy is None:
    return ref
  layer = topk_nn.CertifiedTopKAttention(
    policy=policy, rngs=nnx.Rngs(1), **kwargs
  )
  nnx.update(layer, nnx.state(ref, nnx.Param))
  return layer


def _policies(seq):
  """Layer name -> (record key, policy); None is nnx.MultiHeadAttention."""
  topk = max(1, seq // 16)
  return {
    "nnx_multi_head_attention": ("nnx_multi_head_attention", None),
    "topk_dense": ("topk_dense", jaxtopk.Dense()),
    "topk_fixed_k": (f"topk_fixed_k_{topk}", jaxtopk.FixedK(topk)),
    "topk_certified": ("topk_certified_0.05", jaxtopk.Certified(0.05)),
  }


def measure(batch, seq, heads, head_dim, repeats, only=None) -> dict:
  """Times the layers and returns the record.

  Args:
    batch: sequences per call.
    seq: tokens in the prefill forward, and cache length for decode.
    heads: query heads (no GQA: key/value heads = heads).
    head_dim: features per head; the layer has heads * head_dim features.
    repeats: timed runs after one warm-up run.
    only: names of the layers to time (keys of ``_policies``), all if None.

  Returns:
    A JSON-serialisable dict: config, machine, and per phase
    (``prefill``, ``decode``) and layer the timings (first_s, median_s,
    min_s, repeats) and, for Top-k layers, the certificate summary.
  """
  features = heads * head_dim
  x = jax.random.normal(jax.random.key(0), (batch, seq, features))
  table = _policies(seq)
  only = list(table) if only is None else list(only)
  for name in only:
    if name not in table:
      raise ValueError(f"{name=} must be one of {sorted(table)}")
  policies = dict(table[name] for name in only)
  record = dict(
    batch=batch,
    seq=seq,
    heads=heads,
    head_dim=head_dim,
    layout="[batch, seq, features] in and out (layer API)",
    jax=jax.__version__,
    backend=jax.default_backend(),
    machine=platform.platform(),
    cpu_count=os.cpu_count(),
    prefill={},
    decode={},
  )
  for name, policy in policies.items():
    layer = _layers(policy, features, heads)
    timing = _common.time_call(lambda layer=layer: _forward(layer, x), repeats)
    if policy is not None:
      timing["certificate"] = layer.last_certificate.get_value().summary()
    record["prefill"][name] = timing

    # Decode: write the first seq - 1 tokens' keys/values into the cache,
    # then time the step at position seq - 1 (cache restored before each).
    fill = _fill_cache(layer, x, seq - 1)
    # A copy: nnx.state holds the layer's own variables, which each step
    # updates (without it every repeat after the first steps past the cache).
    state = jax.tree.map(jnp.copy, nnx.state(layer, nnx.Cache))

    def one_step(layer=layer, state=state):
      nnx.update(layer, state)
      return _step(layer, x[:, seq - 1 : seq])

    timing = _common.time_call(one_step, repeats)
    timing["cache_filled_to"] = fill
    if policy is not None:
      timing["certificate"] = layer.last_certificate.get_value().summary()
    record["decode"][name] = timing
  return record


def _fill_cache(layer, x, length):
  """Writes the keys/values of the first ``length`` tokens into the cache."""
  key = layer.key(x[:, :length])  # [b, length, kv_heads, head_dim]
  value = layer.value(x[:, :length])
  if isinstance(layer, topk_nn.CertifiedTopKAttention):
    layer.init_cache(x.shape)
    cache = layer.kv_cache.get_value()
    layer.kv_cache.set_value(cache.append(key, value))
  else:
    layer.init_cache(x.shape)
    layer.cached_key[...] = layer.cached_key[...].at[:, :length].set(key)
    layer.cached_value[...] = layer.cached_value[...].at[:, :length].set(value)
    layer.cache_index[...] = jnp.asarray(length, jnp.int32)
  return length


def run(config, workdir, *, overwrite: bool = False) -> dict:
  """Times the configured layers; writes results.json, metrics, figure."""
  wd = _common.Workdir(workdir, config, overwrite=overwrite)
  record = measure(
    config.batch,
    config.seq,
    config.heads,
    config.head_dim,
    config.repeats,
    only=config.only,
  )
  record["meta"] = _common.machine_info()
  for phase in ("prefill", "decode"):
    for name, timing in record[phase].items():
      wd.metrics.write(phase, layer=name, **timing)
  wd.write_json("results.json", record)
  ref = "nnx_multi_head_attention"
  _common.bar_figure(
    wd.path,
    "timings",
    {
      phase: {name: t["min_s"] * 1e3 for name, t in record[phase].items()}
      for phase in ("prefill", "decode")
    },
    ylabel="ms (min)",
    title=f"seq {config.seq}, {config.heads} heads x {config.head_dim}"
    + (f" (vs {ref})" if ref in record["prefill"] else ""),
    log=True,
  )
  return record


if __name__ == "__main__":
  _common.app_main(NAME, run)
