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
  c.parts = ("paged", "chunk", "generate")  # parts of the benchmark to run
  c.seed = 0  # seed of the synthetic caches and the model (jax.random.key)
  c.lengths = (4096, 8192, 12288, 16384, 20480, 24576, 28672, 32768)
  c.heads = 8  # query heads
  c.kv_heads = 2  # key/value heads (GQA 4)
  c.head_dim = 128
  c.page_size = 64  # positions per page (= the certified search's block)
  c.chunk = 2048  # prefill chunk appended per call (ragged num_steps)
  c.eps = 0.05  # Certified(eps)
  c.workloads = ("flat", "topic")  # synthetic caches (module docstring)
  c.repeats = 5  # timed calls per variant (round-robin, after 2 warm-ups)
  # chunk: one chunk of c.chunk query steps at the end of a cache this long.
  c.chunk_keys = 32768
  c.chunk_repeats = 3
  # generate: jaxtopk.models.serve on a random TopKDecoder, dense vs
  # Certified(eps), prompts of random lengths in [min, max].
  c.generate = ml_collections.ConfigDict()
  c.generate.requests = 8
  c.generate.prompt_min = 128
  c.generate.prompt_max = 1024
  c.generate.max_new_tokens = 32
  c.generate.batch = 4
  c.generate.chunk = 128
  c.generate.num_layers = 4
  c.generate.num_heads = 8
  c.generate.num_kv_heads = 2
  c.generate.head_dim = 64
  c.generate.model_dim = 256
  c.generate.mlp_dim = 512
  c.generate.vocab_size = 1024
  if arg == "smoke":
    c.lengths = (96, 200, 64)
    c.heads = 4
    c.kv_heads = 2
    c.head_dim = 8
    c.page_size = 16
    c.chunk = 64
    c.chunk_keys = 256
    c.chunk_repeats = 1
    c.workloads = ("topic",)
    c.repeats = 1
    c.generate.requests = 3
    c.generate.prompt_min = 5
    c.generate.prompt_max = 40
    c.generate.max_new_tokens = 3
    c.generate.batch = 2
    c.generate.chunk = 16
    c.generate.num_layers = 1
    c.generate.num_heads = 2
    c.generate.num_kv_heads = 1
    c.generate.head_dim = 8
    c.generate.model_dim = 16
    c.generate.mlp_dim = 16
    c.generate.vocab_size = 32
  elif arg:
    raise ValueError(f"unknown config variant {arg=}; use '' or 'smoke'")
  return c
