"""Delta-Search and MC-Search: certify while scoring only some key blocks.

THEORY 6.2 (Delta-Search, deterministic) and 6.3 (MC-Search, holds with
probability >= 1 - delta). Both order the key blocks by an upper bound on
their mass, score whole blocks in that order (one q.k product per real key,
counted in ``keys_scored``), and stop as soon as the THEORY 3.3 bound with
every scored key kept certifies tau <= eps:

    U_unscored / (Z_scored + U_unscored) <= eps.

Then, among the scored keys, the smallest kept set that still meets eps is
found by the radix threshold search with U_unscored as fixed extra tail
(``budget_mask``). The returned certificate is
``jaxtopk.theory.blockwise_log_bound`` of that kept set, rounded up for the
float rounding of the scored logits.

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

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.special import logsumexp

from jaxtopk.selection import _certify
from jaxtopk.selection import _threshold
from jaxtopk.theory import _blockwise
from jaxtopk.theory import _tail


def search_margin(n, dt, log_extra_slack):
  """Log margin the searches aim below eps (see ``certified_log_budget``)."""
  return 3 * _tail.log_slack(n, dt) + 2 * log_extra_slack


def scored_search_row(q, kb, vb, log_mass, *, scale, log_eps, log_extra_slack):
  """Scores blocks of one row in decreasing ``log_mass`` until certified.

  Args:
    q: ``[d]`` query (compute dtype).
    kb: ``[nb, bs, d]`` keys in blocks.
    vb: ``[nb, bs]`` bool real keys.
    log_mass: ``[nb]`` log of a sound upper bound on each block's mass
      sum_i e^{s_i} (-inf for empty blocks).
    scale: logit scale.
    log_eps: log of the budget eps.
    log_extra_slack: scalar slack the final certificate will add.

  Returns:
    ``(buf, scored_block, log_unscored)``: ``buf`` ``[nb, bs]`` logits of
    the scored blocks (0 elsewhere), ``scored_block`` ``[nb]`` bool and the
    log of the summed ``log_mass`` of the unscored blocks.
  """
  nb, bs, _ = kb.shape
  dt = q.dtype
  order = jnp.argsort(-log_mass)  # [nb] blocks, largest bound first
  w = log_mass[order]
  # suffix[j] = log sum of the bounds of blocks order[j:], suffix[nb] = -inf
  suffix = lax.cumlogsumexp(w, axis=0, reverse=True)
  suffix = jnp.concatenate([suffix, jnp.full((1,), -jnp.inf, dt)])
  margin = search_margin(nb * bs + nb, dt, log_extra_slack)
  target = log_eps - margin

  def certified(j, lse_s):
    un = suffix[j]
    return un - jnp.logaddexp(lse_s, un) <= target

  def cond(state):
    j, lse_s, _ = state
    return (j < nb) & ~certified(j, lse_s)

  def body(state):
    j, lse_s, buf = state
    blk = order[j]
    s = (kb[blk] @ q) * scale  # [bs]
    lse_b = logsumexp(s, where=vb[blk])
    return j + 1, jnp.logaddexp(lse_s, lse_b), buf.at[blk].set(s)

  init = (jnp.int32(0), jnp.asarray(-jnp.inf, dt), jnp.zeros((nb, bs), dt))
  j, _, buf = lax.while_loop(cond, body, init)
  rank = jnp.zeros((nb,), jnp.int32).at[order].set(jnp.arange(nb))
  return buf, rank < j, suffix[j]


def _finish_row(q, kb, vb, u, cnt, buf, scored_block, log_unscored, **kw):
  """Kept set among the scored keys and its blockwise log bound."""
  log_eps, slack = kw["log_eps"], kw["log_extra_slack"]
  nb, bs = vb.shape
  dt = q.dtype
  scored = scored_block[:, None] & vb  # [nb, bs]
  lse_s = logsumexp(buf, where=scored)
  margin = search_margin(nb * bs + nb, dt, slack)
  log_budget = log_eps + jnp.logaddexp(lse_s, log_unscored) - margin
  keep = _threshold.budget_mask(
    buf.reshape(-1), log_budget, scored.reshape(-1), log_unscored
  )
  unsc_cnt = jnp.where(scored_block, 0, cnt)
  log_tv = _blockwise.blockwise_log_bound_row(
    buf.reshape(-1),
    keep,
    scored.reshape(-1),
    u,
    unsc_cnt,
    vb.reshape(-1),
  )
  log_tv = log_tv + slack
  return keep, scored.reshape(-1), jnp.minimum(log_tv, 0.0)


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
  box = _blockwise.box_summary(keys, block_size=block_size, mask=valid)
  u = _blockwise.box_upper_bound(query, box, scale=scale)
  if use_ball:
    ball = _blockwise.ball_summary(keys, block_size=block_size, mask=valid)
    u = jnp.minimum(u, _blockwise.ball_upper_bound(query, ball, scale=scale))
  return u, box.count, box


def box_abs_dot(query, box, scale) -> jax.Array:
  """``[...]`` scale * max over blocks of sum_c |q_c| max(|m_c|, |M_c|).

  Bounds scale * sum_c |q_c k_c| for every key in a non-empty block, for the
  logit rounding slack (``_certify.logit_rounding``).

  Args:
    query: ``[..., g, d]``, g queries sharing the keys (GQA group).
    box: BoxSummary with ``[..., n_blocks, d]`` arrays.
    scale: positive logit scale.

  Returns:
    ``[..., g]``.
  """
  a = jnp.maximum(jnp.abs(box.kmin), jnp.abs(box.kmax))  # [..., nb, d]
  # An einsum, not sum(|q|[..., None, :] * a, -1): XLA:CPU runs that
  # broadcast-multiply-reduce ~50x slower than the equivalent dot.
  per = jnp.einsum("...gd,...nd->...gn", jnp.abs(query), a)  # [..., g, nb]
  per = jnp.where(box.count[..., None, :] > 0, per, 0.0)
  d = a.shape[-1]
  return scale * jnp.max(per, -1) * (1 + (d + 4) * jnp.finfo(per.dtype).eps)


def box_upper_bound_dot(query, box, *, scale) -> jax.Array:
  """``theory.box_upper_bound`` written as dot products (same bound).

  sum_c max(q_c m_c, q_c M_c) = q^+ . M - q^- . m with q^+ = max(q, 0) and
  q^- = max(-q, 0), exactly; the float result gets the same
  (d + 2) eps sum|terms| dot-product slack and a final relative round-up.
  On XLA:CPU this runs ~50x faster than the broadcast-multiply-reduce form
  for decode-sized caches (measured in BUILD_NOTES).

  Args:
    query: ``[..., g, d]``, g queries sharing the keys (GQA group).
    box: BoxSummary with ``[..., n_blocks, d]`` arrays.
    scale: positive logit scale.

  Returns:
    ``[..., g, n_blocks]`` upper bounds, -inf for empty blocks.
  """
  dt = box.kmin.dtype
  q = query.astype(dt)
  qp, qm = jnp.maximum(q, 0.0), jnp.maximum(-q, 0.0)
  ein = lambda x, y: jnp.einsum("...gd,...nd->...gn", x, y)
  u = ein(qp, box.kmax) - ein(qm, box.kmin)  # [..., nb]
  abs_terms = ein(qp, jnp.abs(box.kmax)) + ein(qm, jnp.abs(box.kmin))
  d = q.shape[-1]
  eps = jnp.finfo(dt).eps
  u = scale * (u + (d + 3) * eps * abs_terms)
  u = u + jnp.abs(u) * 2 * eps
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
  ks = jnp.take_along_axis(kb, pos[..., None], axis=1)  # [nb, m, d]
  s = (ks @ q) * scale  # [nb, m]
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


def search_row(
  q,
  keys,
  valid,
  u,
  cnt,
  abs_dot,
  rng,
  *,
  search,
  eps,
  block_size,
  scale,
  num_samples=8,
  delta=0.01,
):
  """Delta- or MC-Search for ONE row; see the module docstring.

  Args:
    q: ``[d]`` query (compute dtype).
    keys: ``[n, d]`` keys (n a multiple of block_size).
    valid: ``[n]`` bool.
    u: ``[nb]`` sound block logit bounds (-inf for empty blocks).
    cnt: ``[nb]`` int32 real keys per block.
    abs_dot: scalar >= scale * max_i sum_c |q_c k_ic| (logit rounding).
    rng: PRNG key (used by 'mc' only).
    search: 'delta' or 'mc'.
    eps: TV budget.
    block_size: static block size.
    scale: logit scale.
    num_samples: MC samples per block.
    delta: MC failure probability.

  Returns:
    ``(logits, keep, scored, log_tv, keys_scored)``: ``[n]`` logits (0 where
    not scored), ``[n]`` bool kept and scored keys, scalar log tau bound and
    int32 number of q.k products.
  """
  n, d = keys.shape
  nb = n // block_size
  dt = q.dtype
  kb = keys.astype(dt).reshape(nb, block_size, d)
  vb = valid.reshape(nb, block_size)
  # |s_i| <= abs_dot for every key (and |u_b| <= abs_dot): rounding of the
  # scored logits (2 delta) plus the magnitude slack of the log-sum-exps.
  slack = 2 * _certify.logit_rounding(abs_dot, d + 1, dt)
  slack = slack + 8 * jnp.finfo(dt).eps * abs_dot
  log_eps = jnp.log(jnp.asarray(eps, dt))
  n_samp = jnp.int32(0)
  if search == "delta":
    log_mass = jnp.where(
      cnt > 0, u + jnp.log(jnp.maximum(cnt, 1).astype(dt)), -jnp.inf
    )
    u_eff = u
  elif search == "mc":
    log_mass, u_eff = _mc_log_mass_row(
      q, kb, vb, u, cnt, rng, scale=scale, num_samples=num_samples, delta=delta
    )
    n_samp = num_samples * jnp.sum(cnt > 0).astype(jnp.int32)
  else:
    raise ValueError(f"{search=} must be 'delta' or 'mc'")
  buf, sblk, log_un = scored_search_row(
    q, kb, vb, log_mass, scale=scale, log_eps=log_eps, log_extra_slack=slack
  )
  keep, scored, log_tv = _finish_row(
    q,
    kb,
    vb,
    u_eff,
    cnt,
    buf,
    sblk,
    log_un,
    log_eps=log_eps,
    log_extra_slack=slack,
  )
  n_sc = jnp.sum(jnp.where(sblk, cnt, 0)).astype(jnp.int32)
  return buf.reshape(-1), keep, scored, log_tv, n_sc + n_samp
