"""Compile settings of the upstream attention tests: fast, and kept apart.

These tests compile many small programs once each (their time is almost all
XLA compile time), so they compile with most XLA optimizations off
(``jax_disable_most_optimizations``: about half the compile time; the
programs compute the same values). Their programs are cached under a jit
key of their own (``jax_optimization_level='O1'``), so that no other test
reuses a program compiled this way. Both settings are restored after each
test.
"""

import jax
import pytest


@pytest.fixture(autouse=True)
def _fast_compile():
  old = {
    "jax_disable_most_optimizations": jax.config.read(
      "jax_disable_most_optimizations"
    ),
    "jax_optimization_level": jax.config.jax_optimization_level,
  }
  jax.config.update("jax_disable_most_optimizations", True)
  jax.config.update("jax_optimization_level", "O1")
  try:
    yield
  finally:
    for name, value in old.items():
      jax.config.update(name, value)
