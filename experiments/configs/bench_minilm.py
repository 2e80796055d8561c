"""Config of experiments/bench_minilm.py (the real MiniLM encoder, timed).

Launch (default; about a minute on the 2-core CPU):

  python -m experiments.bench_minilm \
    --config=experiments/configs/bench_minilm.py --workdir=/tmp/bench_minilm

Smoke (seconds; what the CI test runs): append ``:smoke`` to the config.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Default config, or the ``smoke`` variant when ``arg == 'smoke'``."""
  c = ml_collections.ConfigDict()
  c.batch = 8  # passages per forward pass
  c.max_len = 256  # tokens per passage (padded)
  c.repeats = 5  # timed runs after one warm-up (compile) run
  if arg == "smoke":
    c.batch = 2
    c.max_len = 11
    c.repeats = 1
  elif arg:
    raise ValueError(f"unknown config variant {arg=}; use '' or 'smoke'")
  return c
