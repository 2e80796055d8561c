"""Config of experiments/bench_selection.py (certified selection, search).

Launch (default; ~15 minutes on the 2-core CPU, most of it part 'delta'):

  python -m experiments.bench_selection \
    --config=experiments/configs/bench_selection.py --workdir=/tmp/bench_sel

One part only: ``--config.parts=exact`` (or ``topk``, ``delta``). Smoke
(seconds; what the CI test runs): append ``:smoke`` to the config.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Default config, or the ``smoke`` variant when ``arg == 'smoke'``."""
  c = ml_collections.ConfigDict()
  c.parts = ("exact", "topk", "delta")  # which parts to run
  # Part 'topk': the Top-k threshold (k = n / 64): few-pass radix vs
  # bit-by-bit radix vs lax.top_k vs sort (same sizes, rows, repeats).
  # Part 'exact': select(Certified(eps)) vs sort + cumsum, timed.
  c.sizes = (4096, 16384, 65536, 262144)  # row lengths n
  c.rows = 8  # rows per call
  c.repeats = 9  # timed calls per variant
  c.eps = 0.05  # budget of part 'exact'
  # Part 'delta': Delta-Search keys_scored / n.
  c.delta_epss = (0.01, 0.05, 0.1)  # budgets of part 'delta'
  c.minilm = True  # real MiniLM rows (else synthetic rows only)
  c.texts = 2  # MiniLM passages (real text)
  c.query_stride = 7  # every k-th real query of each layer, head, text
  c.block_size = 16  # Delta-Search block size on MiniLM rows
  c.synthetic_rows = 256  # synthetic rows per walk
  c.synthetic_keys = 2048  # keys per synthetic row
  c.synthetic_block_size = 64  # Delta-Search block size on synthetic rows
  c.walks = (0.3, 1.0)  # random-walk steps of the synthetic keys
  c.synthetic_ranks = (8,)  # low-rank bound ranks on synthetic rows
  if arg == "smoke":
    c.sizes = (2048,)
    c.rows = 3
    c.repeats = 1
    c.minilm = False
    c.synthetic_rows = 4
    c.synthetic_keys = 256
    c.delta_epss = (0.05,)
    c.walks = (1.0,)
  elif arg:
    raise ValueError(f"unknown config variant {arg=}; use '' or 'smoke'")
  return c
