"""Certificates of a given selection over an ``IndexedKVCache``:
``certify_selection`` (the certificate of a set of positions: only those
keys scored, every other key bounded by its group) and ``grow_selection``
(groups added by bound until eps is certified). The bounds and the round
loop are ``_index_search``'s (its docstring states the method).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtopk import selection
from jaxtopk.attention import checks
from jaxtopk.attention._index import IndexedKVCache
from jaxtopk.attention._index_search import _check_query
from jaxtopk.attention._index_search import _code_cost
from jaxtopk.attention._index_search import _code_group_mass
from jaxtopk.attention._index_search import _dtype
from jaxtopk.attention._index_search import _finish
from jaxtopk.attention._index_search import _flat_kv
from jaxtopk.attention._index_search import _grow_row
from jaxtopk.attention._index_search import _map_rows
from jaxtopk.attention._index_search import _rows
from jaxtopk.attention._index_search import _scale_of
from jaxtopk.attention._index_search import _split_heads
from jaxtopk.attention._index_search import _split_scale
from jaxtopk.attention._index_search import _summary_cost
from jaxtopk.attention._index_search import code_bounds
from jaxtopk.attention._index_search import group_upper_bounds
from jaxtopk.attention._index_search import row_errors
from jaxtopk.selection import core


def _selected(q_row_positions, slot_row, length, c_sz, g_num):
  """Slots of a selection and which entries are distinct real keys."""
  pos = q_row_positions
  m = pos.shape[0]
  n = slot_row.shape[0]
  in_range = (pos >= 0) & (pos < jnp.minimum(length, n))
  slot = jnp.where(in_range, slot_row[jnp.clip(pos, 0, n - 1)], -1)
  real = slot >= 0
  flat = g_num * c_sz
  tgt = jnp.where(real, slot, flat)  # out of range: dropped
  first = jnp.full((flat,), m, jnp.int32)
  first = first.at[tgt].min(jnp.arange(m, dtype=jnp.int32), mode="drop")
  uniq = real & (first[jnp.clip(slot, 0, flat - 1)] == jnp.arange(m))
  mask = jnp.zeros((flat,), bool).at[tgt].set(True, mode="drop")
  return jnp.clip(slot, 0, flat - 1), uniq, mask.reshape(g_num, c_sz)


def _selection_row(
  q,
  base,
  count,
  slot_row,
  length,
  u,
  positions,
  delta,
  err_base,
  eps,
  uk=None,
  *,
  keys,
  values,
  value_norms,
  scale,
  rounds,
  max_groups,
  n_terms,
):
  """Certificate (and growth when ``max_groups`` > 0) for one query row;
  ``uk`` ``[n]``: the keys' code bounds (the groups' mass bounds are then
  also bounded by the sum over their keys left out)."""
  g_num = count.shape[0]
  c_sz = keys.shape[1]
  dt = q.dtype
  slot, uniq, sel = _selected(positions, slot_row, length, c_sz, g_num)
  gi, ci = base + slot // c_sz, slot % c_sz
  kg = keys[gi, ci].astype(dt)  # [m, d]
  s = jnp.einsum("md,d->m", kg, q, precision=core.PRECISION)
  s = s * scale  # [m]
  fin = core.logits_ok(s, uniq)  # NaN / +inf invalid, -inf zero mass
  m0 = jnp.max(jnp.where(uniq, s, -jnp.inf), initial=-jnp.inf)
  m_ref = jnp.where(jnp.isfinite(m0), m0, 0.0)
  p = jnp.where(uniq, jnp.exp(jnp.where(uniq, s, m_ref) - m_ref), 0.0)
  z0 = jnp.sum(p)
  vals = values[gi, ci]  # [m, dv]
  # The normalised mean of the selected values (weights <= 1, as
  # ``core.online_step``): their weighted sum may overflow where it does not.
  w = p / jnp.where(z0 > 0, z0, 1.0)
  o0 = jnp.einsum("m,mv->v", w, vals.astype(dt), precision=core.PRECISION)
  init = (m0, z0, o0)
  rem = count - jnp.sum(sel, -1, dtype=jnp.int32)  # keys left per group
  log_mass = jnp.where(
    rem > 0, u + jnp.log(jnp.maximum(rem, 1).astype(dt)), -jnp.inf
  )
  if uk is not None:
    n = slot_row.shape[0]
    given = (positions >= 0) & (positions < jnp.minimum(length, n))
    excl = jnp.zeros((n,), bool)
    excl = excl.at[jnp.where(given, positions, n)].set(True, mode="drop")
    lm_c = _code_group_mass(uk, slot_row, length, excl, g_num, c_sz)
    log_mass = jnp.minimum(log_mass, lm_c)
  fin_lm = jnp.isfinite(log_mass)
  err = err_base + 4 * jnp.max(jnp.where(fin_lm, jnp.abs(log_mass), 0.0))
  out, log_tv, _, kept, n_sc, n_kp, has_head, fin2 = _grow_row(
    q,
    base,
    count,
    log_mass,
    init,
    sel,
    delta,
    err,
    keys=keys,
    values=values,
    scale=scale,
    log_eps=jnp.log(jnp.asarray(eps, dt)),
    rounds=rounds,
    max_groups=max_groups,
    n_terms=n_terms,
  )
  n_sel = jnp.sum(uniq, dtype=jnp.int32)
  n_pos = jnp.sum(uniq & (s > -jnp.inf), dtype=jnp.int32)  # of mass
  head = core.max_norm(value_norms[gi, ci], uniq)
  return (
    out,
    log_tv,
    kept,
    rem,
    n_pos + n_kp,
    n_sel + n_sc,
    has_head,
    fin & fin2,
    head,
  )


@functools.partial(
  jax.jit, static_argnames=("scale", "max_groups", "rounds", "codes")
)
def _selection(
  query,
  index,
  positions,
  eps,
  dyn_scale=None,
  *,
  scale,
  max_groups,
  rounds,
  codes=True,
):
  scale, scale_ok = _scale_of(scale, dyn_scale)
  b, _, h, d = query.shape
  dt = _dtype(query, index)
  q, qf = _split_heads(query, index, dt)  # [b, hk, g, d]
  hk, g = q.shape[1], q.shape[2]
  g_num, c_sz = index.num_groups, index.group_size
  rows = b * hk * g
  pos = positions.reshape(b, hk, g, -1)
  u = group_upper_bounds(q, index, scale, qf)  # [b, hk, g, G]
  delta, abs_s = row_errors(q, qf, index, scale)
  n_rounds = max(1, -(-max_groups // rounds)) if max_groups else 0
  err_base = 4 * abs_s + 4 * (n_rounds + 2)
  keys, values = _flat_kv(index)
  row = functools.partial(
    _selection_row,
    keys=keys,
    values=values,
    value_norms=index.value_norms.reshape(-1, c_sz),
    scale=scale,
    rounds=rounds,
    max_groups=max_groups,
    n_terms=g_num * c_sz + g_num,
  )
  base, count = _rows(index, g)
  slot = jnp.broadcast_to(index.slot[:, :, None], (b, hk, g, index.max_len))
  length = jnp.broadcast_to(index.length[:, None, None], (b, hk, g))
  flat = lambda x: x.reshape(rows, *x.shape[3:])
  extra = ()
  if codes:
    extra = (flat(code_bounds(q, index, scale)),)  # [rows, n]
  out, log_tv, kept, rem, k_kept, n_sc, has_head, fin, head = _map_rows(
    row,
    q.reshape(rows, d),
    base,
    count,
    flat(slot),
    flat(length),
    flat(u),
    flat(pos),
    flat(delta),
    flat(err_base),
    jnp.broadcast_to(jnp.asarray(eps, dt), (rows,)),
    *extra,
    few_rounds=min(max_groups, g_num) <= 4 * rounds,
  )
  shape = (b, hk, g)
  out = out.reshape(*shape, -1)
  kept, rem = kept.reshape(*shape, g_num), rem.reshape(*shape, g_num)
  log_tv, k_kept, n_sc, has_head, fin, head = (
    x.reshape(shape) for x in (log_tv, k_kept, n_sc, has_head, fin, head)
  )
  vn = index.vnorm[:, :, None]  # [b, hk, 1, G]
  head = jnp.maximum(head, core.max_norm(vn, kept))
  tail = core.max_norm(vn, ~kept & (rem > 0))
  cost = _summary_cost(index)[..., None]
  if codes:
    cost = cost + _code_cost(index, d)[..., None]
  out, cert = _finish(
    out,
    log_tv,
    has_head,
    fin,
    k_kept,
    n_sc + cost,
    head,
    tail,
    delta,
    (b, h),
    query.dtype,
    scale_ok=scale_ok,
  )
  return out, cert, kept, pos


def _check_positions(positions, query, index):
  """``[b, 1, h, m]`` int32 positions, out-of-range ones as -1 (ignored).

  The dtype (integer, not bool) and the range are checked in the input's
  own dtype BEFORE the cast to int32: an int64 position 2**32 + 1 would
  otherwise wrap to 1 and be certified as kept.
  """
  if not isinstance(positions, jax.Array):
    positions = np.asarray(positions)  # lists, numpy: int64 kept as is
  dtype = positions.dtype
  if dtype == jnp.bool_ or not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
      f"positions must be integer sequence positions; got {positions.dtype=}"
    )
  b, _, h, _ = query.shape
  if positions.ndim != 4 or positions.shape[:2] != (b, 1):
    raise ValueError(
      f"positions must be [batch={b}, 1, num_heads={h} (or 1), m]; got"
      f" {positions.shape=}"
    )
  if positions.shape[2] not in (1, h):
    raise ValueError(
      f"positions' head axis must be 1 or num_heads={h}; got {positions.shape=}"
    )
  n = index.max_len
  if isinstance(positions, np.ndarray):
    ok = (positions >= 0) & (positions < n)
    positions = jnp.asarray(np.where(ok, positions, -1).astype(np.int32))
  else:
    ok = (positions >= 0) & (positions < n)
    positions = jnp.where(ok, positions, 0).astype(jnp.int32)
    positions = jnp.where(ok, positions, -1)
  return jnp.broadcast_to(positions, (b, 1, h, positions.shape[3]))


def _check_eps(eps) -> float:
  """``eps`` in (0, 1) as a Python float: Python, numpy or concrete JAX
  real scalars (as the policies accept), else an error naming it."""
  if isinstance(eps, jax.core.Tracer):
    raise TypeError(f"eps must be a concrete number; got a traced {eps!r}")
  if isinstance(eps, np.ndarray | np.generic | jax.Array):
    if np.ndim(eps) != 0:
      raise TypeError(f"eps must be a scalar; got shape {np.shape(eps)}")
    eps = eps.item()
  if isinstance(eps, bool) or not isinstance(eps, int | float):
    raise TypeError(f"eps={eps!r} must be a real number in (0, 1)")
  if not 0 < eps < 1:
    raise ValueError(f"eps={eps!r} must be in (0, 1)")
  return float(eps)


def certify_selection(
  query,
  index: IndexedKVCache,
  positions,
  *,
  scale=None,
  codes: bool = True,
) -> selection.Certificate:
  """A sound Certificate for a set of keys chosen by any other method.

  THEORY 2.4, 3.3 and 3.5. The set (a sliding window with attention sinks,
  Quest-style pages, a learned indexer's choice, a user's list) is given as
  sequence positions; only those keys are scored, every other key is
  bounded: tau <= U / (Z_K + U), U = sum_g U_g over the groups, U_g the
  smaller of the group's ball bound n_g' e^{u_g} (``group_upper_bounds``,
  n_g' its keys outside the set) and, with ``codes`` (the default), the sum
  of those keys' code bounds sum_i e^{u_i} (THEORY 3.5: within a fraction
  of a logit of each key on real heads, so U is within a small factor of
  the true left-out mass). Sound on every row.

  Defined results: positions < 0 or >= the row's length are ignored (padding
  of ragged sets; checked in the positions' own integer dtype, so an int64
  2**32 + 1 is ignored, not wrapped); duplicates count once; a set with no
  real key (empty, all padding) keeps nothing, so the row is invalid by
  ``core.row_valid`` (valid = False, float fields NaN, k_kept 0: there is no
  kept distribution to certify), as is a row of an empty cache. A key
  outside the set whose group bound is NaN or +inf (a NaN or inf key) makes
  the row invalid: its logit could be NaN or +inf.

  Args:
    query: ``[batch, 1, num_heads, head_dim]`` one decode query per head.
    index: an IndexedKVCache.
    positions: int ``[batch, 1, num_heads or 1, m]`` kept positions (any
      integer dtype).
    scale: logit scale, default 1/sqrt(head_dim); a number >= float32's
      smallest normal, or a JAX scalar (traced OK: rows are invalid where it
      is not finite and >= ``core.MIN_SCALE``).
    codes: also bound the keys left out by their 8-bit codes (static).

  Returns:
    A Certificate ``[batch, 1, num_heads]``: ``k_kept`` distinct real keys
    of the set, ``keys_scored`` = k_kept + the summaries (one per non-empty
    group + 2) + with ``codes`` the code products at their byte share
    (``key_codes.code_cost`` of the filled positions), ``output_error_bound``
    for attention over the set.

  Raises:
    TypeError: a query that is not real floating, positions that are not
      integers, a scale that is not a real number.
    ValueError: on bad shapes or a scale out of range.
  """
  query = _check_query(query, index)
  static, dynamic = _split_scale(checks.check_scale(scale, index.head_dim))
  positions = _check_positions(positions, query, index)
  # rounds and eps's type as grow_selection's (no round runs): one
  # compilation for both with max_groups=0.
  _, cert, _, _ = _selection(
    query,
    index,
    positions,
    jnp.float32(0.5),
    dynamic,
    scale=static,
    max_groups=0,
    rounds=index.groups_per_round,
    codes=bool(codes),
  )
  return cert


def grow_selection(
  query,
  index: IndexedKVCache,
  positions,
  *,
  eps: float,
  max_groups: int | None = None,
  scale=None,
  codes: bool = True,
) -> tuple[jax.Array, selection.Selection]:
  """Grows a candidate set by whole groups until tau <= eps is certified.

  Starts from ``positions`` (a cheap guess: a window, pages, an indexer's
  choice), then adds the groups with the largest bound on their left-out
  mass, ``groups_per_round`` at a time, scoring their keys, until the bound
  of ``certify_selection`` is <= eps or ``max_groups`` groups were added;
  then the certificate reports the true (possibly larger) bound, never a
  silently wrong one.

  Args:
    query: ``[batch, 1, num_heads, head_dim]``.
    index: an IndexedKVCache.
    positions: int ``[batch, 1, num_heads or 1, m]`` starting set (see
      ``certify_selection`` for padding, duplicates and empty sets).
    eps: TV budget in (0, 1): a Python, numpy or concrete JAX real scalar.
    max_groups: most groups added per row (static int), default all.
    scale: logit scale, as ``certify_selection``.
    codes: bound the groups' left-out mass also by their keys' 8-bit codes
      (``certify_selection``; static), which orders the groups by a tight
      bound and certifies with fewer of them.

  Returns:
    ``(output, selection)``: attention over the grown set ``[batch, 1,
    num_heads, head_dim_v]`` and a Selection with ``keep`` ``[batch, 1,
    num_heads, max_len]`` (True at kept positions) and its Certificate.

  Raises:
    TypeError: as ``certify_selection``; an eps that is not a real number.
    ValueError: on bad shapes, eps, max_groups or scale.
  """
  query = _check_query(query, index)
  static, dynamic = _split_scale(checks.check_scale(scale, index.head_dim))
  positions = _check_positions(positions, query, index)
  eps = _check_eps(eps)
  g_num = index.num_groups
  max_groups = g_num if max_groups is None else max_groups
  if (
    isinstance(max_groups, bool | np.bool_)
    or not isinstance(max_groups, int | np.integer)
    or (max_groups < 0)
  ):
    raise ValueError(f"{max_groups=} must be an int >= 0")
  out, cert, kept, pos = _selection(
    query,
    index,
    positions,
    jnp.float32(eps),
    dynamic,
    scale=static,
    max_groups=min(int(max_groups), g_num),
    rounds=index.groups_per_round,
    codes=bool(codes),
  )
  keep = _kept_positions(index, kept, pos)
  return out, selection.Selection(
    keep=keep, k_kept=cert.k_kept, certificate=cert
  )


@jax.jit
def _kept_positions(index, scored, pos):
  """``[b, 1, h, n]`` bool: the given positions plus the grown groups'."""
  b, hk, g, _ = pos.shape
  n = index.max_len
  ln = index.length[:, None, None, None]
  given = (pos >= 0) & (pos < ln)
  rows = jnp.zeros((b, hk, g, n), bool)
  bi = jnp.arange(b)[:, None, None, None]
  hi = jnp.arange(hk)[None, :, None, None]
  gi = jnp.arange(g)[None, None, :, None]
  rows = rows.at[bi, hi, gi, jnp.where(given, pos, n)].set(True, mode="drop")
  # Grown groups: every member position.
  mem = jnp.where(
    scored[..., None] & (index.position[:, :, None] >= 0),
    index.position[:, :, None],
    n,
  )
  mem = mem.reshape(b, hk, g, -1)
  rows = rows.at[bi, hi, gi, mem].set(True, mode="drop")
  return rows.reshape(b, 1, hk * g, n)
