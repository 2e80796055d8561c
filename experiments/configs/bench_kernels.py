"""Config of experiments/bench_kernels.py (Pallas kernels vs dense, GPU/TPU).

Launch (on a GPU or TPU; on CPU the binary refuses to time interpret mode):

  python -m experiments.bench_kernels \
    --config=experiments/configs/bench_kernels.py --workdir=/tmp/bench_kernels

Smoke (seconds, any backend, correctness only, no timings): append
``:smoke`` to the config.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Default config, or the ``smoke`` variant when ``arg == 'smoke'``."""
  c = ml_collections.ConfigDict()
  c.smoke = False  # tiny correctness check only (no timings)
  c.lengths = (8192, 16384, 32768, 65536, 131072)  # context lengths n
  c.heads = 8  # query heads
  c.kv_heads = 8  # key/value heads (GQA if fewer)
  c.head_dim = 128  # head dimension
  c.eps = 0.01  # certified dropped-mass budget
  c.block = 128  # key block (and query tile)
  c.splits = 16  # split-K programs per head (decode kernel)
  c.repeats = 5  # timed runs after one warm-up (compile) run
  c.key_layout = "clustered"  # "clustered" (block centres) or "iid" keys
  c.prefill_max = 32768  # longest n for the prefill rows (q_len = n)
  if arg == "smoke":
    c.smoke = True
  elif arg:
    raise ValueError(f"unknown config variant {arg=}; use '' or 'smoke'")
  return c
