"""n^C sparsity quantities of [NC] (THEORY 7).

- 7.1 dynamic window k = ceil(alpha n^C) (``powerlaw_window``);
- 7.2 the [NC] error metric ||P - P_hat||_2 per row (``row_l2_error``);
- 7.3 eps-effective entries #{i : P_i >= eps} and the ineffective fraction;
- 7.4 the scale parameter R = B^2 ||W_Q W_K^T||_F (``weight_scale_R``);
- 7.5 the logit spread sigma = sqrt(2 a ln n) of the n^C link
  (``powerlaw_sigma``): with k = n^C, tau -> 0 iff C > 1 - a.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array
from jaxtyping import ArrayLike
from jaxtyping import Bool
from jaxtyping import Float
from jaxtyping import Int

from jaxtopk.theory import _rows


def _prep(logits, mask):
  logits = jnp.asarray(logits)
  _rows.check_has_key_axis(logits)
  _rows.check_same_shape(logits, mask=mask)
  return logits, _rows.as_mask(logits, mask)


def _log_probs_row(logits, mask):
  s = logits.astype(_rows.compute_dtype(logits.dtype))
  ref, ok = _rows.row_ref(s, mask)
  allm = _rows.log_mass(s, mask, ref)
  return s - ref - allm.log, ok  # [n] log P_i (garbage where masked)


def effective_entries_row(logits, eps, mask):
  log_p, ok = _log_probs_row(logits, mask)
  n_eff = jnp.sum(mask & (log_p >= jnp.log(eps)), dtype=jnp.int32)
  return jnp.where(ok, n_eff, 0)


def ineffective_fraction_row(logits, eps, mask):
  log_p, ok = _log_probs_row(logits, mask)
  dt = log_p.dtype
  n_eff = jnp.sum(mask & (log_p >= jnp.log(eps)), dtype=jnp.int32)
  n_real = jnp.sum(mask, dtype=jnp.int32)
  out = 1 - n_eff.astype(dt) / jnp.maximum(n_real, 1).astype(dt)
  return jnp.where(ok, out, jnp.nan)


def effective_entries(
  logits: Float[ArrayLike, "*b n"],
  eps: float | Float[ArrayLike, "*b"],
  mask: Bool[ArrayLike, "*b n"] | None = None,
) -> Int[Array, "*b"]:
  """|S_eps| = #{i : P_i >= eps}, the eps-effective entries (THEORY 7.3).

  "Attention collapse" is |S_eps| tending to 1 or O(1) as n grows.

  Args:
    logits: ``[..., n_keys]`` logits.
    eps: threshold in (0, 1), scalar or broadcastable to ``[...]``.
    mask: optional ``[..., n_keys]`` bool, False for padded keys (never
      counted).

  Returns:
    ``[...]`` int32; 0 for a row with no distribution (no real key, or a
    NaN / +inf real logit).

  Raises:
    ValueError: if ``eps`` is not in (0, 1) or ``mask``'s shape differs.

  Example:
    >>> import jax.numpy as jnp
    >>> int(effective_entries(jnp.array([0.0, 0.0, -10.0]), 0.1))
    2
  """
  logits, valid = _prep(logits, mask)
  _rows.check_eps(eps)
  dt = _rows.compute_dtype(logits.dtype)
  eps = jnp.broadcast_to(jnp.asarray(eps, dt), logits.shape[:-1])
  return _rows.apply_rows(effective_entries_row, 0, (), logits, eps, valid)


def ineffective_fraction(
  logits: Float[ArrayLike, "*b n"],
  eps: float | Float[ArrayLike, "*b"],
  mask: Bool[ArrayLike, "*b n"] | None = None,
) -> Float[Array, "*b"]:
  """1 - |S_eps| / n, the fraction of ineffective entries (THEORY 7.3).

  n counts the real keys of each row. Same arguments as
  ``effective_entries``.

  Returns:
    ``[...]`` float32 in [0, 1) (float64 for float64 input); NaN for a row
    with no distribution.
  """
  logits, valid = _prep(logits, mask)
  _rows.check_eps(eps)
  dt = _rows.compute_dtype(logits.dtype)
  eps = jnp.broadcast_to(jnp.asarray(eps, dt), logits.shape[:-1])
  return _rows.apply_rows(ineffective_fraction_row, 0, (), logits, eps, valid)


def row_l2_error_row(logits, keep, mask):
  s = logits.astype(_rows.compute_dtype(logits.dtype))
  keep = jnp.asarray(keep, bool)
  head_set, tail_set = mask & keep, mask & ~keep
  ref, ok = _rows.row_ref(s, mask)
  tail = _rows.log_mass(s, tail_set, ref)
  allm = _rows.log_mass(s, mask, ref)
  # P_hat - P = tau P_hat on H and -P on T, so
  # ||P - P_hat||^2 = tau^2 sum_H P_hat_i^2 + sum_T P_i^2. Each log is taken
  # against its own group's maximum, so no large logs cancel.
  m_h, _ = _rows.row_ref(s, head_set)
  head = _rows.log_mass(s, head_set, m_h)
  log_p_hat2 = 2 * (s - m_h - head.log)  # [n] log P_hat_i^2 on H
  log_p2 = 2 * (s - ref - allm.log)  # [n] log P_i^2
  sq_h = _rows.log_mass(log_p_hat2, head_set, 0.0).log
  sq_t = _rows.log_mass(log_p2, tail_set, 0.0).log
  log_tau = tail.log - allm.log
  log_sq = jnp.logaddexp(2 * log_tau + sq_h, sq_t)
  log_sq = jnp.where(jnp.any(head_set), log_sq, jnp.inf)
  log_sq = jnp.where(tail.log == -jnp.inf, -jnp.inf, log_sq)
  return jnp.where(ok, jnp.exp(log_sq / 2), jnp.nan)


def row_l2_error(
  logits: Float[ArrayLike, "*b n"],
  keep: Bool[ArrayLike, "*b n"],
  mask: Bool[ArrayLike, "*b n"] | None = None,
) -> Float[Array, "*b"]:
  """||P - P_hat||_2 per row, the [NC] error metric (THEORY 7.2).

  P_hat is P renormalised on the kept set. Computed in closed form from the
  head and tail masses (no 1 - tau by subtraction). [NC] reports the mean
  over rows: take ``jnp.mean`` of the result.

  Args:
    logits: ``[..., n_keys]`` logits.
    keep: ``[..., n_keys]`` bool kept set H.
    mask: optional ``[..., n_keys]`` bool, False for padded keys.

  Returns:
    ``[...]`` float32 (float64 for float64 input); +inf when nothing real is
    kept and the tail has mass (P_hat undefined), NaN for a row with no
    distribution.

  Example:
    >>> import jax.numpy as jnp
    >>> e = row_l2_error(jnp.zeros(2), jnp.array([True, False]))
    >>> round(float(e), 4)  # P = (.5, .5), P_hat = (1, 0)
    0.7071
  """
  logits, valid = _prep(logits, mask)
  _rows.check_same_shape(logits, keep=keep)
  keep = jnp.asarray(keep, bool)
  return _rows.apply_rows(row_l2_error_row, 0, (), logits, keep, valid)


def weight_scale_R(w_q, w_k, input_bound) -> jax.Array:
  """[NC] scale parameter R = B^2 ||W_Q W_K^T||_F (THEORY 7.4).

  With inputs bounded by B entrywise, the logits x_i^T W_Q W_K^T x_j are at
  most R in magnitude up to the dimension factor of [NC]; a larger R allows
  sparser attention. The product is formed explicitly (d_model^2 entries)
  with full-precision matmul.

  Args:
    w_q: ``[..., d_model, d_head]`` query projection (leading axes, e.g.
      heads, are batched; a Flax ``[d_model, heads, d_head]`` kernel should
      be transposed to ``[heads, d_model, d_head]`` first).
    w_k: ``[..., d_model, d_head]`` key projection, same shape as ``w_q``.
    input_bound: B, the bound on the input entries (>= 0).

  Returns:
    ``[...]`` R in float32 (float64 for float64 weights).

  Raises:
    ValueError: if the shapes differ, are not at least 2-D, or B < 0.
  """
  w_q = jnp.asarray(w_q)
  w_k = jnp.asarray(w_k)
  if w_q.ndim < 2 or w_q.shape != w_k.shape:
    raise ValueError(
      f"w_q and w_k must both be [..., d_model, d_head]; got {w_q.shape=}"
      f" and {w_k.shape=}"
    )
  b = _rows.concrete(input_bound)
  if b is not None and np.any(b < 0):
    raise ValueError(f"{input_bound=} must be >= 0")
  dt = _rows.compute_dtype(jnp.result_type(w_q, w_k))
  prod = jnp.einsum(
    "...ic,...jc->...ij",
    w_q.astype(dt),
    w_k.astype(dt),
    precision=jax.lax.Precision.HIGHEST,
  )  # [..., d_model, d_model]
  fro = jnp.sqrt(jnp.sum(prod * prod, axis=(-2, -1)))
  return jnp.asarray(input_bound, dt) ** 2 * fro


def powerlaw_window(n, alpha, c) -> jax.Array:
  """Dynamic window k = ceil(alpha n^C), clipped to [1, n] (THEORY 7.1).

  Matches ``jaxtopk.PowerLaw(alpha, c).num_kept(n)`` elementwise.

  Args:
    n: number of keys (int or int array).
    alpha: positive prefactor.
    c: exponent in (0, 1).

  Returns:
    int32 k of n's shape.

  Raises:
    ValueError: if a concrete ``alpha`` <= 0 or ``c`` is not in (0, 1).
  """
  a = _rows.concrete(alpha)
  if a is not None and np.any(a <= 0):
    raise ValueError(f"{alpha=} must be > 0")
  cc = _rows.concrete(c)
  if cc is not None and not np.all((cc > 0) & (cc < 1)):
    raise ValueError(f"{c=} must be in (0, 1)")
  n = jnp.asarray(n)
  nf = n.astype(jnp.float32)
  k = jnp.ceil(alpha * nf**c - 1e-6).astype(jnp.int32)
  return jnp.clip(k, 1, jnp.maximum(n, 1).astype(jnp.int32))


def powerlaw_sigma(n, a) -> jax.Array:
  """Logit spread sigma = sqrt(2 a ln n) of the n^C link (THEORY 7.5).

  Under the Gaussian model with this spread, keeping k = n^C keys gives
  tau -> 0 iff C > 1 - a (``gaussian_tail_mass(n**(C - 1), sigma)``).
  """
  return jnp.sqrt(2.0 * jnp.asarray(a, jnp.float32) * jnp.log(n * 1.0))
