"""Config of experiments/bench_scaling.py: communication of sharded decode.

Launch (8 simulated CPU devices, compile only, a few minutes):

  python -m experiments.bench_scaling \
    --config=experiments/configs/bench_scaling.py --workdir=/tmp/scaling

Smoke (seconds): ``--config=experiments/configs/bench_scaling.py:smoke``;
``:count`` reruns the count policies only.
"""

import ml_collections


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # CPU devices to simulate when the backend is CPU (ignored on TPU/GPU).
  c.simulated_devices = 8
  # Key/value lengths n of the decode step (one query per row).
  c.n_values = [4096, 16384, 65536, 262144, 1048576]
  # Meshes to compare (the --mesh flag, when given, replaces this list).
  c.meshes = ["kv=1", "kv=2", "kv=4", "kv=8", "data=2,kv=4"]
  # Policies: name -> constructor string evaluated against jaxtopk.
  c.policies = {
    "fixedk_1024": "FixedK(1024)",
    "ratio_1_64": "Ratio(1 / 64)",
    "certified_1pct": "Certified(0.01)",
  }
  c.batch = 2  # decode batch
  c.heads = 8  # attention heads
  c.head_dim = 128  # query/key head dim (= value dim)
  c.q_len = 1  # queries per row (1 = a decode step)
  c.dtype = "bfloat16"  # q, k, v dtype (math runs in float32)
  c.execute_max_n = 4096  # also RUN (not only compile) up to this n
  if arg == "smoke":
    c.n_values = [1024]
    c.meshes = ["kv=1", "data=2,kv=4"]
    c.policies = {"certified_1pct": "Certified(0.01)"}
    c.execute_max_n = 1024
  elif arg == "count":  # count policies only (after the radix exchange)
    c.n_values = [4096, 65536, 1048576]
    c.meshes = ["kv=2", "kv=4", "kv=8"]
    c.policies = {"fixedk_1024": "FixedK(1024)", "ratio_1_64": "Ratio(1 / 64)"}
  elif arg:
    raise ValueError(
      f"unknown config variant {arg=}; use '', 'smoke' or 'count'"
    )
  return c
