r"""Config for experiments/output_error.py (THEORY 4).

  python -m experiments.output_error --workdir=workdirs/output_error
Smoke run (seconds):
  python -m experiments.output_error \
    --config=experiments/configs/output_error.py:smoke \
    --workdir=/tmp/output_error_smoke --overwrite
"""

import ml_collections


def get_config(arg=None):
  """Default config; ``arg='smoke'`` gives a variant that runs in seconds."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # Seed for the rows drawn into the figure.
  # Kept sets: the exact Top-k with topk = ceil(rho * n) for each rho.
  c.rhos = (0.05, 0.1, 0.25, 0.5)
  # Rows (per rho) drawn into the bound-vs-real-error scatter.
  c.scatter_points = 3000

  # Real rows: all-MiniLM-L6-v2, every layer and head, on real text.
  c.minilm = m = ml_collections.ConfigDict()
  m.num_passages = 8  # Real-text passages.
  m.max_len = 128  # Tokens per passage.

  if arg == "smoke":
    c.rhos = (0.1, 0.5)
    c.scatter_points = 300
    m.num_passages = 1
    m.max_len = 32
  elif arg not in (None, ""):
    raise ValueError(f"{arg=} must be None, '' or 'smoke'.")
  return c
