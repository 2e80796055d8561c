"""Config of experiments/bench_serving.py (decode over a paged, ragged batch).

Launch (default; a few minutes on the 2-core CPU):

  python -m experiments.bench_serving \
    --config=experiments/configs/bench_serving.py --workdir=/tmp/bench_serving

Smoke (seconds; what the CI test runs): append ``:smoke`` to the config.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Default config, or the ``smoke`` variant when ``arg == 'smoke'``."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # seed of the synthetic caches (jax.random.key)
  c.lengths = (4096, 8192, 12288, 16384, 20480, 24576, 28672, 32768)
  c.heads = 8  # query heads
  c.kv_heads = 2  # key/value heads (GQA 4)
  c.head_dim = 128
  c.page_size = 64  # positions per page (= the certified search's block)
  c.chunk = 2048  # prefill chunk appended per call (ragged num_steps)
  c.eps = 0.05  # Certified(eps)
  c.workloads = ("flat", "topic")  # synthetic caches (module docstring)
  c.repeats = 5  # timed calls per variant (round-robin, after 2 warm-ups)
  if arg == "smoke":
    c.lengths = (96, 200, 64)
    c.heads = 4
    c.kv_heads = 2
    c.head_dim = 8
    c.page_size = 16
    c.chunk = 64
    c.workloads = ("topic",)
    c.repeats = 1
  elif arg:
    raise ValueError(f"unknown config variant {arg=}; use '' or 'smoke'")
  return c
