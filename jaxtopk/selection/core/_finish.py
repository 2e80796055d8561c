"""Finishing: tail masses, output bounds, the validity rule and the
Certificate of a row (``jaxtopk.selection.core``).
"""

import dataclasses

import jax
import jax.numpy as jnp

from jaxtopk.selection._certificate import Certificate
from jaxtopk.selection.core._logit_error import logit_output_error
from jaxtopk.selection.core._numerics import MIN_SCALE
from jaxtopk.selection.core._numerics import _eps
from jaxtopk.selection.core._numerics import exp_up
from jaxtopk.selection.core._numerics import finite_log
from jaxtopk.selection.core._numerics import up_positive
from jaxtopk.theory import internal as _theory


def tail_log_bound(log_head, log_tail, *, err, n_terms, logit_error, ok):
  """log of an upper bound on tau = Z_T / (Z_H + Z_T), rounded up.

  THEORY 2.4/2.5 and 3.4: ``_theory.finish_log_bound`` (the one rounded-up
  U / (Z_H + U) formula) plus 2 delta for logits off by at most delta (tail
  up by e^delta, head down by e^-delta). A +inf (or NaN) delta gives the
  trivial bound 0 (tau <= 1) even where nothing was dropped, because a key
  read as -inf may then hold mass.

  Args:
    log_head: ``[...]`` log Z_H relative to any reference (same for both).
    log_tail: ``[...]`` log of an upper bound on Z_T, same reference; -inf
      when nothing real was dropped.
    err: ``[...]`` rounding coefficient of the two logs, in units of eps.
    n_terms: number of terms reduced (static int or ``[...]``).
    logit_error: ``[...]`` delta (``logit_error_bound``) or 0.
    ok: ``[...]`` bool row validity.

  Returns:
    ``[...]`` log tv bound in [-inf, 0]; NaN where not ``ok``.
  """
  log_head = jnp.asarray(log_head)
  dt = log_head.dtype
  delta = jnp.asarray(logit_error, dt)
  b = _theory.finish_log_bound(log_tail, log_head, err, n_terms, ok)
  b = jnp.minimum(b + 2 * delta, 0.0)
  trivial = ~(delta < jnp.inf)  # +inf or NaN
  return jnp.where(ok, jnp.where(trivial, 0.0, b), jnp.nan)


def output_error_bound(tv_bound, head_norm, tail_norm) -> jax.Array:
  """THEORY 4.2 + 4.4: ||Attn - Attn_k||_2 <= tv (||mu_H|| + max_T ||v_j||).

  ||mu_H|| (the exact kept-set output, a convex combination of kept values)
  is bounded by the largest kept value norm, so the bound does not depend on
  the rounding of the computed output. Written as tv h + tv t (each rounded
  up), so it overflows only when the bound itself exceeds the largest float
  (then +inf, sound) and a positive product that underflows is raised to
  the smallest normal. tv = 0 gives 0 (nothing dropped), whatever the norms.

  Args:
    tv_bound: ``[...]`` tv bound in [0, 1].
    head_norm: ``[...]`` max ||v_j|| over kept keys (``max_norm`` of
      ``value_norms``: compressed above 2^126).
    tail_norm: ``[...]`` max ||v_j|| over dropped real keys (likewise).

  Returns:
    ``[...]`` bound, NaN where an input is NaN.
  """
  tv = jnp.asarray(tv_bound)
  dt = tv.dtype
  h = jnp.asarray(head_norm, dt)
  t = jnp.asarray(tail_norm, dt)
  eps = _eps(dt)
  # ``mul_norm_up`` reads the stored (compressed) norms; subnormal inputs
  # count as the smallest normal, a positive product is never 0.
  th = _theory.mul_norm_up(tv, h)
  tt = _theory.mul_norm_up(tv, t)
  b = (th + tt) * (1 + 8 * eps)
  b = up_positive(b, (th > 0) | (tt > 0))
  bad = jnp.isnan(tv) | jnp.isnan(h) | jnp.isnan(t)
  # A subnormal tv compares equal to 0 on a CPU: read its bits.
  zero = (tv == 0) & ~_theory.subnormal(tv)
  return jnp.where(bad, jnp.nan, jnp.where(zero, 0.0, b))


def logits_ok(logits, real) -> jax.Array:
  """``[...]`` True where no real logit of the row is NaN or +inf.

  (-inf is allowed: a key of zero mass.)
  """
  s = jnp.asarray(logits)
  bad = jnp.isnan(s) | (s == jnp.inf)
  return ~jnp.any(real & bad, axis=-1)


def scale_ok(scale) -> jax.Array | bool:
  """Whether a logit scale is one the certificates cover: finite and at
  least ``MIN_SCALE`` (float32's smallest normal; a subnormal scale reads 0
  on a CPU). True for a Python float (checked at the boundary); for an
  array (a traced temperature), the bool that feeds ``row_valid``.
  """
  if isinstance(scale, int | float):
    return True
  scale = jnp.asarray(scale)
  return jnp.isfinite(scale) & (scale >= MIN_SCALE)


