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
  ``Auto``) and ``Certified(eps, 'delta', bound='codes')``: the groups are
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
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.scipy.special import logsumexp

from jaxtopk import selection
from jaxtopk.attention import _decode
from jaxtopk.attention import checks
from jaxtopk.attention import registry
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


@functools.partial(
  jax.jit, static_argnames=("policy", "scale", "q_len", "residual")
)
def _search_decode(
  query,
  index,
  rng,
  eps,
  dyn_scale=None,
  *,
  policy,
  scale,
  q_len=1,
  residual=False,
):
  """Delta/MC-Search; ``eps`` is traced (``policy.eps`` is not read), so a
  sweep over eps compiles once. ``q_len`` > 1: folded query steps
  (``_decode._fold``), each row limited to its causal prefix;
  ``residual``: the log-sum-exp residual is returned after the
  Certificate."""
  scale, scale_ok = _scale_of(scale, dyn_scale)
  b, _, h, d = query.shape
  dt = _dtype(query, index)
  q, qf = _split_heads(query, index, dt)  # [b, hk, g, d], [b, hk, g]
  hk, g = q.shape[1], q.shape[2]
  g_num, c_sz = index.num_groups, index.group_size
  u = group_upper_bounds(q, index, scale, qf)  # [b, hk, g, G]
  cnt = jnp.broadcast_to(index.count[:, :, None], u.shape)
  delta, abs_s = row_errors(q, qf, index, scale)  # [b, hk, g]
  mc = policy.search.name == "mc"
  n_samp = 0
  if mc:
    slot_ok = jnp.arange(c_sz) < index.count[..., None]  # [b, hk, G, C]
    rngs = jax.random.split(rng, (b, hk, g))
    fn = functools.partial(
      selection.mc_log_mass_row,
      scale=scale,
      num_samples=policy.num_samples,
      delta=policy.delta,
    )
    fn = jax.vmap(fn, in_axes=(0, None, None, 0, 0, 0))  # over g
    log_mass, _ = jax.vmap(jax.vmap(fn))(q, index.keys, slot_ok, u, cnt, rngs)
    n_samp = policy.num_samples * jnp.sum(index.count > 0, -1)[..., None]
  else:
    log_mass = u + jnp.log(jnp.maximum(cnt, 1).astype(dt))
  log_mass = jnp.where(cnt > 0, log_mass, -jnp.inf)
  n_rounds = -(-g_num // index.groups_per_round)
  err = _err_units(abs_s, log_mass, n_rounds)
  dv = index.values.shape[-1]
  rows = b * hk * g
  init = (
    jnp.full((rows,), -jnp.inf, dt),
    jnp.zeros((rows,), dt),
    jnp.zeros((rows, dv), dt),
  )
  keys, values = _flat_kv(index)
  row = functools.partial(
    _grow_row,
    keys=keys,
    values=values,
    scale=scale,
    log_eps=jnp.log(jnp.asarray(eps, dt)),
    rounds=index.groups_per_round,
    max_groups=g_num,
    n_terms=g_num * c_sz + g_num,
    with_lse=residual,
  )
  limit, positions, empty = _row_limits(index, q_len, g)
  base, count = _rows(index, g)
  res = _map_rows(
    lambda q, bs, c, lm, m0, z0, o0, de, er, li: row(
      q, bs, c, lm, (m0, z0, o0), None, de, er, positions=positions, prefix=li
    ),
    q.reshape(rows, d),
    base,
    count,
    log_mass.reshape(rows, g_num),
    *init,
    delta.reshape(rows),
    err.reshape(rows),
    limit.reshape(rows),
    few_rounds=g_num <= 4 * index.groups_per_round,
  )
  out, log_tv, _, kept, n_sc, n_kp, has_head, fin = res[:8]
  shape = (b, hk, g)
  out = out.reshape(*shape, dv)
  log_tv, n_sc, n_kp, has_head, fin = (
    x.reshape(shape) for x in (log_tv, n_sc, n_kp, has_head, fin)
  )
  log_head = res[8].reshape(shape) if residual else None
  kept = kept.reshape(*shape, g_num)
  vn = index.vnorm[:, :, None]  # [b, hk, 1, G]
  live = cnt > 0
  cost = _summary_cost(index)[..., None] + n_samp
  out = _finish(
    out,
    log_tv,
    has_head,
    fin,
    n_kp,
    n_sc + cost,
    core.max_norm(vn, kept & live),
    core.max_norm(vn, ~kept & live),
    delta,
    (b, h),
    query.dtype,
    scale_ok=scale_ok,
    failure_prob=policy.failure_prob,
    q_len=q_len,
    log_head=log_head,
    empty=empty,
  )
  return (*out, kept)  # kept: [b, hk, g, G] groups kept


@functools.partial(
  jax.jit, static_argnames=("policy", "scale", "q_len", "residual")
)
def _full_decode(
  query, index, dyn_scale=None, *, policy, scale, q_len=1, residual=False
):
  """Every stored key scored: 'exact' and fixed-count policies.

  ``q_len`` > 1: ``query`` holds the steps folded into the groups
  (``_decode._fold``), each row limited to the positions <= its own.
  ``residual``: also returns the log-sum-exp residual
  (``core.log_sum_exp_residual``).
  """
  scale, scale_ok = _scale_of(scale, dyn_scale)
  b, _, h, d = query.shape
  dt = _dtype(query, index)
  q, qf = _split_heads(query, index, dt)  # [b, hk, g, d]
  bb, hk, g_num, c_sz, _ = index.keys.shape
  k = index.keys.reshape(bb, hk, g_num * c_sz, d).astype(dt)
  v = index.values.reshape(bb, hk, g_num * c_sz, -1)
  s = jnp.einsum("bkgd,bknd->bkgn", q, k, precision=core.PRECISION)
  s = s * scale  # [b, hk, g, n]
  valid = (jnp.arange(c_sz) < index.count[..., None]).reshape(bb, hk, -1)
  valid = jnp.broadcast_to(valid[:, :, None], s.shape)
  if q_len > 1:  # each row its causal prefix (position -1: an empty slot)
    limit = _decode._row_limits(index.length, q_len, s.shape[2])  # [b, g]
    pos = index.position.reshape(bb, hk, 1, -1)
    valid = valid & (pos >= 0) & (pos < limit[:, None, :, None])
  delta, _ = row_errors(q, qf, index, scale)
  norms = core.value_norms(v)[:, :, None]  # [b, hk, 1, n]
  sel = selection.select_rows(
    s, policy, valid=valid, norms=norms, logit_error=delta
  )
  keep = sel.keep
  m = jnp.max(jnp.where(keep, s, -jnp.inf), -1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(keep, jnp.exp(jnp.where(keep, s, m) - m), 0.0)
  den = jnp.sum(p, -1, keepdims=True)
  # Normalised weights first (each <= 1): a sum of weighted values near
  # the largest float overflows where their mean does not.
  p = p / jnp.where(den > 0, den, 1.0)
  out = jnp.einsum("bkgn,bknv->bkgv", p, v.astype(dt), precision=core.PRECISION)
  cert = sel.certificate
  head = core.max_norm(norms, keep)
  ok = cert.valid & jnp.all(jnp.isfinite(out), -1) & scale_ok
  # tv_bound 0 (log_tv_bound the finite stand-in for log 0) is -inf again.
  log_tv = jnp.where(cert.tv_bound == 0, -jnp.inf, cert.log_tv_bound)
  cert = core.finish_certificate(
    log_tv,
    ok,
    k_kept=cert.k_kept,
    keys_scored=jnp.sum(valid, -1, dtype=jnp.int32),
    head_norm=head,
    tail_norm=core.max_norm(norms, valid & ~keep),
    logit_error=delta,
  )
  out = jnp.where(ok[..., None], out, 0.0)
  lse = None
  if residual:
    empty = ~jnp.any(valid, -1)
    log_head = m[..., 0] + jnp.log(den[..., 0])
    lse = core.log_sum_exp_residual(log_head, cert.valid, empty)
  if q_len > 1:
    out, cert, lse = jax.tree.map(
      lambda x: _decode._unfold(x, hk, q_len), (out, cert, lse)
    )
  else:
    out = out.reshape(b, 1, h, -1)
    cert, lse = jax.tree.map(lambda x: x.reshape(b, 1, h), (cert, lse))
  if residual:
    return out.astype(query.dtype), cert, lse
  return out.astype(query.dtype), cert


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


def index_decode_attention(
  query,
  index: IndexedKVCache,
  *,
  policy: selection.Policy,
  scale=None,
  implementation: str | None = None,
  key=None,
  return_residual: bool = False,
) -> (
  tuple[jax.Array, selection.Certificate]
  | tuple[jax.Array, jax.Array, selection.Certificate]
):
  """``decode_attention`` over an IndexedKVCache (module docstring).

  ``Certified(eps, 'delta' | 'mc')`` search the groups (``block_size`` must
  equal the index's ``group_size``; ``max_topk`` and ``bound='lowrank'``
  are refused); ``Certified(eps, 'exact')``, ``Dense`` and the fixed-count
  policies score every key. Only the XLA implementation exists. ``scale``
  as ``decode_attention`` (``checks.check_scale``: a traced scale is fine,
  rows are invalid where it is not finite and >= ``core.MIN_SCALE``).

  A query of q_len > 1 steps (``decode_attention``'s causal rule): the
  steps are folded into the query groups (``_decode._fold``), every row
  limited to its causal prefix (its keys past it are never scored; the
  group bounds still cover them: sound). ``return_residual``: the
  log-sum-exp residual of every path.

  Returns:
    ``(output [b, q_len, h, dv], Certificate [b, q_len, h])``, or
    ``(output, lse, Certificate)`` with ``return_residual``.

  Raises:
    ValueError: on bad shapes, scale, implementation or a refused field.
    TypeError: if ``policy`` is not a selection policy, a query that is not
      real floating, a scale that is not a real number.
  """
  if not isinstance(policy, selection.Policy):
    raise TypeError(f"{policy=} must be a jaxtopk selection policy")
  query = _check_query(query, index, steps=True)
  static, dynamic = _split_scale(checks.check_scale(scale, index.head_dim))
  if implementation not in (None, "xla"):
    raise ValueError(
      f"{implementation=} is not available for an IndexedKVCache; use None"
      " or 'xla'"
    )
  policy.require(_BACKEND, supports(policy))
  q_len = query.shape[1]
  if q_len > 1:  # the steps folded into the groups, one pass per row
    query = _decode._fold(query, index.keys.shape[1])
  kw = dict(q_len=q_len, residual=return_residual)
  if isinstance(policy, selection.Certified) and _index_by_codes(policy):
    return _codes_decode(query, index, policy, static, dynamic, **kw)
  if not isinstance(policy, selection.Certified) or not _searching(policy):
    return _full_decode(
      query, index, dynamic, policy=policy, scale=static, **kw
    )
  if policy.block_size != index.group_size:
    raise ValueError(
      f"Certified.block_size={policy.block_size} must equal the index's"
      f" group_size={index.group_size} for search={policy.search!r}"
    )
  if policy.search.needs_rng and key is None:
    raise ValueError("search='mc' needs a PRNG key: pass key=")
  rng = jax.random.key(0) if key is None else key
  res = _search_decode(
    query,
    index,
    rng,
    jnp.float32(policy.eps),
    dynamic,
    policy=selection.Certified(0.5, policy.search),  # eps is traced
    scale=static,
    **kw,
  )
  return res[:-1]  # (out, cert) or (out, cert, lse)


# What the index honours, by the path a policy takes (``supports``): every
# key scored (the exact search, fixed counts); the group search bounded by
# the key codes (Auto, which honours max_topk by scoring every key, or
# bound='codes'); the group search bounded by the balls (delta, mc).
_FULL = selection.capabilities(
  "policy=Dense",
  "policy=FixedK",
  "policy=Ratio",
  "policy=PowerLaw",
  "policy=Certified",
  "search=exact",
  "max_topk",
)
_CODES = selection.capabilities(
  "policy=Certified", "search=exact", "search=delta", "bound=codes"
)
_GROUPS = selection.capabilities(
  "policy=Certified", "search=delta", "search=mc", "bound=box"
)


def supports(policy) -> frozenset[str]:
  """The policy features ``decode_attention`` over an index honours for
  ``policy`` (its op's ``supports_fn``)."""
  if isinstance(policy, selection.Certified) and _index_by_codes(policy):
    if isinstance(policy.search, selection.Auto):
      return _CODES | {"max_topk"}
    return _CODES
  if _searching(policy):
    return _GROUPS
  return _FULL


def _searching(policy) -> bool:
  """Certified with a group search (delta or mc)."""
  return isinstance(policy, selection.Certified) and (
    policy.search.name in ("delta", "mc")
  )


def _index_by_codes(policy) -> bool:
  """``bound='codes'``, or the default ``Auto`` (then per call: see
  ``_codes_decode``)."""
  search = policy.search
  return isinstance(search, selection.Auto) or (
    search.name == "delta" and isinstance(search.bound, selection.Codes)
  )


def _codes_decode(
  query, index, policy, scale, dyn_scale=None, *, q_len=1, residual=False
):
  """``decode_attention`` over the index with the key codes (THEORY 3.5).

  Each row bounds its groups by the sum of their members' code bounds and
  searches them in rounds (``_codes_search``). ``Auto`` (on indexes of at
  least ``AUTO_MIN_KEYS`` positions; shorter ones take the exact search)
  first estimates a strided sample of ``AUTO_SAMPLE`` stored keys of
  every row from their codes (the rule of the decode over a KVCache): a
  row that does not
  look concentrated enough for the codes to pay scores every group
  instead, and costs its keys plus the sample (when no row of the call
  does, the exact search runs); ``max_topk`` (which the group search does
  not cap) takes the exact search. ``q_len`` and ``residual`` as
  ``_search_decode``'s (``query`` folded).
  """
  auto = isinstance(policy.search, selection.Auto)
  full = functools.partial(
    _full_decode,
    query,
    index,
    dyn_scale,
    policy=policy,
    scale=scale,
    q_len=q_len,
    residual=residual,
  )
  b, _, h, _ = query.shape
  hk = index.keys.shape[1]

  def plus(res, extra):  # keys_scored + extra [b, 1, h] (folded rows)
    if q_len > 1:
      extra = _decode._unfold(extra.reshape(b, hk, -1), hk, q_len)
    cert = res[1]
    cert = dataclasses.replace(cert, keys_scored=cert.keys_scored + extra)
    return (res[0], cert, *res[2:])

  if auto and index.max_len < _decode.AUTO_MIN_KEYS:
    return full()  # short caches: the exact search, as over a KVCache
  if auto and policy.max_topk is not None:
    res = full()
    _, extra = _index_sample(
      query, index, dyn_scale, eps=policy.eps, scale=scale
    )
    return plus(res, extra)
  if policy.max_topk is not None:
    raise selection.UnsupportedPolicyError(
      f"Certified.max_topk={policy.max_topk} is not supported by"
      f" {_BACKEND} with bound='codes'"
    )
  if auto:
    use, extra = _index_sample(
      query, index, dyn_scale, eps=policy.eps, scale=scale
    )
  else:
    use = jnp.ones((b, 1, h), bool)
    extra = jnp.zeros((b, 1, h), jnp.int32)

  def search():
    res = _codes_search(
      query,
      index,
      use,
      jnp.float32(policy.eps),
      dyn_scale,
      scale=scale,
      q_len=q_len,
      residual=residual,
    )
    return res[:-1]

  # No row takes the codes: the exact search (its minimal kept set).
  res = lax.cond(jnp.any(use), search, full) if auto else search()
  return plus(res, extra)


@functools.partial(jax.jit, static_argnames=("scale", "q_len", "residual"))
def _codes_search(
  query, index, use, eps, dyn_scale=None, *, scale, q_len=1, residual=False
):
  """Group search bounded by the members' codes, one row after the other.

  Per row (``lax.map``): where ``use`` the row's code bounds (its kv head's
  codes, ``key_codes.code_cost`` of its keys) give each group's mass bound
  sum_{members} e^{u_i} (``_code_group_mass``); the groups are scored in
  rounds of about 1/64 of the keys by decreasing bound (``_grow_row``)
  until eps is certified. Elsewhere every group's bound is +inf: all are
  scored (the exact search, no code read). No ball summary is read (the
  codes bound each key more tightly than its group's ball): the summary
  cost is the 2 of the query's norms. ``q_len`` and ``residual`` as
  ``_search_decode``'s (a row's code bounds then sum its prefix only).
  """
  scale, scale_ok = _scale_of(scale, dyn_scale)
  b, _, h, d = query.shape
  dt = _dtype(query, index)
  q, qf = _split_heads(query, index, dt)  # [b, hk, g, d]
  hk, g = q.shape[1], q.shape[2]
  g_num, c_sz = index.num_groups, index.group_size
  n = index.max_len
  delta, abs_s = row_errors(q, qf, index, scale)  # [b, hk, g]
  rounds = max(1, min(index.groups_per_round, n // (64 * c_sz)))
  keys, values = _flat_kv(index)
  row = functools.partial(
    _grow_row,
    keys=keys,
    values=values,
    scale=scale,
    log_eps=jnp.log(jnp.asarray(eps, dt)),
    rounds=rounds,
    max_groups=g_num,
    n_terms=g_num * c_sz + g_num,
    with_lse=residual,
  )
  limit, positions, empty = _row_limits(index, q_len, g)
  codes = index.key_codes.reshape(b * hk, d, n)
  expo = index.key_exponents.reshape(b * hk, n)
  slot = index.slot.reshape(b * hk, n)
  length = jnp.repeat(index.length, hk)  # [b hk]
  base, count = _rows(index, g)
  kv_row = jnp.arange(b * hk * g, dtype=jnp.int32) // g
  live = count > 0  # [rows, G]
  dv = index.values.shape[-1]
  n_rounds = -(-g_num // rounds)

  def one(q1, bs, c, lv, kr, u1, de, ab, li=None):
    def by_codes():
      uk = key_codes.code_bounds(
        q1[None], codes[kr], expo[kr], scale=scale, upper_only=True
      )[0]  # [n]
      slots = slot[kr]
      prefix = length[kr] if q_len == 1 else li  # the row's causal prefix
      return _code_group_mass(uk, slots, prefix, None, g_num, c_sz)

    def everything():
      return jnp.where(lv, jnp.inf, -jnp.inf).astype(dt)

    lm = lax.cond(u1, by_codes, everything)
    lm = jnp.where(lv, lm, -jnp.inf)
    err = _err_units(ab, lm, n_rounds)
    init = (jnp.asarray(-jnp.inf, dt), jnp.zeros((), dt), jnp.zeros((dv,), dt))
    res = row(
      q1, bs, c, lm, init, None, de, err, positions=positions, prefix=li
    )
    code = jnp.where(
      u1, key_codes.code_cost(length[kr], d, index.keys.dtype), 0
    )
    return (*res, code)

  rows = b * hk * g
  res = lax.map(
    lambda a: one(*a),
    (
      q.reshape(rows, d),
      base,
      count,
      live,
      kv_row,
      use.reshape(b, hk, g).reshape(rows),
      delta.reshape(rows),
      abs_s.reshape(rows),
      *((limit.reshape(rows),) if q_len > 1 else ()),
    ),
  )
  out, log_tv, _, kept, n_sc, n_kp, has_head, fin = res[:8]
  code = res[-1]
  log_head = res[8].reshape(b, hk, g) if residual else None
  shape = (b, hk, g)
  out = out.reshape(*shape, dv)
  log_tv, n_sc, n_kp, has_head, fin, code = (
    x.reshape(shape) for x in (log_tv, n_sc, n_kp, has_head, fin, code)
  )
  kept = kept.reshape(*shape, g_num)
  vn = index.vnorm[:, :, None]  # [b, hk, 1, G]
  live = jnp.broadcast_to(index.count[:, :, None] > 0, kept.shape)
  out = _finish(
    out,
    log_tv,
    has_head,
    fin,
    n_kp,
    n_sc + code + _QUERY_SUMMARY_COST,
    core.max_norm(vn, kept & live),
    core.max_norm(vn, ~kept & live),
    delta,
    (b, h),
    query.dtype,
    scale_ok=scale_ok,
    q_len=q_len,
    log_head=log_head,
    empty=empty,
  )
  return (*out, kept)  # kept: [b, hk, g, G] groups kept


@functools.partial(jax.jit, static_argnames=("eps", "scale"))
def _index_sample(query, index, dyn_scale=None, *, eps, scale):
  """``[b, 1, h]`` (the row's kv head looks concentrated enough for the
  codes, the sample's cost) from the codes of ``AUTO_SAMPLE`` stored keys
  of each row (``_decode.auto_sample_positions``; ``_decode``'s rule)."""
  scale, _ = _scale_of(scale, dyn_scale)
  m = _decode.AUTO_SAMPLE
  b, _, h, d = query.shape
  hk = index.keys.shape[1]
  qg = query.reshape(b, hk, h // hk, d)
  ln = index.length  # [b]
  pos = _decode.auto_sample_positions(ln, m)  # [b, m]
  codes = jax.vmap(lambda c, p: c[:, :, p])(index.key_codes, pos)
  expo = jax.vmap(lambda e, p: e[:, p])(index.key_exponents, pos)
  u, lo = key_codes.code_bounds(qg, codes, expo, scale=scale)
  s = 0.5 * (u + lo)  # [b, hk, g, m]: the code estimate of the logits
  p = jnp.exp(s - jnp.max(s, -1, keepdims=True))
  p = -jnp.sort(-p / jnp.sum(p, -1, keepdims=True), axis=-1)  # decreasing
  need = jnp.sum(jnp.cumsum(p, -1) < 1 - eps, -1) + 1
  long_row = (ln >= _decode.AUTO_MIN_KEYS)[:, None, None]
  use = long_row & (need <= _decode.AUTO_THRESHOLD * m)
  use = jnp.any(use, -1, keepdims=True) & jnp.ones_like(use)  # per kv head
  cost = key_codes.code_cost(m, d, index.keys.dtype)
  extra = jnp.broadcast_to(jnp.where(long_row, cost, 0), use.shape)
  return use.reshape(b, 1, h), extra.reshape(b, 1, h).astype(jnp.int32)


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
  head = core.max_norm(core.value_norms(vals), uniq)
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


def _index_op(query, cache, *, policy, scale, key, return_residual=False):
  return index_decode_attention(
    query,
    cache,
    policy=policy,
    scale=scale,
    key=key,
    return_residual=return_residual,
  )


INDEX_DECODE = registry.register(
  registry.AttentionOp(
    name="index_decode",
    implementation="xla",
    kind="decode",
    fn=_index_op,
    label=_BACKEND,
    supports_fn=supports,
    arguments=registry.DECODE_ARGUMENTS,
    cache_types=(IndexedKVCache,),
  )
)
