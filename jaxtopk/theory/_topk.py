"""The Top-k kept set and the exact certified size k_eps (THEORY 1, 6.1).

``topk_mask`` is the kept set H of "Top-k" throughout the package: the
``topk`` largest real logits of a row. Ties are broken by the LOWEST key index
(the order of ``jax.lax.top_k``), so the set is deterministic. NaN logits rank
above every number (``lax.top_k`` order); such a row has no distribution and
every bound on it is NaN anyway.

``k_eps`` is the exact reference for certified selection: the minimal number
of largest logits whose tail mass is at most eps (THEORY 6.1), by a full sort.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array
from jaxtyping import ArrayLike
from jaxtyping import Bool
from jaxtyping import Float
from jaxtyping import Int

from jaxtopk.theory import _rows


def topk_mask_row(logits, mask=None, *, topk: int) -> jax.Array:
  """Bool ``[n_keys]`` mask of the ``topk`` largest real logits of one row."""
  s = logits.astype(_rows.compute_dtype(logits.dtype))
  valid = _rows.as_mask(s, mask)
  # The sort key only; no arithmetic is done with the -inf of padded keys.
  key = jnp.where(valid, s, -jnp.inf)
  _, idx = jax.lax.top_k(key, topk)  # [topk]
  keep = jnp.zeros(s.shape, bool).at[idx].set(True)
  return keep & valid


def topk_mask(
  logits: Float[ArrayLike, "*b n"],
  topk: int,
  mask: Bool[ArrayLike, "*b n"] | None = None,
) -> Bool[Array, "*b n"]:
  """Kept set H of Top-k: the ``topk`` largest real logits of each row.

  Ties are broken by the lowest key index. Padded keys (``mask`` False) are
  never kept, so a row with fewer than ``topk`` real keys keeps all of them.

  Args:
    logits: ``[..., n_keys]`` logits.
    topk: static int in ``[1, n_keys]``.
    mask: optional ``[..., n_keys]`` bool, False for padded keys.

  Returns:
    ``[..., n_keys]`` bool, True for kept keys.

  Raises:
    ValueError: if ``topk`` is not in ``[1, n_keys]`` or ``mask``'s shape
      differs from ``logits``'.

  Example:
    >>> import jax.numpy as jnp
    >>> topk_mask(jnp.array([1.0, 3.0, 3.0, 2.0]), 2).tolist()
    [False, True, True, False]
  """
  logits = jnp.asarray(logits)
  _rows.check_has_key_axis(logits)
  _rows.check_same_shape(logits, mask=mask)
  n = logits.shape[-1]
  _rows.check_topk(topk, n)
  topk = int(topk)
  valid = _rows.as_mask(logits, mask)
  return _rows.apply_rows(topk_mask_row, 0, (("topk", topk),), logits, valid)


def log_tail_masses_sorted_row(logits, mask=None):
  """Sorted row and log tau_j for every j (tail after the j largest).

  Returns:
    (log_tails, n_valid, ok): ``[n_keys]`` log tau_j for j = 0..n-1 (j kept;
    entries at j >= n_valid are -inf), the number of real keys, and whether
    the row has a distribution.
  """
  s = logits.astype(_rows.compute_dtype(logits.dtype))
  valid = _rows.as_mask(s, mask)
  ref, ok = _rows.row_ref(s, valid)
  srt, n_valid = _rows.sorted_desc(s, valid)
  rank = jnp.arange(s.shape[-1])
  real = rank < n_valid
  w = jnp.where(real, jnp.exp(jnp.where(real, srt - ref, 0.0)), 0.0)
  # Suffix sums taken directly (no total minus prefix), so tiny tails keep
  # their relative accuracy.
  suffix = jnp.cumsum(w[::-1])[::-1]  # [n]: sum_{i >= j} w_i
  total = suffix[0]
  log_tails = jnp.log(suffix) - jnp.log(total)
  log_tails = jnp.where(real, log_tails, -jnp.inf)
  return log_tails, n_valid, ok


def k_eps_row(logits, eps, mask=None) -> jax.Array:
  """int32 minimal number of largest logits with tail mass <= eps."""
  log_tails, _, ok = log_tail_masses_sorted_row(logits, mask)
  # tau_0 = 1 > eps and tau_j is non-increasing: count the j with tau_j > eps.
  k = jnp.sum(log_tails > jnp.log(eps), dtype=jnp.int32)
  return jnp.where(ok, k, 0)


def k_eps(
  logits: Float[ArrayLike, "*b n"],
  eps: float | Float[ArrayLike, "*b"],
  mask: Bool[ArrayLike, "*b n"] | None = None,
) -> Int[Array, "*b"]:
  """Exact certified size: min k such that the k largest keep tau <= eps.

  THEORY 6.1: keeping the ``k_eps`` largest real logits leaves a tail mass
  of at most eps, and keeping one fewer does not. Computed with one sort
  (a reference, not the fast path). Ties do not matter: equal logits give
  equal masses.

  The tail sums are taken below the row's largest logit in float32 (float64
  for float64 input); a row whose tail masses straddle eps within rounding
  may be off by one against the float64 truth.

  Args:
    logits: ``[..., n_keys]`` logits.
    eps: tail budget in (0, 1); a scalar or an array broadcastable to the
      leading axes ``[...]``.
    mask: optional ``[..., n_keys]`` bool, False for padded keys.

  Returns:
    ``[...]`` int32 in ``[1, n_real]``; 0 for a row with no distribution
    (no real key, or a NaN / +inf real logit).

  Raises:
    ValueError: if ``eps`` is not in (0, 1) or ``mask``'s shape differs.

  Example:
    >>> import jax.numpy as jnp
    >>> int(k_eps(jnp.array([0.0, 5.0, 0.0, 5.0]), 0.05))
    2
  """
  logits = jnp.asarray(logits)
  _rows.check_has_key_axis(logits)
  _rows.check_same_shape(logits, mask=mask)
  _rows.check_eps(eps)
  dt = _rows.compute_dtype(logits.dtype)
  eps = jnp.broadcast_to(jnp.asarray(eps, dt), logits.shape[:-1])
  valid = _rows.as_mask(logits, mask)
  return _rows.apply_rows(k_eps_row, 0, (), logits, eps, valid)
