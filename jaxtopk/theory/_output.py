"""Output-level error of Top-k attention: identity and bounds (THEORY 4).

For one query row with values v_1..v_n (``[n_keys, dv]``), kept set H and
tail T:

- mu_head = sum_H P_hat_i v_i (= Attn_k), mu_tail = (1/tau) sum_T P_i v_i;
- 4.1 (identity): Attn - Attn_k = tau (mu_tail - mu_head);
- 4.2 (diameter): ||Attn - Attn_k|| <= tau max_{i in H, j in T} ||v_i - v_j||,
  and, with no tail values, <= tau (||mu_head|| + max_j ||v_j||);
- 4.3 (variance): ||Attn - Attn_k|| <= sqrt(tau / (1 - tau) Var_P(V)),
  Var_P(V) = sum_i P_i ||v_i - Attn||^2;
- 4.4: each bound is increasing in tau, so a bound t >= tau may replace tau:
  pass it as ``tv_bound=``.

Conventions: an empty tail gives mu_tail = 0 and error 0. An empty head
(nothing real kept) gives Attn_k = 0 by convention, so the error is ||Attn||;
the diameter bound then measures the tail against the origin. All sums are
elementwise products and reductions (no matmul, so no reduced-precision
accumulation on accelerators). Bounds are rounded up so that they stay above
the float64 truth; ``head_tail_error`` is an exact value, not rounded.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array
from jaxtyping import ArrayLike
from jaxtyping import Bool
from jaxtyping import Float

from jaxtopk.theory import _rows

# Head keys per step when scanning the head x tail value distances.
_DIAM_BATCH = 16


class HeadTail(NamedTuple):
  """The two halves of an attention row (THEORY 4.1).

  Attributes:
    mu_head: ``[..., dv]`` Attn_k = mean of head values under P_hat.
    mu_tail: ``[..., dv]`` mean of tail values under P restricted to T.
    tau: ``[...]`` tail mass.
    log_tau: ``[...]`` log tail mass.
    log_odds: ``[...]`` log(tau / (1 - tau)) = log Z_T - log Z_H.
  """

  mu_head: jax.Array
  mu_tail: jax.Array
  tau: jax.Array
  log_tau: jax.Array
  log_odds: jax.Array


def _dtype(logits, values):
  return _rows.compute_dtype(jnp.promote_types(logits.dtype, values.dtype))


def _weights(s, where, mass):
  """Normalised weights exp(s_i) / sum_where exp(s_j) on ``where``."""
  d = jnp.where(where, s - mass.log, 0.0)
  return jnp.where(where, jnp.exp(d), 0.0)


def _masses(s, keep, valid):
  ref, ok = _rows.row_ref(s, valid)
  head = _rows.log_mass(s, valid & keep, ref)
  tail = _rows.log_mass(s, valid & ~keep, ref)
  allm = _rows.log_mass(s, valid, ref)
  return ref, ok, head, tail, allm


def head_tail_means_row(logits, keep, values, mask=None) -> HeadTail:
  """``HeadTail`` of one row; see ``head_tail_means``."""
  dt = _dtype(logits, values)
  s = logits.astype(dt)
  v = values.astype(dt)
  valid = _rows.as_mask(s, mask)
  keep = jnp.asarray(keep, bool)
  ref, ok, head, tail, allm = _masses(s, keep, valid)
  s_rel = s - ref
  w_h = _weights(s_rel, valid & keep, head)  # [n]
  w_t = _weights(s_rel, valid & ~keep, tail)  # [n]
  mu_head = jnp.sum(w_h[:, None] * v, axis=0)  # [dv]
  mu_tail = jnp.sum(w_t[:, None] * v, axis=0)  # [dv]
  log_tau = jnp.where(ok, tail.log - allm.log, jnp.nan)
  log_odds = jnp.where(ok, tail.log - head.log, jnp.nan)
  nan = jnp.full_like(mu_head, jnp.nan)
  return HeadTail(
    mu_head=jnp.where(ok, mu_head, nan),
    mu_tail=jnp.where(ok, mu_tail, nan),
    tau=jnp.exp(log_tau),
    log_tau=log_tau,
    log_odds=log_odds,
  )


def _norm(x):
  return jnp.sqrt(jnp.sum(x * x, axis=-1))


def _tau_up(ht: HeadTail, n_terms, err_coeff, dt, tv_bound):
  """tau rounded up, or the given bound t."""
  if tv_bound is not None:
    return jnp.asarray(tv_bound, dt)
  eps = jnp.finfo(dt).eps
  slack = _rows.log_slack(n_terms, dt) + 2 * eps * (err_coeff + 4.0)
  return jnp.minimum(_rows.exp_up(ht.log_tau + slack), 1.0)


def _prepare(logits, keep, values, mask):
  logits = jnp.asarray(logits)
  values = jnp.asarray(values)
  _rows.check_has_key_axis(logits)
  _rows.check_same_shape(logits, keep=keep, mask=mask)
  if values.shape[:-1] != logits.shape:
    raise ValueError(
      f"values has shape {values.shape} but must be [..., n_keys, dv] with"
      f" [..., n_keys] = logits' shape {logits.shape}"
    )
  keep = jnp.asarray(keep, bool)
  valid = _rows.as_mask(logits, mask)
  return logits, keep, values, valid


def _tv_arg(tv_bound, lead_shape, dt):
  if tv_bound is None:
    return None
  t = _rows.concrete(tv_bound)
  if t is not None and not ((t >= 0) & (t <= 1)).all():
    raise ValueError(f"{tv_bound=} must be in [0, 1]")
  return jnp.broadcast_to(jnp.asarray(tv_bound, dt), lead_shape)


def _apply(row, logits, keep, values, valid, tv):
  return _rows.apply_rows(row, 0, (), logits, keep, values, valid, tv)


def head_tail_means(logits, keep, values, mask=None) -> HeadTail:
  """mu_head, mu_tail and tau of every row (THEORY 4.1).

  Args:
    logits: ``[..., n_keys]`` logits.
    keep: ``[..., n_keys]`` bool kept set H.
    values: ``[..., n_keys, dv]`` values.
    mask: optional ``[..., n_keys]`` bool, False for padded keys.

  Returns:
    HeadTail in float32 (float64 for float64 inputs). mu_head is 0 when H
    holds no real key, mu_tail is 0 when T holds none; NaN for a row with no
    distribution. Weights are formed relative to the row's largest logit,
    so a set whose logits sit L below it carries a relative error of about
    L eps (1.3e-5 at L = 513 in float32): an upper bound built from these
    means must allow for it, as this module's bounds do (``LogMass.err``).
  """
  logits, keep, values, valid = _prepare(logits, keep, values, mask)
  return _rows.apply_rows(
    head_tail_means_row, 0, (), logits, keep, values, valid
  )


def _error_row(logits, keep, values, mask, tv):
  ht = head_tail_means_row(logits, keep, values, mask)
  diff = _norm(ht.mu_tail - ht.mu_head)
  if tv is None:
    return ht.tau * diff
  # An upper bound: round up. The means are weighted averages whose weights
  # carry a relative error of at most ``rel``, so each mean is off by at
  # most rel * max_j ||v_j|| (absolute: the difference may cancel).
  dt = _dtype(logits, values)
  s = logits.astype(dt)
  v = values.astype(dt)
  valid = _rows.as_mask(s, mask)
  _, _, head, tail, allm = _masses(s, jnp.asarray(keep, bool), valid)
  eps = jnp.finfo(dt).eps
  rel = _rows.log_slack(s.shape[-1], dt) + 2 * eps * (
    head.err + tail.err + allm.err + v.shape[-1] + 8.0
  )
  vmax = jnp.max(_norm(v), where=valid, initial=0.0)
  diff = (diff + 2 * rel * vmax) * (1 + (v.shape[-1] + 4) * eps)
  out = tv * diff * (1 + 4 * eps)
  return _rows.up_positive(out, (tv > 0) & (diff > 0))


def head_tail_error(
  logits: Float[ArrayLike, "*b n"],
  keep: Bool[ArrayLike, "*b n"],
  values: Float[ArrayLike, "*b n dv"],
  mask: Bool[ArrayLike, "*b n"] | None = None,
  *,
  tv_bound: Float[ArrayLike, "*b"] | None = None,
) -> Float[Array, "*b"]:
  """Exact ||Attn - Attn_k||_2 = tau ||mu_tail - mu_head||_2 (THEORY 4.1).

  Computed from the two group means, not by subtracting two attention
  outputs, so it keeps its relative accuracy when tau is tiny. This is the
  error itself (to float rounding), not a certificate: it reads the tail.

  Args:
    logits: ``[..., n_keys]`` logits.
    keep: ``[..., n_keys]`` bool kept set H.
    values: ``[..., n_keys, dv]`` values.
    mask: optional ``[..., n_keys]`` bool, False for padded keys.
    tv_bound: optional ``[...]`` (or scalar) t >= tau used in place of tau
      (THEORY 4.4), giving an upper bound instead of the exact error.

  Returns:
    ``[...]`` float32 (float64 for float64 inputs); NaN for a row with no
    distribution.

  Example:
    >>> import jax.numpy as jnp
    >>> s = jnp.zeros(2)
    >>> v = jnp.array([[0.0], [2.0]])
    >>> float(head_tail_error(s, jnp.array([True, False]), v))
    1.0
  """
  logits, keep, values, valid = _prepare(logits, keep, values, mask)
  tv = _tv_arg(tv_bound, logits.shape[:-1], _dtype(logits, values))
  return _apply(_error_row, logits, keep, values, valid, tv)


def _diameter_row(logits, keep, values, mask, tv):
  dt = _dtype(logits, values)
  s = logits.astype(dt)
  v = values.astype(dt)
  valid = _rows.as_mask(s, mask)
  keep = jnp.asarray(keep, bool)
  head_set = valid & keep
  tail_set = valid & ~keep
  ht = head_tail_means_row(logits, keep, values, mask)
  _, _, head, tail, allm = _masses(s, keep, valid)

  def far(vi):
    # max_{j in T} ||v_i - v_j|| for one head value v_i.
    dist = _norm(vi[None, :] - v)  # [n]
    return jnp.max(dist, where=tail_set, initial=0.0)

  per_head = jax.lax.map(far, v, batch_size=_DIAM_BATCH)  # [n]
  diam = jnp.max(per_head, where=head_set, initial=0.0)
  # Empty head: Attn_k = 0, so measure the tail against the origin.
  to_origin = jnp.max(_norm(v), where=tail_set, initial=0.0)
  diam = jnp.where(jnp.any(head_set), diam, to_origin)
  eps = jnp.finfo(dt).eps
  diam = diam * (1 + (v.shape[-1] + 6) * eps)
  err = head.err + tail.err + allm.err
  tau = _tau_up(ht, s.shape[-1], err, dt, tv)
  out = tau * diam * (1 + 4 * eps)
  out = _rows.up_positive(out, (tau > 0) & (diam > 0))
  return jnp.where(jnp.isnan(ht.log_tau), jnp.nan, out)


def diameter_bound(
  logits: Float[ArrayLike, "*b n"],
  keep: Bool[ArrayLike, "*b n"],
  values: Float[ArrayLike, "*b n dv"],
  mask: Bool[ArrayLike, "*b n"] | None = None,
  *,
  tv_bound: Float[ArrayLike, "*b"] | None = None,
) -> Float[Array, "*b"]:
  """Bound ||Attn - Attn_k|| <= tau max_{i in H, j in T} ||v_i - v_j||.

  THEORY 4.2 (first form). Needs the tail values (their distances to the
  head), not the tail logits when ``tv_bound`` is given. Costs |H| |T| dv:
  the head is scanned in batches of 16 keys, so memory stays O(16 n dv).

  Args:
    logits: ``[..., n_keys]`` logits.
    keep: ``[..., n_keys]`` bool kept set H.
    values: ``[..., n_keys, dv]`` values.
    mask: optional ``[..., n_keys]`` bool, False for padded keys.
    tv_bound: optional ``[...]`` (or scalar) t >= tau used in place of tau
      (THEORY 4.4).

  Returns:
    ``[...]`` upper bound, rounded up, float32 (float64 for float64 inputs);
    NaN for a row with no distribution.
  """
  logits, keep, values, valid = _prepare(logits, keep, values, mask)
  tv = _tv_arg(tv_bound, logits.shape[:-1], _dtype(logits, values))
  return _apply(_diameter_row, logits, keep, values, valid, tv)


def value_norm_bound(tv_bound, mu_head_norm, max_value_norm) -> jax.Array:
  """Bound ||Attn - Attn_k|| <= t (||mu_head|| + max_j ||v_j||).

  THEORY 4.2 (second form, needs no tail value): ||mu_tail - mu_head|| <=
  max_{j in T} ||v_j - mu_head|| <= ||mu_head|| + max_j ||v_j||, with
  max_j ||v_j|| typically from per-block value norms. Elementwise; the
  arguments must themselves be upper bounds (e.g. float32 norms rounded up
  by (dv + 4) eps); this function rounds up its own arithmetic.

  Args:
    tv_bound: ``[...]`` t >= tau (e.g. a certificate's ``tv_bound``).
    mu_head_norm: ``[...]`` upper bound on ||mu_head|| = ||Attn_k||.
    max_value_norm: ``[...]`` upper bound on max_{j in T} ||v_j||.

  Returns:
    ``[...]`` float32 (or wider) upper bound on ||Attn - Attn_k||.
  """
  t = jnp.asarray(tv_bound)
  dt = _rows.compute_dtype(
    jnp.result_type(t, jnp.asarray(mu_head_norm), jnp.asarray(max_value_norm))
  )
  t = t.astype(dt)
  norms = jnp.asarray(mu_head_norm, dt) + jnp.asarray(max_value_norm, dt)
  out = t * norms * (1 + 4 * jnp.finfo(dt).eps)
  return _rows.up_positive(out, (t > 0) & (norms > 0))


def _variance_row(logits, keep, values, mask, tv):
  dt = _dtype(logits, values)
  s = logits.astype(dt)
  v = values.astype(dt)
  valid = _rows.as_mask(s, mask)
  keep = jnp.asarray(keep, bool)
  ref, ok, head, tail, allm = _masses(s, keep, valid)
  p = _weights(s - ref, valid, allm)  # [n]: P_i
  attn = jnp.sum(p[:, None] * v, axis=0)  # [dv]
  # Any centre other than the exact mean only makes the sum larger, so the
  # rounding of attn cannot make the variance too small.
  dev = v - attn[None, :]  # [n, dv]
  var = jnp.sum(p * jnp.sum(dev * dev, axis=-1))
  eps = jnp.finfo(dt).eps
  if tv is None:
    err = head.err + tail.err + allm.err
    log_odds = tail.log - head.log
    slack = _rows.log_slack(s.shape[-1], dt) + 2 * eps * (err + 4.0)
    odds = _rows.exp_up(log_odds + slack)
  else:
    t = tv.astype(dt)
    odds = jnp.where(t < 1, t / (1 - t), jnp.inf) * (1 + 4 * eps)
  slack_var = _rows.log_slack(s.shape[-1], dt) + eps * (
    2 * (allm.err + v.shape[-1]) + 8.0
  )
  out = jnp.sqrt(odds * var * jnp.exp(slack_var)) * (1 + 4 * eps)
  out = _rows.up_positive(out, (odds > 0) & (var > 0))
  out = jnp.where(odds == 0, 0.0, out)
  # Nothing kept (or t = 1): Attn_k = 0 by convention, no variance bound.
  out = jnp.where(odds == jnp.inf, jnp.inf, out)
  return jnp.where(ok, out, jnp.nan)


def variance_bound(
  logits: Float[ArrayLike, "*b n"],
  keep: Bool[ArrayLike, "*b n"],
  values: Float[ArrayLike, "*b n dv"],
  mask: Bool[ArrayLike, "*b n"] | None = None,
  *,
  tv_bound: Float[ArrayLike, "*b"] | None = None,
) -> Float[Array, "*b"]:
  """Bound ||Attn - Attn_k|| <= sqrt(tau / (1 - tau) Var_P(V)) (THEORY 4.3).

  Var_P(V) = sum_i P_i ||v_i - Attn||^2 contains the between-group term
  tau (1 - tau) ||mu_tail - mu_head||^2. Needs the full row (all logits and
  values); useful as an a-posteriori check and when tau is a bound t.

  Args:
    logits: ``[..., n_keys]`` logits.
    keep: ``[..., n_keys]`` bool kept set H.
    values: ``[..., n_keys, dv]`` values.
    mask: optional ``[..., n_keys]`` bool, False for padded keys.
    tv_bound: optional ``[...]`` (or scalar) t >= tau in place of tau
      (THEORY 4.4); t = 1 gives +inf.

  Returns:
    ``[...]`` upper bound, rounded up; +inf when nothing real is kept; NaN
    for a row with no distribution.
  """
  logits, keep, values, valid = _prepare(logits, keep, values, mask)
  tv = _tv_arg(tv_bound, logits.shape[:-1], _dtype(logits, values))
  return _apply(_variance_row, logits, keep, values, valid, tv)
