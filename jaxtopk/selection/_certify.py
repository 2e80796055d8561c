"""Old names of the certificate math, now thin aliases of ``core``.

The math lives in ``jaxtopk.selection.core`` (one place). These names stay
only until the prefill, decode, kernel and sharded paths switch to it.
"""

# TODO(core): callers switch to jaxtopk.selection.core; then delete this file.

import jax.numpy as jnp

from jaxtopk.selection import core
from jaxtopk.selection._certificate import Certificate

value_norms = core.value_norms
max_norm = core.max_norm
output_error_bound = core.output_error_bound


def logit_rounding(abs_dot, head_dim, dtype):
  """``core.logit_error_bound`` from a scaled abs-dot bound only.

  Does not cover subnormal inputs (no norms are given): callers switch to
  ``core.logit_error_bound`` with norms and flush flags.
  """
  del dtype
  return core.logit_error_bound(
    abs_dot=abs_dot, head_dim=int(head_dim), scale=1.0
  )


def finish_certificate(
  log_tv,
  ok,
  *,
  k_kept,
  keys_scored,
  head_max_norm=None,
  tail_max_norm=None,
  failure_prob=0.0,
) -> Certificate:
  """``core.finish_certificate``; a NaN value norm makes the row invalid."""
  if head_max_norm is not None:
    ok = ok & ~(jnp.isnan(head_max_norm) | jnp.isnan(tail_max_norm))
  return core.finish_certificate(
    log_tv,
    ok,
    k_kept=k_kept,
    keys_scored=keys_scored,
    head_norm=head_max_norm,
    tail_norm=tail_max_norm,
    failure_prob=failure_prob,
  )
