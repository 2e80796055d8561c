"""Config of experiments/bench_flax_layers.py (CertifiedTopKAttention vs
nnx.MultiHeadAttention, prefill and one decode step).

Launch (default; a few minutes on the 2-core CPU):

  python -m experiments.bench_flax_layers \
    --config=experiments/configs/bench_flax_layers.py --workdir=/tmp/bfl

Smoke (seconds; what the CI test runs): append ``:smoke`` to the config.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Default config, or the ``smoke`` variant when ``arg == 'smoke'``."""
  c = ml_collections.ConfigDict()
  c.batch = 2  # sequences per call
  c.seq = 2048  # tokens (prefill) and cache length (decode)
  c.heads = 8  # query heads
  c.head_dim = 64  # features per head
  c.repeats = 5  # timed runs after one warm-up (compile) run
  # Layers to time: nnx_multi_head_attention, topk_dense, topk_fixed_k,
  # topk_certified (all four by default).
  c.only = (
    "nnx_multi_head_attention",
    "topk_dense",
    "topk_fixed_k",
    "topk_certified",
  )
  if arg == "smoke":
    c.batch = 1
    c.seq = 32
    c.heads = 2
    c.head_dim = 4
    c.repeats = 1
    c.only = ("nnx_multi_head_attention", "topk_fixed_k")
  elif arg:
    raise ValueError(f"unknown config variant {arg=}; use '' or 'smoke'")
  return c
