"""Config of experiments/bench_append.py (one cache append in a Python loop).

Launch (default; a few minutes on the 2-core CPU):

  python -m experiments.bench_append \
    --config=experiments/configs/bench_append.py --workdir=/tmp/bench_append

Smoke (seconds; what the CI test runs): append ``:smoke`` to the config.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Default config, or the ``smoke`` variant when ``arg == 'smoke'``."""
  c = ml_collections.ConfigDict()
  c.sizes = (4096, 32768)  # capacities max_len (filled to half)
  c.heads = 8  # kv heads of the KVCache
  c.index_heads = 2  # kv heads of the IndexedKVCache (its build is k-means)
  c.head_dim = 128  # head dimension
  c.group_size = 64  # IndexedKVCache group capacity
  c.rounds = 3  # turns of each variant (after 2 warm-up calls)
  c.per_round = 10  # consecutive timed appends per turn
  if arg == "smoke":
    c.sizes = (256,)
    c.heads = 2
    c.index_heads = 1
    c.head_dim = 8
    c.group_size = 16
    c.rounds = 2
    c.per_round = 1
  elif arg:
    raise ValueError(f"unknown config variant {arg=}; use '' or 'smoke'")
  return c
