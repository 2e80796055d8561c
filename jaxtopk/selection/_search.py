"""Delta-Search and MC-Search: certify while scoring only some key blocks.

THEORY 6.2 (Delta-Search, deterministic) and 6.3 (MC-Search, holds with
probability >= 1 - delta). Both order the key blocks by an upper bound on
their mass, score whole blocks in that order (one q.k product per real key,
counted in ``keys_scored``), and stop as soon as the THEORY 3.3 bound with
every scored key kept certifies tau <= eps:

    U_unscored / (Z_scored + U_unscored) <= eps.

Then, among the scored keys, the smallest kept set that still meets eps is
found by the few-pass threshold search with U_unscored as fixed extra tail
(``threshold.budget_mask``), capped at ``Certified.max_topk`` when given. The
certificate is THEORY 3.3's blockwise bound of that kept set, built by the
certificate core: a ``core.PartialSoftmax`` of the scored keys with the unscored
blocks' bounds in its tail, rounded up for the float rounding of the scored
logits (``core.logit_error_bound``, subnormal inputs included).

- Delta-Search: U_b = |B_b| e^{u_b} with u_b the minimum of the box and ball
  bounds (``theory.box_upper_bound``, ``theory.ball_upper_bound``).
- MC-Search: additionally scores ``num_samples`` uniformly drawn keys (with
  replacement) of every block and uses the Hoeffding bound of THEORY 6.3,
  U_b = |B_b| min(e^{u_b}, mean + e^{u_b} sqrt(ln(#blocks / delta) / (2m))),
  union-bounded over the blocks; the samples are counted in keys_scored.

The search is a ``lax.while_loop`` over blocks per row. Under vmap (many
rows) XLA runs the rows in lockstep until the slowest stops, so on the XLA
path ``keys_scored`` is the work the search needed, which a kernel that
stops per row (Pallas) turns into time; the XLA path's wall time is bounded
by the slowest row.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.special import logsumexp

from jaxtopk import theory
from jaxtopk.selection import core
from jaxtopk.selection import threshold


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TableBlocks:
  """One row's key blocks where they lie in a shared pool of pages: block
  j is ``pool[table[j], head]`` (a paged cache's pages). A search reads the
  blocks it scores and nothing else (an array ``[nb, bs, d]`` of blocks
  would be a copy of the row).

  Attributes:
    pool: ``[pages, heads, bs, d]`` keys of every page.
    table: ``[nb]`` int32 page of each block of the row.
    head: ``[]`` int32 the row's head.
  """

  pool: jax.Array
  table: jax.Array
  head: jax.Array

  @property
  def shape(self) -> tuple[int, int, int]:
    return (self.table.shape[0], *self.pool.shape[2:])

  def __getitem__(self, idx) -> jax.Array:
    """``blocks[j]`` ``[bs, d]``; ``blocks[j, pos]`` keys of blocks ``j``
    at in-block positions ``pos`` (broadcast index arrays)."""
    j, *rest = idx if isinstance(idx, tuple) else (idx,)
    return self.pool[(self.table[j], self.head, *rest)]


def scored_search_row(
  q, kb, vb, log_mass, *, scale, log_eps, margin, capacity=None
):
  """Scores blocks of one row in decreasing ``log_mass`` until certified.

  Args:
    q: ``[d]`` query (compute dtype).
    kb: ``[nb, bs, d]`` keys in blocks (any float dtype; each block is cast
      to ``q``'s when read), or a ``TableBlocks``.
    vb: ``[nb, bs]`` bool real keys.
    log_mass: ``[nb]`` log of a sound upper bound on each block's mass
      sum_i e^{s_i} (-inf for empty blocks).
    scale: logit scale.
    log_eps: log of the budget eps.
    margin: log margin the search aims below eps
      (``core.search_log_margin``).
    capacity: static, at most this many blocks are scored (None: every
      block), and at most that share (capacity / nb) of the row's
      non-empty blocks. A row stops as soon as it cannot certify within its
      share (the blocks past it would hold too much bound even if the
      unscored ones of it held all of theirs).

  Returns:
    ``(buf, blocks, scored, log_unscored, certified)``: ``buf`` ``[c,
    bs]`` logits of the scored blocks in scoring order (0 past the last
    scored), ``blocks`` ``[c]`` the block each row of ``buf`` holds (``c``
    = capacity or nb), ``scored`` ``[nb]`` bool the scored blocks, the log
    of the summed ``log_mass`` of the unscored blocks and whether the
    search certified.
  """
  nb, bs, _ = kb.shape
  c = nb if capacity is None else min(capacity, nb)
  dt = q.dtype
  w, order = lax.top_k(log_mass, c)  # the c largest bounds, decreasing
  in_top = jnp.zeros((nb,), bool).at[order].set(True)
  rest = logsumexp(log_mass, where=~in_top & (log_mass > -jnp.inf))
  # suffix[j] = log sum of the bounds of blocks order[j:] and of the blocks
  # past the first c (``rest``); an estimate that only decides when to
  # stop (the unscored mass returned is summed afresh).
  suffix = jnp.logaddexp(lax.cumlogsumexp(w, axis=0, reverse=True), rest)
  suffix = jnp.concatenate([suffix, rest[None]])
  target = log_eps - margin
  reach = jnp.int32(nb)
  if capacity is not None:  # the row's share: c / nb of its real blocks
    full = jnp.sum(log_mass > -jnp.inf)
    reach = jnp.clip((full * c + nb - 1) // nb, 1, c).astype(jnp.int32)
  inside = jnp.arange(c) < reach
  top = lax.cumlogsumexp(jnp.where(inside, w, -jnp.inf), reverse=True)
  top = jnp.concatenate([top, jnp.full((1,), -jnp.inf, dt)])  # order[j:reach]
  past = jnp.logaddexp(rest, logsumexp(jnp.where(inside, -jnp.inf, w)))

  def certified(j, lse_s):
    un = suffix[j]
    return un - jnp.logaddexp(lse_s, un) <= target

  def hopeful(j, lse_s):
    """Could the row certify within its share, the unscored blocks of it
    holding their whole bound? (Else it stops: it will not.)"""
    return past - jnp.logaddexp(jnp.logaddexp(lse_s, top[j]), past) <= target

  def cond(state):
    j, lse_s, _ = state
    return (j < reach) & ~certified(j, lse_s) & hopeful(j, lse_s)

  def body(state):
    j, lse_s, buf = state
    blk = order[j]
    k = kb[blk].astype(dt)
    s = jnp.matmul(k, q, precision=core.PRECISION) * scale  # [bs]
    lse_b = logsumexp(s, where=vb[blk] & (s > -jnp.inf))
    return j + 1, jnp.logaddexp(lse_s, lse_b), buf.at[j].set(s)

  init = (jnp.int32(0), jnp.asarray(-jnp.inf, dt), jnp.zeros((c, bs), dt))
  j, lse_s, buf = lax.while_loop(cond, body, init)
  scored = jnp.zeros((nb,), bool).at[order].set(jnp.arange(c) < j)
  log_un = logsumexp(log_mass, where=~scored & (log_mass > -jnp.inf))
  return buf, order, scored, log_un, certified(j, lse_s)


def _keep_row(buf, scored, log_unscored, *, log_eps, margin, max_topk):
  """Fewest scored keys meeting eps (then capped at ``max_topk``)."""
  real = scored & (buf > -jnp.inf)
  keep = threshold.budget_mask(
    buf, log_eps - margin, real, log_unscored, relative=True
  )
  if max_topk is not None and max_topk < buf.shape[-1]:
    capped = threshold.topk_mask(buf, max_topk, real)
    over = jnp.sum(keep, -1, keepdims=True) > max_topk
    keep = jnp.where(over, capped, keep)
  return keep & real


def block_bounds(query, keys, valid, *, block_size, scale, use_ball=True):
  """Sound per-block logit bounds u_b (min of box and ball) and counts.

  Args:
    query: ``[..., d]``.
    keys: ``[..., n, d]``.
    valid: ``[..., n]`` bool.
    block_size: static block size.
    scale: positive logit scale.
    use_ball: also use the ball bound (THEORY 3.3; take the minimum).

  Returns:
    ``(u, count, box)``: ``[..., nb]`` bounds (-inf for empty blocks),
    ``[..., nb]`` int32 counts, and the BoxSummary.
  """
  box = theory.box_summary(keys, block_size=block_size, mask=valid)
  u = theory.box_upper_bound(query, box, scale=scale)
  if use_ball:
    ball = theory.ball_summary(keys, block_size=block_size, mask=valid)
    u = jnp.minimum(u, theory.ball_upper_bound(query, ball, scale=scale))
  return u, box.count, box


def box_abs_dot(query, box, scale) -> jax.Array:
  """``[..., g]`` scale * max over blocks of sum_c |q_c| max(|m_c|, |M_c|).

  Bounds scale * sum_c |q_c k_c| for every key in a non-empty block
  (``core.abs_dot_box`` over the block boxes, maximised over blocks).

  Args:
    query: ``[..., g, d]``, g queries sharing the keys (GQA group).
    box: BoxSummary with ``[..., n_blocks, d]`` arrays.
    scale: positive logit scale.

  Returns:
    ``[..., g]``.
  """
  a = jnp.maximum(jnp.abs(box.kmin), jnp.abs(box.kmax))  # [..., nb, d]
  per = core.abs_dot_box(query, a)  # [..., g, nb]
  per = jnp.where(box.count[..., None, :] > 0, per, 0.0)
  dt = per.dtype
  return scale * core.max_nan(per, -1) * (1 + 2 * jnp.finfo(dt).eps)


def box_upper_bound_dot(query, box, *, scale) -> jax.Array:
  """``theory.box_upper_bound`` written as dot products.

  sum_c max(q_c m_c, q_c M_c) = q^+ . M - q^- . m with q^+ = max(q, 0) and
  q^- = max(-q, 0), exactly; the float result gets a (d + 3) eps slack on a
  bound of sum_c |terms_c| (||q||_1 times the block's largest |m_c|, |M_c|)
  and a final relative round-up. On XLA:CPU this runs ~50x faster than the
  broadcast-multiply-reduce form for decode-sized caches (measured in
  BUILD_NOTES); the slack's bound is one fused reduction over the boxes,
  where the exact sum_c |terms_c| (a dot with |M| and |m|) made a copy of
  each (8 MiB at 131,072 keys, 8 heads; docs/performance.md).

  Args:
    query: ``[..., g, d]``, g queries sharing the keys (GQA group).
    box: BoxSummary with ``[..., n_blocks, d]`` arrays; an empty block's box
      is never read into the result (a cache's initial +-inf boxes need no
      zeroing).
    scale: positive logit scale.

  Returns:
    ``[..., g, n_blocks]`` upper bounds, -inf for empty blocks; +inf where
    the float sums overflow (a query whose |q|_1 exceeds the largest
    float: inf - inf would read NaN); NaN only for NaN inputs.
  """
  dt = box.kmin.dtype
  q = query.astype(dt)
  qp, qm = jnp.maximum(q, 0.0), jnp.maximum(-q, 0.0)
  ein = lambda x, y: jnp.einsum(  # noqa: E731
    "...gd,...nd->...gn", x, y, precision=core.PRECISION
  )
  u = ein(qp, box.kmax) - ein(qm, box.kmin)  # [..., nb]
  amax = core.max_nan(jnp.maximum(jnp.abs(box.kmin), jnp.abs(box.kmax)), -1)
  amax = amax[..., None, :]
  q1 = jnp.sum(jnp.abs(q), -1)[..., None]  # [..., g, 1]
  # >= sum_c |terms_c|; 0 for a block of zero keys (no inf x 0).
  abs_terms = jnp.where(amax > 0, q1 * amax, 0.0)
  d = q.shape[-1]
  eps = jnp.finfo(dt).eps
  u = scale * (u + (d + 3) * eps * abs_terms)
  u = u + jnp.abs(u) * 2 * eps
  u = jnp.where(jnp.isnan(u) & ~jnp.isnan(q1 + amax), jnp.inf, u)
  return jnp.where(box.count[..., None, :] > 0, u, -jnp.inf)


def _mc_log_mass_row(q, kb, vb, u, cnt, rng, *, scale, num_samples, delta):
  """Hoeffding upper bound (THEORY 6.3) on each block's mass; one row."""
  nb, bs, _ = kb.shape
  dt = q.dtype
  m = num_samples
  # Uniform ranks among the block's real keys, with replacement.
  r = jax.random.randint(rng, (nb, m), 0, jnp.maximum(cnt, 1)[:, None])
  csum = jnp.cumsum(vb, axis=-1)  # [nb, bs]
  pos = jnp.sum(csum[:, None, :] <= r[..., None], axis=-1)  # [nb, m]
  ks = kb[jnp.arange(nb)[:, None], pos].astype(dt)  # [nb, m, d]
  s = jnp.matmul(ks, q, precision=core.PRECISION) * scale  # [nb, m]
  c = jnp.max(jnp.where(cnt > 0, u, -jnp.inf))
  c = jnp.where(jnp.isfinite(c), c, 0.0)
  eu = jnp.exp(u - c)  # e^{u_b - c}
  # Sample terms e^{s - c} lie in [0, e^{u_b - c}]; a sample rounded above
  # u_b is clipped (u_b is a sound bound on the true logit).
  terms = jnp.minimum(jnp.exp(s - c), eu[:, None])
  mean = jnp.mean(terms, axis=-1)
  width = eu * jnp.sqrt(jnp.log(nb / delta) / (2 * m))
  per_key = jnp.minimum(eu, mean + width)
  # Round the estimate up: a mean of m terms in floats.
  per_key = per_key * (1 + (m + 8) * jnp.finfo(dt).eps)
  # The per-key level for blockwise_log_bound: cnt * e^{u'} = U_b. Where
  # e^{u_b - c} underflows (a block hundreds of logits below the best) the
  # estimate is 0 or subnormal and says nothing: keep the sure bound u_b.
  # The minimum of a sure and a (1 - delta) bound is a (1 - delta) bound.
  tiny = jnp.finfo(dt).tiny
  u_eff = jnp.where(per_key >= tiny, jnp.minimum(jnp.log(per_key) + c, u), u)
  u_eff = jnp.where(cnt > 0, u_eff, -jnp.inf)
  log_mass = u_eff + jnp.log(jnp.maximum(cnt, 1).astype(dt))
  return log_mass, u_eff


def mc_log_mass_row(q, kb, vb, u, cnt, rng, *, scale, num_samples, delta):
  """MC-Search's mass bound of every block of one row (THEORY 6.3).

  Documented internal API (the KV index's MC-Search over content groups
  uses it): from ``num_samples`` uniformly drawn real keys per block, with
  probability >= 1 - delta (union bound over the blocks) each block's mass
  is at most ``exp(log_mass)``; blocks where the estimate underflows keep
  their sure bound |B| e^{u_b}.

  Args:
    q: ``[d]`` query (compute dtype).
    kb: ``[nb, bs, d]`` keys of the blocks.
    vb: ``[nb, bs]`` bool real keys.
    u: ``[nb]`` sound logit bounds of the blocks (-inf if empty).
    cnt: ``[nb]`` real keys per block.
    rng: PRNG key.
    scale: logit scale.
    num_samples: samples per block.
    delta: failure probability.

  Returns:
    ``(log_mass, u_eff)``: ``[nb]`` log mass bounds and per-key levels.
  """
  return _mc_log_mass_row(
    q, kb, vb, u, cnt, rng, scale=scale, num_samples=num_samples, delta=delta
  )


def _row_bounds(q, kb, vb, u, cnt, logit_error, rng, *, search, eps, scale):
  """What a row's search starts from: ``(log_mass, u_eff, samples, delta,
  log_eps, margin)``, the blocks' mass bounds (Delta: |B| e^{u_b}; MC: the
  sampled bound) and per-key levels, the MC samples drawn, and the rounding
  terms of the certified condition."""
  nb = kb.shape[0]
  dt = q.dtype
  delta = jnp.asarray(logit_error, dt)
  log_eps = jnp.log(jnp.asarray(eps, dt))
  margin = core.search_log_margin(nb * kb.shape[1] + nb, delta, dt)
  if search.name == "delta":
    log_mass = jnp.where(
      cnt > 0, u + jnp.log(jnp.maximum(cnt, 1).astype(dt)), -jnp.inf
    )
    return log_mass, u, jnp.int32(0), delta, log_eps, margin
  if search.name != "mc":
    raise ValueError(f"{search=} must be DeltaSearch or MCSearch")
  log_mass, u_eff = _mc_log_mass_row(
    q,
    kb,
    vb,
    u,
    cnt,
    rng,
    scale=scale,
    num_samples=search.num_samples,
    delta=search.failure_prob,
  )
  samples = search.num_samples * jnp.sum(cnt > 0).astype(jnp.int32)
  return log_mass, u_eff, samples, delta, log_eps, margin


def _row_partial(
  buf,
  scored,
  vn,
  scored_blocks,
  log_un,
  u_eff,
  cnt,
  block_norms,
  *,
  delta,
  log_eps,
  margin,
  max_topk,
  extra_scored,
):
  """The kept set and PartialSoftmax of searched rows (``[..., n]``):
  ``buf``, ``scored`` and ``vn`` (or None) over the scored keys, in any
  order; the unscored blocks' bounds in the tail."""
  keep = _keep_row(
    buf,
    scored,
    log_un,
    log_eps=log_eps,
    margin=margin,
    max_topk=max_topk,
  )
  n_sc = jnp.sum(jnp.where(scored_blocks, cnt, 0), -1).astype(jnp.int32)
  part = core.PartialSoftmax.from_logits(
    buf,
    keep,
    scored,
    logit_error=delta,
    value_norms=vn,
    keys_scored=n_sc + extra_scored,
  )
  part = part.add_tail(
    u_eff + jnp.log(jnp.maximum(cnt, 1).astype(buf.dtype)),
    ~scored_blocks & (cnt > 0),
    norms=block_norms,
  )
  return keep, part


def _block_norms(value_norms, valid, block_size):
  """``[..., nb]`` largest value norm of each block's real keys (NaN kept);
  ``value_norms`` and ``valid`` ``[..., n]`` broadcast together."""
  if value_norms is None:
    return None
  vn = jnp.where(valid, value_norms, 0.0)
  return core.max_nan(vn.reshape(*vn.shape[:-1], -1, block_size), -1)


def search_row_partial(
  q,
  keys,
  valid,
  u,
  cnt,
  logit_error,
  rng,
  *,
  search,
  eps,
  scale,
  max_topk=None,
  value_norms=None,
  block_summary_keys=0,
):
  """Delta- or MC-Search for ONE row; see the module docstring.

  Args:
    q: ``[d]`` query (compute dtype).
    keys: ``[n, d]`` keys (n a multiple of ``search.block_size``), or a
      ``TableBlocks`` of the row's blocks.
    valid: ``[n]`` bool.
    u: ``[nb]`` sound bounds on the block's EXACT logits (-inf for empty
      blocks; add the logit error to bounds computed from flushed inputs).
    cnt: ``[nb]`` int32 real keys per block.
    logit_error: scalar delta of the scored logits
      (``core.logit_error_bound``).
    rng: PRNG key (used by MC-Search only).
    search: a ``DeltaSearch`` or ``MCSearch`` strategy.
    eps: TV budget.
    scale: logit scale.
    max_topk: optional cap on the kept set (``Certified.max_topk``).
    value_norms: optional ``[n]`` value norms (for the output bound).
    block_summary_keys: static key-equivalents read per non-empty block by
      the bounds ``u`` (THEORY 6.4: 2 for a box, 3 for a box and a ball;
      0 when the caller counts its own), added to ``keys_scored``.

  Returns:
    ``(logits, keep, scored, partial)``: ``[n]`` logits (0 where not
    scored), ``[n]`` bool kept and scored keys, and the row's
    ``core.PartialSoftmax`` (every scored key, plus the unscored blocks'
    bounds in its tail; ``keys_scored`` counts q.k products, MC samples and
    the block summaries included).
  """
  bs = search.block_size
  kb = _as_blocks(keys, bs)
  nb = kb.shape[0]
  vb = valid.reshape(nb, bs)
  log_mass, u_eff, samples, delta, log_eps, margin = _row_bounds(
    q, kb, vb, u, cnt, logit_error, rng, search=search, eps=eps, scale=scale
  )
  cbuf, blocks, sblk, log_un, _ = scored_search_row(
    q, kb, vb, log_mass, scale=scale, log_eps=log_eps, margin=margin
  )
  buf = jnp.zeros_like(cbuf).at[blocks].set(cbuf)  # [nb, bs], key order
  scored = (sblk[:, None] & vb).reshape(-1)
  buf = buf.reshape(-1)
  keep, part = _row_partial(
    buf,
    scored,
    value_norms,
    sblk,
    log_un,
    u_eff,
    cnt,
    _block_norms(value_norms, valid, bs),
    delta=delta,
    log_eps=log_eps,
    margin=margin,
    max_topk=max_topk,
    extra_scored=samples + block_summary_keys * jnp.sum(cnt > 0, -1),
  )
  return buf, keep, scored, part


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSearch:
  """Rows searched within a capacity of blocks (``search_row_compact``),
  before their kept set is chosen (``finish_compact``); leading ``[...]``.

  Attributes:
    logits: ``[..., c, bs]`` logits of the scored blocks in scoring order
      (0 past the last scored).
    blocks: ``[..., c]`` int32 the block each row of ``logits`` holds.
    scored_blocks: ``[..., nb]`` bool.
    log_unscored: ``[...]`` log of the unscored blocks' summed bounds.
    certified: ``[...]`` bool, the row certified within the capacity.
    u_eff: ``[..., nb]`` per-key bound level of each block (its tail term).
    samples: ``[...]`` int32 MC samples drawn.
    logit_error, log_eps, margin: ``[...]`` the rounding terms.
  """

  logits: jax.Array
  blocks: jax.Array
  scored_blocks: jax.Array
  log_unscored: jax.Array
  certified: jax.Array
  u_eff: jax.Array
  samples: jax.Array
  logit_error: jax.Array
  log_eps: jax.Array
  margin: jax.Array


def search_row_compact(
  q, keys, valid, u, cnt, logit_error, rng, *, search, eps, scale, capacity
) -> RowSearch:
  """``search_row_partial``'s scoring, at most ``capacity`` blocks and
  nothing kept of the others: work and memory O(capacity blocks), not
  O(n), where a row certifies early (a concentrated row). Args as
  ``search_row_partial``'s; ``capacity`` static. A row that does not
  certify within ``capacity`` blocks is not a search's result (run
  ``search_row_partial``); else ``finish_compact`` chooses its kept set."""
  bs = search.block_size
  kb = _as_blocks(keys, bs)
  vb = valid.reshape(kb.shape[0], bs)
  log_mass, u_eff, samples, delta, log_eps, margin = _row_bounds(
    q, kb, vb, u, cnt, logit_error, rng, search=search, eps=eps, scale=scale
  )
  cbuf, blocks, sblk, log_un, ok = scored_search_row(
    q,
    kb,
    vb,
    log_mass,
    scale=scale,
    log_eps=log_eps,
    margin=margin,
    capacity=capacity,
  )
  return RowSearch(
    cbuf, blocks, sblk, log_un, ok, u_eff, samples, delta, log_eps, margin
  )


def finish_compact(
  rs: RowSearch,
  valid,
  cnt,
  *,
  max_topk=None,
  value_norms=None,
  block_summary_keys=0,
):
  """The kept set and PartialSoftmax of rows ``rs`` (batched, ``[...]``).

  Args:
    rs: the rows' ``RowSearch``.
    valid: ``[..., n]`` bool real keys (broadcast against the rows).
    cnt: ``[..., nb]`` int32 real keys per block.
    max_topk: optional cap on the kept set.
    value_norms: optional ``[..., n]`` value norms (broadcast).
    block_summary_keys: as ``search_row_partial``'s.

  Returns:
    ``(logits, keep, scored, positions, partial)``: ``[..., c bs]`` logits,
    kept and scored flags of the scored blocks' keys (scoring order), their
    positions in the row, and the rows' PartialSoftmax.
  """
  lead, (c, bs) = rs.logits.shape[:-2], rs.logits.shape[-2:]
  pos = rs.blocks[..., None] * bs + jnp.arange(bs)  # [..., c, bs]
  pos = pos.reshape(*lead, c * bs)

  def at(x):  # x [..., n] at pos, broadcast to the rows
    x = jnp.broadcast_to(x, (*lead, x.shape[-1]))
    return jnp.take_along_axis(x, pos, -1)

  sblk = jnp.take_along_axis(rs.scored_blocks, rs.blocks, -1)  # [..., c]
  scored = at(valid) & jnp.repeat(sblk, bs, -1)
  vn = None if value_norms is None else at(value_norms)
  buf = rs.logits.reshape(*lead, c * bs)
  keep, part = _row_partial(
    buf,
    scored,
    vn,
    rs.scored_blocks,
    rs.log_unscored,
    rs.u_eff,
    cnt,
    _block_norms(value_norms, valid, bs),
    delta=rs.logit_error,
    log_eps=rs.log_eps,
    margin=rs.margin,
    max_topk=max_topk,
    extra_scored=rs.samples + block_summary_keys * jnp.sum(cnt > 0, -1),
  )
  return buf, keep, scored, pos, part


def _as_blocks(keys, block_size):
  """``[nb, bs, d]`` blocks of ``[n, d]`` keys (a view); a ``TableBlocks``
  as it is."""
  if isinstance(keys, TableBlocks):
    return keys
  n, d = keys.shape
  return keys.reshape(n // block_size, block_size, d)
