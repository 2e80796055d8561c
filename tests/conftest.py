"""Test-wide settings: a bounded hypothesis profile and CPU-only jax."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import HealthCheck  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests: bounded example counts, no deadline (jit compiles on first
# call), derandomized so CI runs are reproducible.
settings.register_profile(
  "ci",
  max_examples=60,
  deadline=None,
  derandomize=True,
  suppress_health_check=[HealthCheck.too_slow],
)
# Bug hunting (not CI): HYPOTHESIS_PROFILE=soak draws fresh random examples,
# many more of them, e.g. on the soundness tests (`-k sound`).
settings.register_profile(
  "soak",
  max_examples=500,
  deadline=None,
  derandomize=False,
  database=None,
  suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
