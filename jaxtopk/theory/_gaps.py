"""Tail bounds from the ordered logits: single gap and multi-gap (THEORY 3).

Both bound tau for the Top-k kept set (the ``topk`` largest real logits) from
the sorted row only, as instances of THEORY 2.4 (tau <= A / (A + B) whenever
Z_T <= A and Z_H >= B):

- single gap (3.1), ``form='exact_head'``: A = (n - k) e^{s_(k+1)},
  B = Z_H exactly;
- single gap (3.1), ``form='ratio'``: also B = k e^{s_(k)}, which gives
  r / (1 + r) with r = ((n - k) / k) exp(-Delta_k), Delta_k = s_(k) - s_(k+1);
- multi-gap (3.2): ranks k = m_0 < m_1 < ... < m_L = n, every logit of ranks
  m_{l-1}+1..m_l is at most s_(m_{l-1}+1), so
  A = sum_l (m_l - m_{l-1}) e^{s_(m_{l-1}+1)}, B = Z_H.

Here n is the number of REAL keys of the row (padded keys are removed), and
k = min(topk, n). ``topk`` may be a traced integer, or one per row (it is
validated when it is concrete). All bounds are rounded up so that they stay
above the float64 truth (THEORY 3.4); they are NaN for a row with no
distribution.
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

_FORMS = ("exact_head", "ratio")


def _prep(logits, topk, mask):
  s = logits.astype(_rows.compute_dtype(logits.dtype))
  valid = _rows.as_mask(s, mask)
  ref, ok = _rows.row_ref(s, valid)
  srt, n_valid = _rows.sorted_desc(s, valid)
  k = jnp.minimum(jnp.asarray(topk, jnp.int32), n_valid)
  rank = jnp.arange(s.shape[-1], dtype=jnp.int32)
  return s, srt, n_valid, k, rank, ref, ok


def _group_start_log_bound(logits, topk, mask, start_of):
  """log bound with Z_T <= sum_{tail ranks j} exp(s_sorted[start_of(j)])."""
  s, srt, n_valid, k, rank, ref, ok = _prep(logits, topk, mask)
  head = rank < k
  tail = (rank >= k) & (rank < n_valid)
  start = jnp.clip(start_of(rank, k), 0, s.shape[-1] - 1)
  rep = srt[start]  # [n]: the group's first (largest) logit
  h = _rows.log_mass(srt, head, ref)
  u = _rows.log_mass(rep, tail, ref)
  return _rows.finish_log_bound(u.log, h.log, h.err + u.err, s.shape[-1], ok)


def single_gap_log_bound_row(logits, topk, mask=None, *, form="exact_head"):
  """log of the THEORY 3.1 bound for one row; see ``single_gap_bound``."""
  if form == "exact_head":
    # One group: every tail logit is at most s_(k+1) (0-based rank k).
    return _group_start_log_bound(
      logits, topk, mask, lambda rank, k: jnp.full_like(rank, k)
    )
  s, srt, n_valid, k, rank, ref, ok = _prep(logits, topk, mask)
  n_tail = n_valid - k
  kk = jnp.maximum(k, 1)
  delta = srt[kk - 1] - srt[jnp.minimum(kk, s.shape[-1] - 1)]
  dt = s.dtype
  log_r = jnp.log(n_tail.astype(dt)) - jnp.log(kk.astype(dt)) - delta
  # log(r / (1 + r)) = -softplus(-log r); rounding of delta, log r, softplus.
  eps = jnp.finfo(dt).eps
  b = -jax.nn.softplus(-log_r)
  b = b + 4 * eps * (jnp.abs(delta) + jnp.abs(log_r) + 4.0)
  b = jnp.where(n_tail > 0, jnp.minimum(b, 0.0), -jnp.inf)
  return jnp.where(ok & (k > 0), b, jnp.nan)


def _doubling_start(rank, k):
  # Tail offset t = j - k lies in group floor(log2(t + 1)), which starts at
  # offset 2^group - 1 (group sizes 1, 2, 4, ...: m_l - k = 2^l - 1).
  t = jnp.maximum(rank - k, 0)
  group = 31 - jax.lax.clz((t + 1).astype(jnp.int32))
  return k + (jnp.left_shift(1, group) - 1)


def _custom_start(boundaries):
  b = jnp.asarray(boundaries, jnp.int32)  # [L]: 1-based ranks m_l

  def start(rank, k):
    # Group of 0-based rank j starts at the largest m_l <= j (or at k).
    below = b[None, :] <= rank[:, None]  # [n, L]
    m = jnp.max(jnp.where(below, b[None, :], 0), axis=-1, initial=0)
    return jnp.maximum(m, k)

  return start


def multi_gap_log_bound_row(logits, topk, mask=None, *, boundaries=None):
  """log of the THEORY 3.2 bound for one row; see ``multi_gap_bound``."""
  if boundaries is None:
    start = _doubling_start
  elif len(boundaries) == 0:
    start = lambda rank, k: jnp.full_like(rank, k)
  else:
    start = _custom_start(boundaries)
  return _group_start_log_bound(logits, topk, mask, start)


def _check_common(logits, topk, mask):
  logits = jnp.asarray(logits)
  _rows.check_has_key_axis(logits)
  _rows.check_same_shape(logits, mask=mask)
  _rows.check_topk(topk, logits.shape[-1], scalar=False)
  try:
    topk = jnp.broadcast_to(jnp.asarray(topk, jnp.int32), logits.shape[:-1])
  except ValueError as e:
    raise ValueError(
      f"topk of shape {jnp.shape(topk)} must broadcast to the leading axes"
      f" {logits.shape[:-1]} of logits"
    ) from e
  return logits, _rows.as_mask(logits, mask), topk


def single_gap_log_bound(
  logits: Float[ArrayLike, "*b n"],
  topk: int | Int[ArrayLike, "*b"],
  mask: Bool[ArrayLike, "*b n"] | None = None,
  *,
  form="exact_head",
) -> Float[Array, "*b"]:
  """log of ``single_gap_bound`` (accurate where the bound underflows)."""
  if form not in _FORMS:
    raise ValueError(f"{form=} must be one of {_FORMS}")
  logits, valid, topk = _check_common(logits, topk, mask)
  return _rows.apply_rows(
    single_gap_log_bound_row,
    0,
    (("form", form),),
    logits,
    topk,
    valid,
  )


def single_gap_bound(
  logits: Float[ArrayLike, "*b n"],
  topk: int | Int[ArrayLike, "*b"],
  mask: Bool[ArrayLike, "*b n"] | None = None,
  *,
  form="exact_head",
) -> Float[Array, "*b"]:
  """Upper bound on tau for the Top-k set from one boundary gap (THEORY 3.1).

  ``form='exact_head'``: tau <= (n-k) e^{s_(k+1)} / (Z_H + (n-k) e^{s_(k+1)}),
  exact head mass and one tail value. ``form='ratio'``: the looser
  r / (1 + r), r = ((n-k)/k) exp(-Delta_k), which needs only s_(k) and
  s_(k+1). n counts the real keys only; k = min(topk, n).

  Args:
    logits: ``[..., n_keys]`` logits.
    topk: number of kept keys, an integer in ``[1, n_keys]``, or an int
      array broadcastable to ``[...]`` (one per row); may be traced.
    mask: optional ``[..., n_keys]`` bool, False for padded keys.
    form: ``'exact_head'`` or ``'ratio'`` (static).

  Returns:
    ``[...]`` upper bound on tau in float32 (float64 for float64 input),
    rounded up (a positive bound is at least the smallest normal number, as
    XLA flushes subnormals; see the log form); 0 where every real key is
    kept; NaN for a row with no distribution (no real key, or a NaN / +inf
    real logit).

  Raises:
    ValueError: for ``topk`` outside ``[1, n_keys]``, an unknown ``form``, or
      a ``mask`` of another shape.

  Example:
    >>> import jax.numpy as jnp
    >>> s = jnp.array([4.0, 0.0, 0.0, 0.0])
    >>> round(float(single_gap_bound(s, 1)), 4)  # exact here: 3 / (e^4 + 3)
    0.0521
  """
  return _rows.exp_up(single_gap_log_bound(logits, topk, mask, form=form))


def single_gap_certifies(
  logits: Float[ArrayLike, "*b n"],
  topk: int | Int[ArrayLike, "*b"],
  eps: float | Float[ArrayLike, "*b"],
  mask: Bool[ArrayLike, "*b n"] | None = None,
) -> Bool[Array, "*b"]:
  """Whether the gap criterion of THEORY 3.1 certifies tau <= eps.

  True iff Delta_k >= log((n-k)/k) + log((1-eps)/eps), i.e. iff the ratio
  form of ``single_gap_bound`` is at most eps (evaluated with the same
  round-up, so True is always sound).

  Args:
    logits: ``[..., n_keys]`` logits.
    topk: number of kept keys in ``[1, n_keys]`` (or one per row).
    eps: budget in (0, 1), scalar or broadcastable to ``[...]``.
    mask: optional ``[..., n_keys]`` bool, False for padded keys.

  Returns:
    ``[...]`` bool; False for a row with no distribution.
  """
  _rows.check_eps(eps)
  log_b = single_gap_log_bound(logits, topk, mask, form="ratio")
  return log_b <= jnp.log(jnp.asarray(eps, log_b.dtype))


def _check_boundaries(boundaries, topk, n):
  if boundaries is None:
    return None
  try:
    b = tuple(int(x) for x in boundaries)
  except TypeError as e:
    raise ValueError(f"{boundaries=} must be a tuple of int ranks") from e
  if any(x != y for x, y in zip(b, boundaries, strict=True)):
    raise ValueError(f"{boundaries=} must be integers")
  if any(y <= x for x, y in zip(b, b[1:], strict=False)):
    raise ValueError(f"{boundaries=} must be strictly increasing")
  lo = _rows.concrete(topk)
  lo = 0 if lo is None or lo.size == 0 else int(np.max(lo))
  if b and (b[0] <= lo or b[-1] > n):
    raise ValueError(f"{boundaries=} must lie in (topk={lo}, n_keys={n}]")
  return b


def multi_gap_log_bound(
  logits: Float[ArrayLike, "*b n"],
  topk: int | Int[ArrayLike, "*b"],
  mask: Bool[ArrayLike, "*b n"] | None = None,
  *,
  boundaries=None,
) -> Float[Array, "*b"]:
  """log of ``multi_gap_bound`` (accurate where the bound underflows)."""
  logits = jnp.asarray(logits)
  _rows.check_has_key_axis(logits)
  b = _check_boundaries(boundaries, topk, logits.shape[-1])
  logits, valid, topk = _check_common(logits, topk, mask)
  return _rows.apply_rows(
    multi_gap_log_bound_row,
    0,
    (("boundaries", b),),
    logits,
    topk,
    valid,
  )


def multi_gap_bound(
  logits: Float[ArrayLike, "*b n"],
  topk: int | Int[ArrayLike, "*b"],
  mask: Bool[ArrayLike, "*b n"] | None = None,
  *,
  boundaries=None,
) -> Float[Array, "*b"]:
  """Upper bound on tau for the Top-k set from several gaps (THEORY 3.2).

  With ranks k = m_0 < m_1 < ... < m_L = n,
  tau / (1 - tau) <= sum_l (m_l - m_{l-1}) exp(s_(m_{l-1}+1)) / Z_H.
  The default groups double (m_l - k = 2^l - 1: sizes 1, 2, 4, ...), so the
  bound costs O(log n) tail values beyond the sort. Singleton groups give
  the exact tau; ``boundaries=()`` (one group) gives the single-gap
  ``exact_head`` bound.

  Args:
    logits: ``[..., n_keys]`` logits.
    topk: number of kept keys in ``[1, n_keys]``, or an int array
      broadcastable to ``[...]`` (one per row); may be traced.
    mask: optional ``[..., n_keys]`` bool, False for padded keys.
    boundaries: optional static tuple of 1-based ranks m_1 < ... < m_{L-1}
      (m_L = n is implied; a rank at or above a row's number of real keys
      simply closes its last group). None for doubling groups.

  Returns:
    ``[...]`` upper bound on tau in float32 (float64 for float64 input),
    rounded up (at least the smallest normal number when positive); NaN
    for a row with no distribution.

  Raises:
    ValueError: for ``topk`` outside ``[1, n_keys]``, boundaries that are not
      strictly increasing integers in ``(topk, n_keys]``, or a ``mask`` of
      another shape.

  Example:
    >>> import jax.numpy as jnp
    >>> s = jnp.array([3.0, 2.0, 1.0, 0.0])
    >>> b = multi_gap_bound(s, 1, boundaries=(2, 3))  # singletons: exact tau
    >>> round(float(b), 4)
    0.3561
  """
  return _rows.exp_up(
    multi_gap_log_bound(logits, topk, mask, boundaries=boundaries)
  )