def row_valid(
  *,
  has_head,
  logits_ok=True,
  norms_ok=True,
  output_ok=True,
  scale_ok=True,
) -> jax.Array:
  """The row validity rule of the module docstring, one place.

  Args:
    has_head: ``[...]`` bool, a real key of positive mass is kept.
    logits_ok: ``[...]`` bool from ``logits_ok`` (no NaN / +inf real logit).
    norms_ok: ``[...]`` bool, the real keys' value norms are not NaN.
    output_ok: ``[...]`` bool, the computed output is finite.
    scale_ok: bool, the logit scale is finite and >= ``MIN_SCALE``
      (``scale_ok``, on traced scales; a static scale is checked at the
      boundary by ``attention.checks``).

  Returns:
    ``[...]`` bool.
  """
  return has_head & logits_ok & norms_ok & output_ok & scale_ok


def log_sum_exp_residual(log_head, valid, empty) -> jax.Array:
  """The attention log-sum-exp residual of rows, as returned to users.

  log Z_H (the log-sum-exp of the computed logits of the kept keys) where
  the row is ``valid``; log 0 (``finite_log``'s stand-in) for a row with no
  real key, which weighs nothing when partial results are merged; NaN for
  a row that had real keys but could not be certified (a NaN logit, a bad
  scale), so that a merge never treats it as empty.

  Args:
    log_head: ``[...]`` log Z_H (``PartialSoftmax.log_head``).
    valid: ``[...]`` bool, the certificate's ``valid``.
    empty: ``[...]`` bool, rows that hold no real key.
  """
  log_head = jnp.asarray(log_head)
  nan = jnp.asarray(jnp.nan, log_head.dtype)
  lse = jnp.where(valid, log_head, jnp.where(empty, -jnp.inf, nan))
  return finite_log(lse)


def tv_up(log_tv, valid) -> jax.Array:
  """The Certificate's tv_bound of a rounded-up log tv bound: ``exp_up``
  of ``min(log_tv, 0)`` (never 0 for a positive bound), NaN where not
  ``valid``."""
  log_tv = jnp.where(valid, jnp.minimum(log_tv, 0.0), jnp.nan)
  return jnp.where(valid, exp_up(log_tv), jnp.nan)


def finish_certificate(
  log_tv,
  valid,
  *,
  k_kept,
  keys_scored,
  head_norm=None,
  tail_norm=None,
  logit_error=None,
  failure_prob: float = 0.0,
) -> Certificate:
  """Packs a rounded-up log tv bound into a Certificate.

  tv_bound = ``exp_up(log_tv)`` (never 0 for a positive bound, even when it
  is below the smallest normal); output_error_bound from
  ``output_error_bound`` when norms are given, plus
  ``logit_output_error`` when ``logit_error`` is (+inf where it is +inf:
  the certificate is trivial). Float fields are NaN and ``k_kept``
  is 0 where not ``valid``.

  Args:
    log_tv: ``[...]`` log tv bound (e.g. ``tail_log_bound``), rounded up.
    valid: ``[...]`` bool (``row_valid``).
    k_kept: ``[...]`` int kept real keys.
    keys_scored: ``[...]`` int q.k products computed.
    head_norm: optional ``[...]`` max kept value norm.
    tail_norm: optional ``[...]`` max dropped value norm.
    logit_error: optional ``[...]`` delta, to flag trivial rows.
    failure_prob: static probability that the bound fails (MC-Search).

  Returns:
    A Certificate with arrays shaped ``[...]`` (``valid``'s shape).
  """
  valid = jnp.asarray(valid)
  shape = valid.shape
  log_tv = jnp.broadcast_to(jnp.asarray(log_tv), shape)
  log_tv = jnp.where(valid, jnp.minimum(log_tv, 0.0), jnp.nan)
  tv = tv_up(log_tv, valid)
  log_tv = finite_log(log_tv)  # tv_bound 0: the most negative float
  err = None
  if head_norm is not None:
    err = output_error_bound(tv, head_norm, tail_norm)
    if logit_error is not None:
      x = logit_output_error(logit_error, head_norm)
      # the sum rounded up (two roundings of at most half an ulp each)
      err = jnp.where(x > 0, (err + x) * (1 + 4 * _eps(err.dtype)), err)
      err = jnp.where(jnp.asarray(logit_error) < jnp.inf, err, jnp.inf)
    err = jnp.where(valid, jnp.broadcast_to(err, shape), jnp.nan)
  return Certificate(
    tv_bound=tv,
    log_tv_bound=log_tv,
    k_kept=jnp.where(valid, jnp.broadcast_to(k_kept, shape), 0).astype(
      jnp.int32
    ),
    keys_scored=jnp.broadcast_to(keys_scored, shape).astype(jnp.int32),
    output_error_bound=err,
    valid=valid,
    failure_prob=failure_prob,
  )


def mark_invalid(cert: Certificate, bad) -> Certificate:
  """``cert`` with the rows ``bad`` made invalid by the rule of ``row_valid``.

  For a condition found outside the certificate's own computation (e.g. a
  decode step past the cache's capacity): valid False, float fields NaN,
  ``k_kept`` 0 where ``bad``; ``keys_scored`` unchanged.

  Args:
    cert: a Certificate ``[...]``.
    bad: bool broadcastable to ``[...]``.
  """
  bad = jnp.broadcast_to(jnp.asarray(bad, bool), cert.valid.shape)
  nan = lambda x: None if x is None else jnp.where(bad, jnp.nan, x)  # noqa: E731
  return dataclasses.replace(
    cert,
    tv_bound=nan(cert.tv_bound),
    log_tv_bound=nan(cert.log_tv_bound),
    k_kept=jnp.where(bad, 0, cert.k_kept).astype(cert.k_kept.dtype),
    output_error_bound=nan(cert.output_error_bound),
    valid=cert.valid & ~bad,
  )
