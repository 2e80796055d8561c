r"""Config for experiments/bound_tightness.py (THEORY 3.1-3.3).

  python -m experiments.bound_tightness --workdir=workdirs/bound_tightness
Smoke run (seconds):
  python -m experiments.bound_tightness \
    --config=experiments/configs/bound_tightness.py:smoke \
    --workdir=/tmp/bound_tightness_smoke --overwrite
"""

import ml_collections


def get_config(arg=None):
  """Default config; ``arg='smoke'`` gives a variant that runs in seconds."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # PRNG seed: jax.random.key(seed) drives every draw.
  # Kept fraction rho: topk = ceil(rho * n) keys kept (the exact Top-k set
  # for the logit bounds, the Top-k of the scored keys for blockwise).
  c.rhos = (0.01, 0.05, 0.2)
  # Blockwise bound (3.3): key blocks of block_size; blocks are scored in
  # descending order of their upper bound until the scored keys number at
  # least scored_factor * topk.
  c.block_size = 64  # Keys per block on synthetic rows.
  c.minilm_block_size = 16  # Keys per block on MiniLM rows (n <= max_len).
  c.scored_factor = 4.0

  # Synthetic rows: Gaussian q, k (logit std ~ sigma), n keys, head_dim d.
  c.synthetic = s = ml_collections.ConfigDict()
  s.enabled = True  # Run on synthetic rows.
  s.sigmas = (1.0, 2.0, 3.0)  # Logit spreads.
  s.n = 4096  # Keys per row.
  s.head_dim = 64  # Query/key dimension d.
  s.groups = 8  # Independent key sets per sigma.
  s.queries = 16  # Query rows per key set.

  # Real rows: all-MiniLM-L6-v2, every layer and head, on real text.
  c.minilm = m = ml_collections.ConfigDict()
  m.enabled = True  # Run on MiniLM rows.
  m.num_passages = 4  # Real-text passages.
  m.max_len = 128  # Tokens per passage.

  if arg == "smoke":
    c.rhos = (0.05,)
    c.block_size = 16
    s.sigmas = (2.0,)
    s.n = 256
    s.groups = 2
    s.queries = 3
    m.num_passages = 1
    m.max_len = 32
    c.minilm_block_size = 8
  elif arg not in (None, ""):
    raise ValueError(f"{arg=} must be None, '' or 'smoke'.")
  return c
