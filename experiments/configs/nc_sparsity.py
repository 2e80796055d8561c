r"""Config for experiments/nc_sparsity.py (THEORY 7, [NC]).

  python -m experiments.nc_sparsity --workdir=workdirs/nc_sparsity
Smoke run (seconds):
  python -m experiments.nc_sparsity \
    --config=experiments/configs/nc_sparsity.py:smoke \
    --workdir=/tmp/nc_sparsity_smoke --overwrite
"""

import ml_collections


def get_config(arg=None):
  """Default config; ``arg='smoke'`` gives a variant that runs in seconds."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # PRNG seed: jax.random.key(seed) drives every draw.
  # Thresholds eps of the eps-effective entries |S_eps| = #{P_i >= eps}.
  c.effective_eps = (0.01, 0.001)

  # Synthetic setup of [NC]: inputs X [n, d_model] with iid N(0, 1) entries
  # clipped to [-B, B], one attention layer with random W_Q, W_K, W_V
  # [d_model, head_dim]; W_Q, W_K are rescaled at each n so the logit spread
  # is sigma(n) = sqrt(2 a ln n), i.e. R = B^2 ||W_Q W_K^T||_F grows with n
  # (THEORY 7.4-7.5).
  c.synthetic = s = ml_collections.ConfigDict()
  s.ns = (256, 1024, 4096, 16384)  # Sequence lengths n.
  s.growth = (0.3, 0.6)  # a in sigma(n) = sqrt(2 a ln n).
  s.d_model = 32  # Input dimension d.
  s.head_dim = 32  # Query/key/value dimension.
  s.input_bound = 3.0  # B: input entries are clipped to [-B, B].
  s.queries = 64  # Query rows per n (every row attends to all n keys).
  s.draws = 2  # Independent (X, W) draws per (a, n).
  # Dynamic windows topk = ceil(alpha * n^C) (jaxtopk.PowerLaw(alpha, C)).
  s.alpha = 1.0
  s.powers = (0.25, 0.5, 0.75)
  # The fixed window gets the SAME AVERAGE number of kept keys over the n
  # sweep as PowerLaw(alpha, equal_compute_power).
  s.equal_compute_power = 0.5
  # A window that is o(log n): topk = ceil(small_scale * sqrt(ln n)).
  s.small_scale = 1.0

  # MiniLM: |S_eps| and the ineffective fraction vs n (passage length), per
  # layer; R = B^2 ||W_Q^h W_K^h^T||_F per layer and head from real weights.
  c.minilm = m = ml_collections.ConfigDict()
  m.enabled = True  # Run the MiniLM part.
  m.max_lens = (32, 64, 128, 256)  # Passage lengths n (tokens).
  m.num_passages = 4  # Real-text passages per length.

  if arg == "smoke":
    s.ns = (128, 512)
    s.growth = (0.5,)
    s.queries = 8
    s.draws = 1
    s.powers = (0.5,)
    m.max_lens = (16, 32)
    m.num_passages = 1
  elif arg not in (None, ""):
    raise ValueError(f"{arg=} must be None, '' or 'smoke'.")
  return c
