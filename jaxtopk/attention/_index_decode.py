"""``decode_attention`` over an ``IndexedKVCache``: the registered op, the
group searches (Delta and MC over balls, the code search, ``Auto``'s
sample) and the full-row path. The bounds and the round loop they share are
``_index_search``'s (its docstring states the method).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxtopk import selection
from jaxtopk.attention import _decode
from jaxtopk.attention import checks
from jaxtopk.attention import registry
from jaxtopk.attention._index import IndexedKVCache
from jaxtopk.attention._index_search import _BACKEND
from jaxtopk.attention._index_search import _QUERY_SUMMARY_COST
from jaxtopk.attention._index_search import _check_query
from jaxtopk.attention._index_search import _code_group_mass
from jaxtopk.attention._index_search import _dtype
from jaxtopk.attention._index_search import _err_units
from jaxtopk.attention._index_search import _finish
from jaxtopk.attention._index_search import _flat_kv
from jaxtopk.attention._index_search import _grow_row
from jaxtopk.attention._index_search import _map_rows
from jaxtopk.attention._index_search import _row_limits
from jaxtopk.attention._index_search import _rows
from jaxtopk.attention._index_search import _scale_of
from jaxtopk.attention._index_search import _split_heads
from jaxtopk.attention._index_search import _split_scale
from jaxtopk.attention._index_search import _summary_cost
from jaxtopk.attention._index_search import group_upper_bounds
from jaxtopk.attention._index_search import row_errors
from jaxtopk.selection import core
from jaxtopk.selection import internal
from jaxtopk.selection import key_codes


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
      internal.mc_log_mass_row,
      scale=scale,
      num_samples=policy.num_samples,
      delta=policy.failure_prob,
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
  norms = index.value_norms.reshape(bb, hk, 1, -1)  # [b, hk, 1, n]
  keep = internal.keep_mask(
    s, policy, valid & (s > -jnp.inf), logit_error=delta
  )
  n_valid = jnp.sum(valid, -1, dtype=jnp.int32)

  def value_fn(p):  # p: [b, hk, g, n] normalised kept weights
    return jnp.einsum(
      "bkgn,bknv->bkgv", p, v.astype(dt), precision=core.PRECISION
    )

  part = core.PartialSoftmax.from_logits(
    s,
    keep,
    valid,
    logit_error=delta,
    value_fn=value_fn,
    value_norms=norms,
    keys_scored=n_valid,
  )
  out, cert = part.finalize(n_terms=s.shape[-1], scale_ok=scale_ok)
  lse = None
  if residual:
    lse = core.log_sum_exp_residual(part.log_head, cert.valid, n_valid == 0)
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


def index_decode_attention(
  query,
  index: IndexedKVCache,
  *,
  policy: selection.Policy,
  scale=None,
  implementation: str | None = None,
  rng=None,
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
  checks.check_policy(policy)
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
  if _index_by_codes(policy):
    return _codes_decode(query, index, policy, static, dynamic, **kw)
  if not _searching(policy):
    return _full_decode(
      query, index, dynamic, policy=policy, scale=static, **kw
    )
  if policy.block_size != index.group_size:
    raise ValueError(
      f"Certified.block_size={policy.block_size} must equal the index's"
      f" group_size={index.group_size} for search={policy.search!r}"
    )
  rng = checks.check_rng(policy, rng)
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
_FULL = internal.capabilities(
  "policy=Dense",
  "policy=FixedK",
  "policy=Ratio",
  "policy=PowerLaw",
  "policy=Certified",
  "search=exact",
  "max_topk",
)
_CODES = internal.capabilities(
  "policy=Certified", "search=exact", "search=delta", "bound=codes"
)
_GROUPS = internal.capabilities(
  "policy=Certified", "search=delta", "search=mc", "bound=box"
)


def supports(policy) -> frozenset[str]:
  """The policy features ``decode_attention`` over an index honours for
  ``policy`` (its op's ``supports_fn``)."""
  if _index_by_codes(policy):
    if policy.search.name == "auto":
      return _CODES | {"max_topk"}
    return _CODES
  if _searching(policy):
    return _GROUPS
  return _FULL


def _searching(policy) -> bool:
  """Certified with a group search (delta or mc)."""
  return policy.kind == "certified" and policy.search.name in ("delta", "mc")


def _index_by_codes(policy) -> bool:
  """Certified with ``bound='codes'``, or the default ``Auto`` (then per
  call: see ``_codes_decode``)."""
  if policy.kind != "certified":
    return False
  bound = policy.bound
  return policy.search.name == "auto" or (
    bound is not None and bound.name == "codes"
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
  auto = policy.search.name == "auto"
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
  of each row (``_decode.auto_sample_need``; ``_decode``'s rule)."""
  scale, _ = _scale_of(scale, dyn_scale)
  m = _decode.AUTO_SAMPLE
  b, _, h, d = query.shape
  hk = index.keys.shape[1]
  qg = query.reshape(b, hk, h // hk, d)
  ln = index.length  # [b]
  need = _decode.auto_sample_need(
    qg, index.key_codes, index.key_exponents, ln, eps=eps, scale=scale
  )
  long_row = (ln >= _decode.AUTO_MIN_KEYS)[:, None, None]
  use = long_row & (need <= _decode.AUTO_THRESHOLD * m)
  use = jnp.any(use, -1, keepdims=True) & jnp.ones_like(use)  # per kv head
  cost = key_codes.code_cost(m, d, index.keys.dtype)
  extra = jnp.broadcast_to(jnp.where(long_row, cost, 0), use.shape)
  return use.reshape(b, 1, h), extra.reshape(b, 1, h).astype(jnp.int32)


def _index_op(query, cache, *, policy, scale, rng, return_residual=False):
  return index_decode_attention(
    query,
    cache,
    policy=policy,
    scale=scale,
    rng=rng,
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
