"""Tail mass of a truncated softmax row: TV = tau, KL = -log(1 - tau).

THEORY.md sections 1 and 2. Everything is written for ONE attention row and
vmapped over any leading axes by the public wrappers at the bottom.

Conventions shared by the whole package:
- ``logits`` is ``[..., n_keys]``; the math runs in float32, or float64 when
  the input is float64 (x64 on).
- ``keep`` is a boolean ``[..., n_keys]`` kept set H.
- ``mask`` (optional) is a boolean ``[..., n_keys]``, True for a real key and
  False for a padded one (the jax.nn convention). Masked keys are removed from
  the row: never kept, never tail. They are handled with ``where=`` reductions,
  never by writing -inf into the logits.
- A row with no real key has no distribution: its tail mass is NaN. So is a
  row with a NaN or +inf real logit (NaN propagates), or whose real logits
  are all -inf. A -inf logit among finite ones is a key of zero mass.
- Sums are taken relative to the row's largest logit and never shifted back
  (see _rows.py), so logits of magnitude 1e4 lose no accuracy.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array
from jaxtyping import ArrayLike
from jaxtyping import Bool
from jaxtyping import Float

from jaxtopk.theory import _rows

# Shared helpers, kept importable from here for other packages.
compute_dtype = _rows.compute_dtype
check_same_shape = _rows.check_same_shape
log_slack = _rows.log_slack


def _valid(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
  return _rows.as_mask(logits, mask)


def _log_masses_row(logits, keep, mask):
  """(log Z, log Z_H, log Z_T, ok), all relative to the row's largest logit."""
  s = logits.astype(compute_dtype(logits.dtype))
  valid = _valid(s, mask)
  keep = jnp.asarray(keep, bool)
  ref, ok = _rows.row_ref(s, valid)
  lse_all = _rows.log_mass(s, valid, ref).log
  lse_head = _rows.log_mass(s, valid & keep, ref).log
  lse_tail = _rows.log_mass(s, valid & ~keep, ref).log
  return lse_all, lse_head, lse_tail, ok


def log_tail_mass_row(logits, keep, mask=None) -> jax.Array:
  """log tau for one row: log tau = lse(s_T) - lse(s) (THEORY 2.5).

  Args:
    logits: ``[n_keys]`` logits of one query row.
    keep: ``[n_keys]`` bool, the kept set H.
    mask: optional ``[n_keys]`` bool, False for padded keys.

  Returns:
    Scalar log tau: -inf when the tail holds no real key, NaN when the row
    has no distribution (no real key, or a NaN / +inf real logit, or only
    -inf real logits).
  """
  lse_all, _, lse_tail, ok = _log_masses_row(logits, keep, mask)
  return jnp.where(ok, lse_tail - lse_all, jnp.nan)


def tail_mass_row(logits, keep, mask=None) -> jax.Array:
  """tau = Z_T / Z for one row; equals TV(P, P_hat) (THEORY 2.1)."""
  return jnp.exp(log_tail_mass_row(logits, keep, mask))


def kl_truncated_row(logits, keep, mask=None) -> jax.Array:
  """KL(P_hat || P) = -log(1 - tau) = lse(s) - lse(s_H) (THEORY 2.2).

  Computed from the head mass directly, so it stays exact when tau is close
  to 1 (no 1 - tau by subtraction). +inf when nothing real is kept.
  """
  lse_all, lse_head, _, ok = _log_masses_row(logits, keep, mask)
  return jnp.where(ok, lse_all - lse_head, jnp.nan)


def log_tail_mass(
  logits: Float[ArrayLike, "*b n"],
  keep: Bool[ArrayLike, "*b n"],
  mask: Bool[ArrayLike, "*b n"] | None = None,
) -> Float[Array, "*b"]:
  """log tau over any leading axes (THEORY 2.5).

  Args:
    logits: ``[..., n_keys]`` logits.
    keep: ``[..., n_keys]`` bool kept set.
    mask: optional ``[..., n_keys]`` bool, False for padded keys.

  Returns:
    ``[...]`` log tau in float32 (float64 for float64 input).

  Raises:
    ValueError: if ``keep`` or ``mask`` does not match ``logits``' shape.

  Example:
    >>> import jax.numpy as jnp
    >>> s = jnp.array([2.0, 1.0, 0.0])
    >>> float(jnp.exp(log_tail_mass(s, jnp.array([True, True, False]))))
    ... # doctest: +ELLIPSIS
    0.090...
  """
  logits = jnp.asarray(logits)
  check_same_shape(logits, keep=keep, mask=mask)
  keep = jnp.asarray(keep, bool)
  valid = _valid(logits, mask)
  _rows.check_has_key_axis(logits)
  return _rows.apply_rows(log_tail_mass_row, 0, (), logits, keep, valid)


def tail_mass(
  logits: Float[ArrayLike, "*b n"],
  keep: Bool[ArrayLike, "*b n"],
  mask: Bool[ArrayLike, "*b n"] | None = None,
) -> Float[Array, "*b"]:
  """tau = dropped softmax mass = TV(P, P_hat), over any leading axes.

  THEORY 2.1 ([TV]): for the truncated distribution P_hat (P renormalised on
  the kept set), TV(P, P_hat) is exactly the discarded mass tau.

  Args:
    logits: ``[..., n_keys]`` logits.
    keep: ``[..., n_keys]`` bool kept set.
    mask: optional ``[..., n_keys]`` bool, False for padded keys.

  Returns:
    ``[...]`` tau in float32 (float64 for float64 input); NaN for a row with
    no real key.
  """
  return jnp.exp(log_tail_mass(logits, keep, mask))


def kl_truncated(
  logits: Float[ArrayLike, "*b n"],
  keep: Bool[ArrayLike, "*b n"],
  mask: Bool[ArrayLike, "*b n"] | None = None,
) -> Float[Array, "*b"]:
  """KL(P_hat || P) = -log(1 - tau) over any leading axes (THEORY 2.2).

  TV = 1 - exp(-KL). Stable for tau near 1: computed as lse(s) - lse(s_H).
  (KL(P || P_hat) is +inf whenever the tail holds mass.)

  Returns:
    ``[...]`` KL in float32 (float64 for float64 input).
  """
  logits = jnp.asarray(logits)
  check_same_shape(logits, keep=keep, mask=mask)
  keep = jnp.asarray(keep, bool)
  valid = _valid(logits, mask)
  _rows.check_has_key_axis(logits)
  return _rows.apply_rows(kl_truncated_row, 0, (), logits, keep, valid)
