"""Config of experiments/bench_attention.py (prefill and Flax layer timings).

Launch (default; about ten minutes on the shared 2-core CPU):

  python -m experiments.bench_attention \
    --config=experiments/configs/bench_attention.py \
    --workdir=/tmp/bench_attention

Smoke (seconds; what the CI test runs): append ``:smoke`` to the config.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Default config, or the ``smoke`` variant when ``arg == 'smoke'``."""
  c = ml_collections.ConfigDict()
  c.parts = ("prefill", "memory", "flax")  # parts of the benchmark to run
  c.seed = 0  # seed of the synthetic workloads (jax.random.key / numpy)
  c.repeats = 3  # timed calls per variant (round-robin, after 2 warm-ups)
  c.eps = 0.05  # eps of the Certified policies
  # prefill: causal [1, seq, heads, head_dim] on synthetic workloads.
  c.prefill = ml_collections.ConfigDict()
  c.prefill.seq = 4096  # tokens
  c.prefill.heads = 4  # heads (= kv heads)
  c.prefill.head_dim = 64  # features per head
  c.prefill.topic_len = 128  # tokens per topic block (topic workload)
  c.prefill.window = 32  # local window width (local_sinks workload)
  c.prefill.sinks = 4  # attention sinks (local_sinks workload)
  # Workloads: flat, topic, local_sinks (synthetic), minilm (real rows).
  c.prefill.workloads = ("flat", "topic", "local_sinks", "minilm")
  c.prefill.minilm_len = 512  # tokens of the real MiniLM passage
  # memory: peak RSS of one Certified prefill in a fresh subprocess.
  c.memory = ml_collections.ConfigDict()
  c.memory.seq = (32768,)  # tokens, causal
  c.memory.heads = 2
  c.memory.head_dim = 64
  c.memory.searches = ("delta",)  # Certified(eps, search=...) to measure
  # flax: CertifiedTopKAttention against nnx.MultiHeadAttention.
  c.flax = ml_collections.ConfigDict()
  c.flax.batch = 1
  c.flax.seq = 1024
  c.flax.heads = 4
  c.flax.features = 256
  # Certified(eps, dense_above=...): rows keeping this fraction keep all.
  c.flax.dense_above = 0.5
  if arg == "smoke":
    c.repeats = 1
    c.prefill.seq = 64
    c.prefill.heads = 2
    c.prefill.head_dim = 8
    c.prefill.topic_len = 16
    c.prefill.window = 4
    c.prefill.sinks = 2
    c.prefill.workloads = ("topic", "local_sinks")
    c.memory.seq = (256,)
    c.memory.head_dim = 8
    c.flax.seq = 32
    c.flax.heads = 2
    c.flax.features = 16
  elif arg:
    raise ValueError(f"unknown config variant {arg=}; use '' or 'smoke'")
  return c
