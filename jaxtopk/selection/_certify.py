"""Assembles a sound Certificate from logits and a kept set.

THEORY 2.1, 2.5, 3.4 (tail mass, rounded up) and 4.2/4.4 (output error from
a tail bound and value norms). Shared by ``select`` and every attention path.
"""

import jax
import jax.numpy as jnp
from jax.scipy.special import logsumexp

from jaxtopk.selection._certificate import Certificate
from jaxtopk.theory import _tail


def row_validity(logits, valid) -> jax.Array:
  """``[...]`` True where the row has a real key and all its logits finite."""
  finite = jnp.all(jnp.where(valid, jnp.isfinite(logits), True), axis=-1)
  return jnp.any(valid, axis=-1) & finite


def magnitude_slack(logits, valid) -> jax.Array:
  """``[...]`` log-space slack for the magnitude of the logits themselves.

  A float log-sum-exp is off by about eps * |lse| in absolute terms (the
  final m + log(sum) add, and the rounding of s_i - m), which ``log_slack``
  (relative to the count of terms) misses when logits are large, e.g. 1e4.
  8 eps max|s_i| covers both lse's of log tau = lse(s_T) - lse(s).
  """
  amax = jnp.max(jnp.where(valid, jnp.abs(logits), 0.0), axis=-1)
  amax = jnp.where(jnp.isfinite(amax), amax, 0.0)
  return 8 * jnp.finfo(logits.dtype).eps * amax


def logit_rounding(abs_dot, head_dim, dtype) -> jax.Array:
  """Bound on the rounding error of a logit scale * q.k computed in floats.

  A d-term dot product is off by at most (d + 2) eps sum_c |q_c k_c|; the
  caller passes ``abs_dot`` >= scale * max_i sum_c |q_c k_{i,c}| (e.g. from
  Cauchy-Schwarz, scale ||q|| max_i ||k_i||).
  """
  return (head_dim + 2) * jnp.finfo(dtype).eps * abs_dot


def value_norms(values) -> jax.Array:
  """``[..., n]`` ||v_j||_2 of ``[..., n, d_v]`` values, rounded up."""
  v = values.astype(_tail.compute_dtype(values.dtype))
  dv = v.shape[-1]
  # Scaled by the largest |v_c| so squares neither underflow (|v| ~ 1e-30
  # would give a norm of 0, and an output bound of 0 below a positive
  # truth) nor overflow.
  m = jnp.max(jnp.abs(v), axis=-1)  # [..., n]
  r = v / jnp.where(m > 0, m, 1.0)[..., None]
  norms = m * jnp.sqrt(jnp.sum(r * r, axis=-1))  # [..., n]
  return norms * (1 + (dv + 8) * jnp.finfo(v.dtype).eps)


def max_norm(norms, where) -> jax.Array:
  """``[...]`` max of ``norms`` ``[..., n]`` over ``where``; 0 if empty."""
  return jnp.max(jnp.where(where, norms, 0.0), axis=-1)


def output_error_bound(tv_bound, head_max_norm, tail_max_norm) -> jax.Array:
  """THEORY 4.2 + 4.4: ||Attn - Attn_k|| <= t (||mu_head|| + max_T ||v_j||).

  ||mu_head|| (a convex combination of kept values) is bounded by the
  largest kept value norm, which keeps the bound free of the rounding of the
  computed output. Attn_k is the exact truncated attention; the rounding of
  the returned (possibly bf16) output is not included.
  """
  norm_sum = head_max_norm + tail_max_norm
  b = tv_bound * norm_sum
  b = b * (1 + 8 * jnp.finfo(b.dtype).eps)
  # A positive product can be subnormal, which CPUs flush to 0: round it up
  # to the smallest normal instead (as finish_certificate does for tv).
  positive = (tv_bound > 0) & (norm_sum > 0)
  return jnp.where(positive, jnp.maximum(b, jnp.finfo(b.dtype).tiny), b)


def make_certificate(
  logits,
  keep,
  valid,
  *,
  norms=None,
  log_extra_slack=0.0,
  keys_scored=None,
  failure_prob=0.0,
) -> Certificate:
  """A Certificate for rows whose logits were all computed.

  Args:
    logits: ``[..., n]`` logits (computed dtype).
    keep: ``[..., n]`` bool kept set.
    valid: ``[..., n]`` bool real keys.
    norms: optional ``[..., n]`` (broadcastable) value norms from
      ``value_norms``, for the output-error bound.
    log_extra_slack: ``[...]`` or scalar added to log tau (e.g. twice the
      logit rounding bound when logits were computed from q and k).
    keys_scored: ``[...]`` int; default the number of real keys.
    failure_prob: static probability that the bound fails.

  Returns:
    A Certificate with arrays shaped ``[...]``.
  """
  dt = _tail.compute_dtype(logits.dtype)
  s = logits.astype(dt)
  keep = keep & valid
  ok = row_validity(s, valid) & jnp.any(keep, axis=-1)
  lse_all = logsumexp(s, axis=-1, where=valid)
  lse_tail = logsumexp(s, axis=-1, where=valid & ~keep)
  n = s.shape[-1]
  log_tv = lse_tail - lse_all + _tail.log_slack(n, dt) + log_extra_slack
  log_tv = log_tv + magnitude_slack(s, valid)
  log_tv = jnp.minimum(log_tv, 0.0)
  return finish_certificate(
    log_tv,
    ok,
    k_kept=jnp.sum(keep, axis=-1, dtype=jnp.int32),
    keys_scored=(
      jnp.sum(valid, axis=-1, dtype=jnp.int32)
      if keys_scored is None
      else keys_scored
    ),
    head_max_norm=None if norms is None else max_norm(norms, keep),
    tail_max_norm=None if norms is None else max_norm(norms, valid & ~keep),
    failure_prob=failure_prob,
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
  """Packs a log tail bound into a Certificate; NaN where not ``ok``."""
  log_tv = jnp.where(ok, log_tv, jnp.nan)
  tv = jnp.exp(log_tv)
  # exp underflows (and CPUs flush subnormals) below the smallest normal:
  # round a positive bound up to it rather than down to 0.
  tiny = jnp.finfo(tv.dtype).tiny
  tv = jnp.where(log_tv > -jnp.inf, jnp.maximum(tv, tiny), tv)
  err = None
  if head_max_norm is not None:
    err = jnp.where(
      ok, output_error_bound(tv, head_max_norm, tail_max_norm), jnp.nan
    )
  shape = jnp.shape(ok)
  return Certificate(
    tv_bound=tv.astype(jnp.float32) if tv.dtype != jnp.float64 else tv,
    log_tv_bound=log_tv,
    k_kept=jnp.where(ok, k_kept, 0).astype(jnp.int32).reshape(shape),
    keys_scored=jnp.broadcast_to(keys_scored, shape).astype(jnp.int32),
    output_error_bound=err,
    valid=ok,
    failure_prob=failure_prob,
  )
