"""Config of experiments/bench_decode.py (one Top-k decode step vs baselines).

Launch (default; a few minutes on the 2-core CPU):

  python -m experiments.bench_decode \
    --config=experiments/configs/bench_decode.py --workdir=/tmp/bench_decode

Smoke (seconds; what the CI test runs): append ``:smoke`` to the config.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Default config, or the ``smoke`` variant when ``arg == 'smoke'``."""
  c = ml_collections.ConfigDict()
  c.sizes = (16384, 65536, 131072)  # cached keys n of the decode step
  c.heads = 8  # heads (= kv heads)
  c.head_dim = 128  # head dimension
  c.rho = 1 / 64  # kept fraction of jaxtopk.Ratio and of lax.top_k
  c.repeats = 15  # timed calls per variant (round-robin, after 2 warm-ups)
  c.q_len = 4  # query steps of the multi-query variants (*_q4)
  if arg == "smoke":
    # Under jaxtopk's AUTO_MIN_KEYS (1,024) Certified(eps) takes the exact
    # search: a smaller program (Auto's key-code path runs in bound_study's
    # smoke, at 1,024 keys).
    c.sizes = (512,)
    c.heads = 2
    c.head_dim = 8
    c.repeats = 1
  elif arg:
    raise ValueError(f"unknown config variant {arg=}; use '' or 'smoke'")
  return c
