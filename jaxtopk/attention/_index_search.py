"""Searches over a content-grouped KV index, and certificates for any set.

THEORY 3.3 (blockwise bound), 6.2 (Delta-Search), 6.3
(MC-Search), 4.2/4.4 (output error). One query row attends to an
``IndexedKVCache`` (``_index.py``). Group g holds ``n_g`` keys inside a ball
(centre c_g, radius r_g), so every member's logit is at most

    u_g = scale (q.c_g + ||q|| r_g)                       (Cauchy-Schwarz),

rounded up for the float dot product, the norms and flushed subnormals
(``group_upper_bounds``). With K the kept keys and R the groups whose
remaining keys were not scored,

    tau <= U / (Z_K + U),   U = sum_{g in R} n_g' e^{u_g}  (THEORY 2.4, 3.3),

n_g' the group's keys outside K. One loop serves every entry point
(``_grow_row``): groups are ordered by their mass bound n_g' e^{u_g} and
scored in ROUNDS of ``groups_per_round`` groups (one gather of their keys,
one einsum, an online-softmax update), and after each round the bound is
checked; it stops once it certifies eps. A scored round is kept (its values
read, its keys attended to) unless its mass is below eps / (16 * rounds) of
the mass scored so far; then its exact mass joins the tail instead (the
bound above gets that mass added to U, exactly) and its values are never
read. So ``k_kept`` <= the keys scored, and on concentrated rows the rounds
that only certify cost keys, not values.

Key codes (THEORY 3.5): the index also keeps every key's 8-bit code in
position order. A group's mass is then also bounded by the sum of its
members' code bounds, sum_i e^{u_i} (``_code_group_mass``), within a
fraction of a logit per key of the truth on real heads where the ball sits
several logits above; the code products cost their byte share
(``key_codes.code_cost``) in ``keys_scored``.

- ``decode_attention(query, index, policy=Certified(eps))`` (the default
  ``Auto``) and ``Certified(eps, DeltaSearch(bound=Codes()))``: the groups are
  bounded by their codes alone (no ball read) and searched in rounds of
  about 1/64 of the keys (``_codes_search``); ``Auto`` picks per row
  between that and scoring every key, from a strided sample of code estimates
  (``_index_sample``, the rule of the decode over a KVCache).
- ``decode_attention(query, index, policy=Certified(eps, 'delta'))``:
  starts from nothing. 'mc' replaces n_g e^{u_g} by the Hoeffding bound
  of THEORY 6.3 from ``num_samples`` sampled members per group
  (``jaxtopk.selection``'s MC estimate); 'exact' and fixed-count policies
  score every key.
- ``certify_selection``: the certificate of a GIVEN set of positions
  (scores only those keys; every other key is bounded by its group's ball
  and, by default, by its code).
- ``grow_selection``: starts from a given set and adds whole groups by
  bound until eps is certified or ``max_groups`` groups were added (then
  the certificate states the true, larger, bound).

Cost, in ``keys_scored`` (q.k products): every scored key, plus the
summaries in key-equivalents: one q.c_g per non-empty group and 2 for
||q|| and the rounding bound |q|.max|k| (a q.c_g is one d-term dot product,
exactly the work of one key). 'mc' adds its samples.

Rows (batch x heads) run one after the other (``lax.map``): under vmap a
while loop runs every row until the slowest stops, so time would follow the
largest row's keys; this way it follows the total keys read.

This module holds the bounds and the round loop; the entry points are in
``_index_decode`` (the decode op) and ``_index_selection``
(``certify_selection``, ``grow_selection``).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.special import logsumexp

from jaxtopk.attention import _decode
from jaxtopk.attention import checks
from jaxtopk.attention._index import IndexedKVCache
from jaxtopk.attention._index import norm_up
from jaxtopk.selection import core
from jaxtopk.selection import key_codes

# Summary cost in key-equivalents besides one per non-empty group.
_QUERY_SUMMARY_COST = 2
_BACKEND = "decode_attention over an IndexedKVCache"


def _dtype(query, index):
  return core.compute_dtype(jnp.result_type(query.dtype, index.keys.dtype))


def row_errors(q, q_flushed, index, scale) -> tuple[jax.Array, jax.Array]:
  """Logit error delta and a bound on |logit| for every stored key.

  ``core.logit_error_bound`` with the box magnitude ``core.abs_dot_box``
  (q against the index's per-dimension max |k|), the largest key norm and
  the flushed-subnormal flags of q and of the stored keys.

  Args:
    q: ``[b, hk, g, d]`` queries (compute dtype).
    q_flushed: ``[b, hk, g]`` bool, q has subnormal components.
    index: the IndexedKVCache.
    scale: positive logit scale.

  Returns:
    ``(delta, abs_s)`` ``[b, hk, g]``: delta bounds |computed - exact| of
    every logit, abs_s bounds |computed logit| (for the magnitude rounding
    of the log-sum-exps).
  """
  d = q.shape[-1]
  dt = q.dtype
  qn = norm_up(q)  # [b, hk, g]
  kn = index.key_norm[:, :, None].astype(dt)
  a = core.abs_dot_box(q, index.key_absmax[:, :, None, :])[..., 0]
  delta = core.logit_error_bound(
    q_norm=qn,
    k_norm=kn,
    head_dim=d,
    scale=scale,
    abs_dot=a,
    q_flushed=q_flushed,
    k_flushed=index.key_flushed[:, :, None],
    q_absmax=jnp.max(jnp.abs(q), -1),
    k_absmax=jnp.max(index.key_absmax, -1)[:, :, None].astype(dt),
  )
  a = jnp.minimum(a, qn * kn * (1 + 2 * jnp.finfo(dt).eps))
  abs_s = scale * a * (1 + 4 * jnp.finfo(dt).eps) + delta
  return delta, abs_s


def group_upper_bounds(q, index: IndexedKVCache, scale, q_flushed=True):
  """Sound upper bounds u_g on every member logit of every group.

  u_g = scale (q.c_g + ||q|| r_g): t1 = the computed scale q.c_g (at
  ``core.PRECISION``), off by at most delta_c (``core.logit_error_bound``
  for c_g as a key, subnormal components assumed), t2 = scale ||q|| r_g
  (norms rounded up, the product by ``core.mul_up``: with ||q|| = 1.5e-38
  the product scale ||q|| is subnormal, and formed first it would flush the
  ball term to 0), then u_g = t1 + delta_c + t2 + 4 eps (|t1| + |t2| +
  delta_c) + tiny (the additions' rounding; a flushed result). Empty groups
  get -inf. A group holding a non-finite key (its radius is NaN) gets NaN:
  searched first, and a row that leaves it unscored is invalid. A bound
  that overflows is +inf (a trivial, sound bound).

  Args:
    q: ``[b, hk, g, d]`` queries (compute dtype), g per kv head (GQA).
    index: the IndexedKVCache.
    scale: positive logit scale.
    q_flushed: ``[b, hk, g]`` bool (or True: assume subnormal components).

  Returns:
    ``[b, hk, g, G]`` bounds in q's dtype.
  """
  dt = q.dtype
  fin = jnp.finfo(dt)
  d = q.shape[-1]
  c = index.centre.astype(dt)
  qc = jnp.einsum("bkgd,bkGd->bkgG", q, c, precision=core.PRECISION)
  t1 = scale * qc  # [b, hk, g, G]
  qn = norm_up(q)[..., None]  # [b, hk, g, 1]
  delta_c = core.logit_error_bound(
    q_norm=qn,
    k_norm=index.centre_norm[:, :, None].astype(dt),
    head_dim=d,
    scale=scale,
    q_flushed=jnp.asarray(q_flushed)[..., None],
    k_flushed=True,
    q_absmax=jnp.max(jnp.abs(q), -1)[..., None],
  )
  t2 = core.mul_up(scale, qn, index.radius[:, :, None].astype(dt))
  u = t1 + delta_c + t2
  u = u + 4 * fin.eps * (jnp.abs(t1) + jnp.abs(t2) + delta_c) + fin.tiny
  bad = jnp.isnan(index.radius)[:, :, None]  # a non-finite key
  u = jnp.where(bad, jnp.nan, jnp.where(jnp.isnan(u), jnp.inf, u))
  return jnp.where(index.count[:, :, None] > 0, u, -jnp.inf)


def code_bounds(q, index: IndexedKVCache, scale) -> jax.Array:
  """``[b, hk, g, n]`` sound upper bounds on every stored key's logit from
  its 8-bit code (THEORY 3.5, ``selection.key_codes``), in position
  order; +inf for a non-finite key. Costs ``key_codes.code_cost`` of the
  filled positions (their share of the keys' bytes)."""
  return key_codes.code_bounds(
    q, index.key_codes, index.key_exponents, scale=scale, upper_only=True
  )


def _code_group_mass(u, slot_row, length, exclude, g_num, c_sz):
  """``[G]`` log of a sound bound on sum e^{s_i} over each group's keys.

  From the per-key code bounds ``u`` ``[n]`` (position order) of the keys
  filled, in a group (``slot_row``) and not in ``exclude`` ``[n]`` (or
  None): per group m + log sum e^{u_i - m}, rounded up by (C + 64) eps
  (the C-term sum, each exp and its argument's rounding; a term that
  underflows loses less than tiny next to the max term 1). -inf for a
  group with no such key, +inf if one has an unbounded code (non-finite).
  """
  n = u.shape[0]
  dt = u.dtype
  ok = (jnp.arange(n) < length) & (slot_row >= 0)
  if exclude is not None:
    ok = ok & ~exclude
  grp = jnp.where(ok, slot_row // c_sz, g_num)  # g_num: a dropped bucket
  x = jnp.where(ok, u, -jnp.inf)
  m = jax.ops.segment_max(x, grp, g_num + 1)[:g_num]  # -inf where none
  mref = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.where(ok, jnp.exp(x - mref[jnp.minimum(grp, g_num - 1)]), 0.0)
  z = jax.ops.segment_sum(e, grp, g_num + 1)[:g_num]
  slack = (c_sz + 64) * jnp.finfo(dt).eps
  lm = jnp.where(
    z > 0, mref + jnp.log(jnp.where(z > 0, z, 1.0)) + slack, -jnp.inf
  )
  return jnp.where(m == jnp.inf, jnp.inf, lm)


def _code_cost(index, d):
  """``[b, hk]`` key-equivalents of the code products of the filled keys."""
  n = jnp.broadcast_to(index.length[:, None], index.key_norm.shape)
  return key_codes.code_cost(n, d, index.keys.dtype)


def _err_units(abs_s, log_mass, n_rounds):
  """Rounding coefficient (units of eps) of a row's two log masses.

  The absolute logs m + log z carry eps |m| <= eps abs_s, the group terms
  eps |u_g + log n_g|, and each round's rescale a few eps.
  """
  fin = jnp.isfinite(log_mass)
  big = jnp.max(jnp.where(fin, jnp.abs(log_mass), 0.0), -1)
  return 4 * (abs_s + big) + 4 * (n_rounds + 2)


_LEVELS_PER_LOGIT = 64  # resolution of the group order


def _order_groups(log_mass):
  """Groups by decreasing mass bound, and the log of each suffix sum.

  XLA:CPU sorts key/value pairs (argsort) ~4x slower than one int32 array,
  and ``cumlogsumexp`` is slower still (7 ms for 8 x 2,048 groups, against a
  10-20 ms logits floor at 65,536 keys), so: the bounds are quantised to
  1/64 logit below the largest (32 logits deep; deeper ones share the last
  live level), packed with the group index into one int32 key and sorted
  once; the suffix sums are a reversed cumsum of e^{w - max}. The order is
  only a heuristic (any order is sound); the suffix sums are upper bounds:
  rounded up by 2 G eps relative plus G tiny for terms that underflowed.

  Args:
    log_mass: ``[G]`` log mass bounds (+inf allowed, -inf = nothing left).

  Returns:
    ``(order, suffix)``: ``[G]`` int32 group ids, live ones first, and
    ``[G]`` log of an upper bound on the summed mass of ``order[j:]``.
  """
  g = log_mass.shape[0]
  dt = log_mass.dtype
  bits = max(1, (g - 1).bit_length())
  levels = min(2048, 2 ** (30 - bits))
  live = log_mass > -jnp.inf
  fin = jnp.isfinite(log_mass)
  top = jnp.max(jnp.where(fin, log_mass, -jnp.inf), initial=-jnp.inf)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  depth = jnp.clip((top - log_mass) * _LEVELS_PER_LOGIT, 0, levels - 2)
  lev = jnp.where(fin, jnp.floor(depth), 0).astype(jnp.int32)
  lev = jnp.where(live, lev, levels - 1)
  key = lev * (1 << bits) + jnp.arange(g, dtype=jnp.int32)
  order = lax.sort(key) & ((1 << bits) - 1)
  w = log_mass[order]
  e = jnp.exp(w - top)  # [G], +inf groups give +inf
  cs = jnp.cumsum(e[::-1])[::-1]  # reversed: mass of order[j:]
  fin_eps = jnp.finfo(dt)
  cs = cs * (1 + 2 * g * fin_eps.eps) + g * fin_eps.tiny
  n_live = jnp.sum(live)
  suffix = jnp.where(jnp.arange(g) < n_live, jnp.log(cs) + top, -jnp.inf)
  return order, suffix


def _grow_row(
  q,
  base,
  count,
  log_mass,
  init,
  exclude,
  delta,
  err,
  *,
  keys,
  values,
  scale,
  log_eps,
  rounds,
  max_groups,
  n_terms,
  positions=None,
  prefix=None,
  with_lse=False,
):
  """Scores whole groups in rounds, by bound, until tau <= eps certified.

  Args:
    q: ``[d]`` query (compute dtype).
    base: int offset of this row's kv head in the flat group axis.
    count: ``[G]`` members per group.
    log_mass: ``[G]`` log of a sound bound on the mass of each group's keys
      NOT yet kept (-inf where none remain).
    init: ``(m, z, o)`` online-softmax state of the keys already kept
      (``o`` NORMALISED: their softmax-weighted mean value).
    exclude: ``[G, C]`` bool slots already kept (never rescored), or None.
    delta: logit error of the row (``row_errors``).
    err: rounding coefficient of the row's log masses (``_err_units``).
    keys: ``[B * G, C, d]``, values ``[B * G, C, dv]``: every kv head's
      groups, flat (a round gathers ``rounds`` of them).
    scale, log_eps: logit scale and log of the budget.
    rounds: static groups per round.
    max_groups: static cap on the groups scored.
    n_terms: static number of terms of the row (keys plus groups).
    positions: optional ``[B * G, C]`` sequence position of every slot
      (flat as ``keys``), with ``prefix``: the row attends to the positions
      < ``prefix`` only (a query step's causal prefix); the group bounds
      still cover every member (sound, looser).
    prefix: int, with ``positions``.
    with_lse: static, also return log Z of the kept keys (last).

  A round whose mass is below ``eps' / (16 * max_rounds)`` of the mass
  scored so far (eps' = eps e^{-margin}, the margin the certificate needs)
  is scored but not kept: its exact mass joins the tail (the certificate
  stays exact for it) and its values are never read, so on concentrated
  rows the later rounds cost keys only. Kept rounds add their values to
  the online-softmax output, kept NORMALISED as ``core.online_step`` does
  (o' = (z / z') o + sum_j (p_j / z') v_j, every weight <= 1): an
  unnormalised sum of 16 values of 3e37 overflows where their mean does
  not. A group left unscored whose bound is NaN (it holds a non-finite key,
  ``group_upper_bounds``) makes the row invalid: its logits could be NaN or
  +inf. A +inf bound (an overflow) only makes the certificate trivial.

  Returns:
    ``(out, log_tv, scored_group, kept_group, n_scored, n_kept, has_head,
    finite)``.
  """
  g_num = count.shape[0]
  c_sz = keys.shape[1]
  r = rounds
  dt = q.dtype
  eps = jnp.finfo(dt).eps
  broken = jnp.isnan(log_mass)  # a group holding a non-finite key
  log_mass = jnp.where(broken, jnp.inf, log_mass)  # searched first
  live = log_mass > -jnp.inf
  order, suffix = _order_groups(log_mass)  # live groups first
  limit = jnp.minimum(jnp.sum(live, dtype=jnp.int32), max_groups)
  order_p = jnp.concatenate([order, jnp.zeros((r,), order.dtype)])
  suffix = jnp.concatenate([suffix, jnp.full((r + 1,), -jnp.inf, dt)])
  margin = core.search_log_margin(n_terms, delta, dt) + 4 * eps * err
  target = log_eps - margin
  # Budget of a dropped round, shrunk by the margin (huge logits: a margin
  # of ~1e24 in log space leaves nothing to drop).
  thr = jnp.exp(target) / (16 * max(1, -(-max_groups // r)))

  def lse(m, z):
    return jnp.where(z > 0, m + jnp.log(jnp.where(z > 0, z, 1.0)), -jnp.inf)

  def log_bound(log_u, m, z, zd):
    tail = jnp.logaddexp(log_u, lse(m, zd))
    return tail - jnp.logaddexp(lse(m, z), tail)

  def cond(st):
    j, m, z, zd = st[:4]
    return (j < limit) & ~(log_bound(suffix[j], m, z, zd) <= target)

  def body(st):
    j, m, z, zd, o, n_sc, n_kp, fin, kept = st
    gi = lax.dynamic_slice(order_p, (j,), (r,))  # [R]
    ok_g = (j + jnp.arange(r)) < limit
    kb = keys[base + gi]  # [R, C, d]: one gather of contiguous groups
    ok = (jnp.arange(c_sz)[None, :] < count[gi][:, None]) & ok_g[:, None]
    if exclude is not None:
      ok = ok & ~exclude[gi]
    if positions is not None:
      ok = ok & (positions[base + gi] < prefix)
    s = jnp.einsum("rcd,d->rc", kb.astype(dt), q, precision=core.PRECISION)
    s = s * scale  # [R, C]
    # The rule of ``core.logits_ok``: NaN / +inf invalid, -inf zero mass.
    fin = fin & core.logits_ok(s.reshape(-1), ok.reshape(-1))
    m_new = jnp.maximum(m, jnp.max(jnp.where(ok, s, -jnp.inf)))
    m_ref = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.where(m > -jnp.inf, jnp.exp(m - m_ref), 0.0)
    p = jnp.where(ok, jnp.exp(jnp.where(ok, s, m_ref) - m_ref), 0.0)
    mass = jnp.sum(p)
    z, zd = z * alpha, zd * alpha
    keep = ~(mass < thr * (z + zd + mass))  # NaN: kept (row invalid)
    z_new = z + jnp.where(keep, mass, 0.0)
    zd = zd + jnp.where(keep, 0.0, mass)
    inv = 1.0 / jnp.where(z_new > 0, z_new, 1.0)

    def add(o):  # o stays normalised (a rescale leaves it unchanged)
      vals = values[base + gi].astype(dt)  # [R, C, dv]
      pv = jnp.einsum("rc,rcv->v", p * inv, vals, precision=core.PRECISION)
      return (z * inv) * o + pv

    o = lax.cond(keep, add, lambda o: o, o)
    z = z_new
    n = jnp.sum(ok, dtype=jnp.int32)
    n_pos = jnp.sum(ok & (s > -jnp.inf), dtype=jnp.int32)  # of mass
    kept = kept.at[jnp.where(ok_g, gi, g_num)].set(keep, mode="drop")
    n_kp = n_kp + jnp.where(keep, n_pos, 0)
    return j + r, m_new, z, zd, o, n_sc + n, n_kp, fin, kept

  m0, z0, o0 = init
  st = (
    jnp.int32(0),
    m0,
    z0,
    jnp.zeros_like(z0),
    o0,
    jnp.int32(0),
    jnp.int32(0),
    jnp.bool_(True),
    jnp.zeros((g_num,), bool),
  )
  j, m, z, zd, o, n_sc, n_kp, fin, kept = lax.while_loop(cond, body, st)
  # Dropped keys whose e^{s - m} underflowed (or whose rescaled sum was
  # flushed) each hid less than tiny: never report their mass as zero.
  n_drop = n_sc - n_kp
  lost = (n_drop + j // r + 1).astype(dt) * jnp.finfo(dt).tiny
  zd = jnp.where(n_drop > 0, zd * (1 + 4 * eps) + lost, 0.0)
  j = jnp.minimum(j, limit)
  rank = jnp.zeros((g_num,), jnp.int32).at[order].set(jnp.arange(g_num))
  scored = rank < j
  unscored = live & ~scored
  log_u = logsumexp(log_mass, where=unscored)
  fin = fin & ~jnp.any(unscored & broken)
  log_tail = jnp.logaddexp(log_u, lse(m, zd))
  log_tv = core.tail_log_bound(
    lse(m, z),
    log_tail,
    err=err,
    n_terms=n_terms,
    logit_error=delta,
    ok=True,
  )
  has_head = (z > 0) & jnp.isfinite(m)
  res = (o, log_tv, scored, kept & scored, n_sc, n_kp, has_head, fin)
  return (*res, lse(m, z)) if with_lse else res


def _rows(index, g):
  """Per query row of ``[b, hk, g]``: flat group offset and group counts."""
  b, hk, g_num = index.count.shape
  base = (jnp.arange(b)[:, None] * hk + jnp.arange(hk)[None, :]) * g_num
  base = jnp.broadcast_to(base[:, :, None], (b, hk, g)).reshape(-1)
  count = jnp.broadcast_to(index.count[:, :, None], (b, hk, g, g_num))
  return base.astype(jnp.int32), count.reshape(-1, g_num)


def _map_rows(fn, *args, few_rounds=False):
  """``fn`` over the leading (row) axis.

  ``lax.map`` (one row after the other) when a row may take many rounds:
  under vmap a while loop runs every row until the slowest stops, so time
  would follow the largest row's keys; this way each row stops on its own
  and time follows the total keys read. When every row needs at most a few
  rounds (``few_rounds``: small caches), vmap instead: the rows then share
  each operation's fixed cost (~0.1-0.2 ms a row on XLA:CPU, which
  dominated 192 rows of 1,024 keys) and lockstep wastes little.
  """
  if few_rounds:
    return jax.vmap(fn)(*args)
  return lax.map(lambda a: fn(*a), args)


def _row_limits(index, q_len, g):
  """``(limit [b, hk, g], positions [B * G, C] or None, empty [b, hk,
  g])``: each row's causal prefix (``_decode._row_limits``; no limit and
  no positions for one step) and the rows with no real key."""
  b, hk = index.count.shape[:2]
  if q_len == 1:
    limit = jnp.broadcast_to(index.length[:, None, None], (b, hk, g))
    return limit, None, limit == 0
  limit = _decode._row_limits(index.length, q_len, g)  # [b, g]
  limit = jnp.broadcast_to(limit[:, None], (b, hk, g))
  positions = index.position.reshape(-1, index.group_size)
  return limit, positions, limit == 0


def _flat_kv(index):
  b, hk, g_num, c_sz, d = index.keys.shape
  keys = index.keys.reshape(b * hk * g_num, c_sz, d)
  values = index.values.reshape(b * hk * g_num, c_sz, -1)
  return keys, values


def _split_heads(query, index, dt):
  """``[b, hk, g, d]`` queries in ``dt`` and their subnormal flags."""
  b, _, h, d = query.shape
  hk = index.keys.shape[1]
  q = query.reshape(b, hk, h // hk, d)
  return q.astype(dt), core.flushed(q, -1)


def _finish(
  out,
  log_tv,
  has_head,
  fin,
  k_kept,
  keys_scored,
  head_norm,
  tail_norm,
  delta,
  shape,
  query_dtype,
  scale_ok=True,
  failure_prob=0.0,
  q_len=1,
  log_head=None,
  empty=None,
):
  """Validity (``core.row_valid``), Certificate, output in the query dtype.

  The output error includes how far the kept logits' rounding moves the
  output (``core.logit_output_error``, added by ``finish_certificate``).
  ``q_len`` > 1: the rows hold folded query steps (``_decode._unfold``).
  ``log_head`` (with ``empty``, the rows with no real key): also returns
  the log-sum-exp residual (``core.log_sum_exp_residual``).
  """
  b, h = shape
  norms_ok = ~(jnp.isnan(head_norm) | jnp.isnan(tail_norm))
  valid = core.row_valid(
    has_head=has_head,
    logits_ok=fin,
    norms_ok=norms_ok,
    output_ok=jnp.all(jnp.isfinite(out), -1),
    scale_ok=scale_ok,
  )
  cert = core.finish_certificate(
    log_tv,
    valid,
    k_kept=k_kept,
    keys_scored=keys_scored,
    head_norm=head_norm,
    tail_norm=tail_norm,
    logit_error=delta,
    failure_prob=failure_prob,
  )
  out = jnp.where(valid[..., None], out, 0.0)
  lse = None
  if log_head is not None:
    lse = core.log_sum_exp_residual(log_head, valid, empty)
  if q_len > 1:
    hk = out.shape[1]
    out, cert, lse = jax.tree.map(
      lambda x: _decode._unfold(x, hk, q_len), (out, cert, lse)
    )
  else:
    out = out.reshape(b, 1, h, -1)
    cert, lse = jax.tree.map(lambda x: x.reshape(b, 1, h), (cert, lse))
  out = out.astype(query_dtype)
  return (out, cert) if log_head is None else (out, cert, lse)


def _summary_cost(index):
  return jnp.sum(index.count > 0, -1, dtype=jnp.int32) + _QUERY_SUMMARY_COST


def _scale_of(static, dynamic):
  """(scale, scale_ok): a static Python float, or a traced 0-d array whose
  rows are invalid where it is not finite and >= ``core.MIN_SCALE``."""
  if static is not None:
    return static, True
  return dynamic, checks.scale_ok(dynamic)


def _split_scale(scale):
  """``checks.check_scale``'s result as (static float or None, dynamic)."""
  if isinstance(scale, float):
    return scale, None
  return None, scale


def _check_query(query, index, name="query", steps=False):
  """``query`` checked: ``[b, 1, h, d]``, or ``[b, q_len >= 1, h, d]`` with
  ``steps``."""
  query = checks.check_array(query, name)
  b, hk, _, _, d = index.keys.shape
  fits = query.ndim == 4 and query.shape[0] == b and query.shape[3] == d
  if fits and not (query.shape[1] >= 1 if steps else query.shape[1] == 1):
    fits = False
  if not fits:
    t = "q_len >= 1" if steps else "1"
    raise ValueError(
      f"{name} must be [batch={b}, {t}, num_heads, head_dim={d}]; got"
      f" {query.shape=}"
    )
  if query.shape[2] % hk:
    raise ValueError(
      f"num_heads={query.shape[2]} must be a multiple of num_kv_heads={hk}"
    )
  return query
