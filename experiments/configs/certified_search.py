r"""Config for experiments/certified_search.py (THEORY 6).

  python -m experiments.certified_search --workdir=workdirs/certified_search
Smoke run (seconds):
  python -m experiments.certified_search \
    --config=experiments/configs/certified_search.py:smoke \
    --workdir=/tmp/certified_search_smoke --overwrite
"""

import ml_collections


def get_config(arg=None):
  """Default config; ``arg='smoke'`` gives a variant that runs in seconds."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # PRNG seed: synthetic draws and MC-Search samples.
  c.epss = (0.01, 0.05, 0.1, 0.2)  # TV budgets eps of Certified(eps, ...).
  c.searches = ("exact", "delta", "mc")  # Certified search methods.
  c.delta = 0.01  # MC-Search failure probability (THEORY 6.3).
  c.num_samples = 8  # MC-Search keys sampled per unscored block.

  # Synthetic rows: Gaussian q, k (logit std ~ sigma), n keys.
  c.synthetic = s = ml_collections.ConfigDict()
  s.enabled = True  # Run on synthetic rows.
  s.sigmas = (2.0, 3.0, 4.0)  # Logit spreads.
  s.n = 4096  # Keys per row.
  s.head_dim = 64  # Query/key dimension.
  s.groups = 4  # Independent key sets per sigma.
  s.queries = 16  # Query rows per key set.
  s.block_size = 64  # Keys per block of the search.
  # Also run on keys clustered by block: k = sigma (c_b + spread z) /
  # sqrt(1 + spread^2) with a per-block centre c_b; 0 turns this source off.
  s.cluster_spread = 0.1

  # Real rows: all-MiniLM-L6-v2, every layer and head, on real text.
  c.minilm = m = ml_collections.ConfigDict()
  m.enabled = True  # Run on MiniLM rows.
  m.num_passages = 2  # Real-text passages.
  m.max_len = 256  # Tokens per passage.
  m.block_size = 16  # Keys per block of the search.

  if arg == "smoke":
    c.epss = (0.1,)
    s.sigmas = (3.0,)
    # The synthetic rows take the MiniLM rows' shape (a chunk of 8 heads x
    # 32 queries over 32 keys of 32 dims, blocks of 8): every source runs
    # the same compiled search, one program per search.
    s.n = 32
    s.head_dim = 32
    s.groups = 8
    s.queries = 32
    s.block_size = 8
    m.num_passages = 1
    m.max_len = 32
    m.block_size = 8
  elif arg not in (None, ""):
    raise ValueError(f"{arg=} must be None, '' or 'smoke'.")
  return c
