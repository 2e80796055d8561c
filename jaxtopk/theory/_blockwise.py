"""Blockwise tail bound and sound per-block logit upper bounds (THEORY 3.3).

Keys are split into contiguous blocks of ``block_size`` along the key axis
(the last block may be ragged: its missing keys count as padding). A block's
summary gives an upper bound u_b on every logit q.k_i * scale in the block
WITHOUT scoring it:

- box: per-dimension min m_c and max M_c of the block's keys,
  u_b = scale * sum_c max(q_c m_c, q_c M_c);
- ball: centre c_b (the mean) and radius r_b = max ||k_i - c_b||,
  u_b = scale * (q.c_b + ||q|| r_b).

Both are exact inequalities in real arithmetic; the float versions here are
rounded UP by a stated slack so that they remain above the float64 truth
(THEORY 3.4), both of the exact logits and of logits computed in the keys'
dtype (float32: a logit is off by at most (d + 2) eps scale sum_c |q_c k_c|).
``scale`` must be positive.

With S the scored keys and H a kept subset of S,
  Z_T <= sum_{i in S \\ H} e^{s_i} + sum_{b unscored} |B_b| e^{u_b} =: U,
  tau <= U / (Z_H + U).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array
from jaxtyping import ArrayLike
from jaxtyping import Bool
from jaxtyping import Float
from jaxtyping import Int

from jaxtopk.theory import _floats
from jaxtopk.theory import _rows
from jaxtopk.theory import _tail


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BoxSummary:
  """Per-block bounding boxes of keys.

  Attributes:
    kmin: ``[..., n_blocks, head_dim]`` per-dimension minimum over real keys.
    kmax: ``[..., n_blocks, head_dim]`` per-dimension maximum over real keys.
    count: ``[..., n_blocks]`` int32 number of real keys in the block.
  """

  kmin: jax.Array
  kmax: jax.Array
  count: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BallSummary:
  """Per-block bounding balls of keys.

  Attributes:
    centre: ``[..., n_blocks, head_dim]`` mean of the block's real keys.
    radius: ``[..., n_blocks]`` max distance of a real key to the centre,
      rounded up.
    count: ``[..., n_blocks]`` int32 number of real keys in the block.
  """

  centre: jax.Array
  radius: jax.Array
  count: jax.Array


def _blocked(keys, block_size, mask):
  """Pads the key axis to a multiple of block_size; returns blocked views."""
  keys = jnp.asarray(keys)
  if keys.ndim < 2:
    raise ValueError(f"keys must be [..., n_keys, head_dim]; got {keys.shape=}")
  if block_size < 1:
    raise ValueError(f"{block_size=} must be >= 1")
  *lead, n, d = keys.shape
  valid = (
    jnp.ones((*lead, n), bool)
    if mask is None
    else jnp.broadcast_to(jnp.asarray(mask, bool), (*lead, n))
  )
  n_blocks = -(-n // block_size)
  pad = n_blocks * block_size - n
  dt = _tail.compute_dtype(keys.dtype)
  keys = jnp.pad(keys.astype(dt), [(0, 0)] * len(lead) + [(0, pad), (0, 0)])
  valid = jnp.pad(valid, [(0, 0)] * len(lead) + [(0, pad)])
  kb = keys.reshape(*lead, n_blocks, block_size, d)  # [..., nb, bs, d]
  vb = valid.reshape(*lead, n_blocks, block_size)  # [..., nb, bs]
  return kb, vb


@functools.partial(jax.jit, static_argnames=("block_size",))
def box_summary(keys, *, block_size: int, mask=None) -> BoxSummary:
  """Per-block min/max boxes of ``keys`` (THEORY 3.3, box form).

  Args:
    keys: ``[..., n_keys, head_dim]``.
    block_size: keys per block (static); the last block may be ragged.
    mask: optional ``[..., n_keys]`` bool, False for padded keys.

  Returns:
    A BoxSummary with ``n_blocks = ceil(n_keys / block_size)``. A block with
    no real key has count 0 and a zero box.
  """
  kb, vb = _blocked(keys, block_size, mask)
  big = jnp.finfo(kb.dtype).max
  v = vb[..., None]
  # _floats.max_nan: a NaN key makes its block's box NaN (never skipped).
  kmin = -_floats.max_nan(jnp.where(v, -kb, -big), axis=-2)  # [..., nb, d]
  kmax = _floats.max_nan(jnp.where(v, kb, -big), axis=-2)  # [..., nb, d]
  count = jnp.sum(vb, axis=-1, dtype=jnp.int32)  # [..., nb]
  empty = (count == 0)[..., None]
  return BoxSummary(
    kmin=jnp.where(empty, 0.0, kmin),
    kmax=jnp.where(empty, 0.0, kmax),
    count=count,
  )


@functools.partial(jax.jit, static_argnames=("block_size",))
def ball_summary(keys, *, block_size: int, mask=None) -> BallSummary:
  """Per-block centre and radius of ``keys`` (THEORY 3.3, ball form).

  The radius is rounded up so that ||k_i - c|| <= r holds for the exact
  values of the keys and centre (``_floats.dist_up``: scaled norms, so
  coordinates below 1e-19, whose squares underflow, keep their distance).

  Args:
    keys: ``[..., n_keys, head_dim]``.
    block_size: keys per block (static); the last block may be ragged.
    mask: optional ``[..., n_keys]`` bool, False for padded keys.

  Returns:
    A BallSummary with ``n_blocks = ceil(n_keys / block_size)``.
  """
  kb, vb = _blocked(keys, block_size, mask)
  count = jnp.sum(vb, axis=-1, dtype=jnp.int32)  # [..., nb]
  v = vb[..., None]
  denom = jnp.maximum(count, 1)[..., None].astype(kb.dtype)
  centre = jnp.sum(jnp.where(v, kb, 0.0), axis=-2) / denom  # [..., nb, d]
  dist = _floats.dist_up(kb, centre[..., None, :])  # [..., nb, bs]
  radius = _floats.max_nan(jnp.where(vb, dist, 0.0), axis=-1)  # [..., nb]
  return BallSummary(centre=centre, radius=radius, count=count)


def _dot_slack(abs_terms_sum, d, dtype):
  """Upper bound on the rounding error of a d-term float dot product."""
  return (d + 2) * jnp.finfo(dtype).eps * abs_terms_sum


@jax.jit
def box_upper_bound(query, summary: BoxSummary, *, scale) -> jax.Array:
  """Sound upper bound on the logits of every block, from its box.

  u_b = scale * sum_c max(q_c m_c, q_c M_c) >= max_{i in B_b} scale q.k_i,
  rounded up. Empty blocks get -inf (they hold no mass).

  Args:
    query: ``[..., head_dim]``; leading axes broadcast against the summary's.
    summary: BoxSummary with ``[..., n_blocks, head_dim]`` boxes.
    scale: positive logit scale (e.g. 1/sqrt(head_dim)).

  Returns:
    ``[..., n_blocks]`` upper bounds in float32 (float64 for float64 input).
  """
  dt = summary.kmin.dtype
  q = jnp.asarray(query).astype(dt)[..., None, :]  # [..., 1, d]
  lo, hi = q * summary.kmin, q * summary.kmax  # [..., nb, d]
  terms = jnp.maximum(lo, hi)  # [..., nb, d]
  u = jnp.sum(terms, axis=-1)
  # Rounding of u itself, plus the rounding of any float logit q.k_i of the
  # block (|q_c k_ic| <= max(|q_c m_c|, |q_c M_c|)), so that u_b also bounds
  # logits computed in this dtype (THEORY 3.4).
  mag = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
  slack = _dot_slack(
    jnp.sum(jnp.abs(terms), axis=-1) + jnp.sum(mag, axis=-1), q.shape[-1], dt
  )
  u = scale * (u + slack)
  u = u + jnp.abs(u) * 2 * jnp.finfo(dt).eps
  return jnp.where(summary.count > 0, u, -jnp.inf)


@jax.jit
def ball_upper_bound(query, summary: BallSummary, *, scale) -> jax.Array:
  """Sound upper bound on the logits of every block, from its ball.

  u_b = scale * (q.c_b + ||q|| r_b) >= max_{i in B_b} scale q.k_i (Cauchy-
  Schwarz), rounded up. Norms are scaled (``_floats.norms_up``: no square
  overflows for |q_c| > 1.8e19 nor underflows for tiny ones) and the ball
  term scale ||q|| r_b is formed by ``_floats.mul_up`` (scale ||q|| may be
  subnormal while the product with r_b is of order one). Empty blocks get
  -inf.

  Args:
    query: ``[..., head_dim]``; leading axes broadcast against the summary's.
    summary: BallSummary with ``[..., n_blocks, head_dim]`` centres.
    scale: positive logit scale.

  Returns:
    ``[..., n_blocks]`` upper bounds in float32 (float64 for float64 input).
  """
  dt = summary.centre.dtype
  fi = jnp.finfo(dt)
  q_in = jnp.asarray(query)
  q = q_in.astype(dt)
  d = q.shape[-1]
  qn = _floats.norms_up(q_in)[..., None]  # [..., 1]
  prod = q[..., None, :] * summary.centre  # [..., nb, d]
  qc = jnp.sum(prod, axis=-1)  # [..., nb]
  cn = _floats.norms_up(summary.centre)  # [..., nb]
  r = summary.radius
  # Rounding of q.c, plus the rounding of any float logit q.k_i of the block
  # (sum_c |q_c k_ic| <= ||q|| (||c|| + r)), so that u_b also bounds logits
  # computed in this dtype (THEORY 3.4); and the terms lost to subnormal
  # components read as 0: sqrt(d) tiny (||c|| + r) where q has some, and
  # sqrt(d) tiny ||q|| for those of c or of the keys.
  # (Plain products: one that flushes is below tiny, which the final
  # (d + 4) tiny covers; one that overflows is an honest +inf.)
  mag = qn * (cn + r)
  q_sub = _floats.flushed(q_in)[..., None]  # [..., 1]
  lost_unit = (2 * d**0.5 + 2) * float(fi.tiny)  # a normal constant
  lost = lost_unit * (qn + 1) + jnp.where(q_sub, lost_unit * (cn + r), 0.0)
  slack = _dot_slack(jnp.sum(jnp.abs(prod), axis=-1) + mag, d, dt) + lost
  a = scale * (qc + slack)
  b = _floats.mul_up(scale, qn, r)  # the ball term, never flushed
  u = a + b
  u = u + (jnp.abs(a) + b) * 4 * fi.eps + (d + 4) * fi.tiny
  return jnp.where(summary.count > 0, u, -jnp.inf)


def blockwise_log_bound_row(
  logits, keep, scored, block_upper, block_count, mask=None, logit_error=0.0
) -> jax.Array:
  """log of the THEORY 3.3 bound for one row; see ``blockwise_bound``."""
  s = logits.astype(_tail.compute_dtype(logits.dtype))
  valid = jnp.ones(s.shape, bool) if mask is None else mask
  scored = jnp.asarray(scored, bool) & valid
  keep = jnp.asarray(keep, bool) & scored
  u = jnp.asarray(block_upper).astype(s.dtype)
  cnt = jnp.asarray(block_count)
  # A block whose bound is -inf provably holds no mass (NaN still counts).
  has = (cnt > 0) & (u != -jnp.inf)
  # Unscored block b contributes |B_b| e^{u_b}: one term u_b + log|B_b|.
  ub = u + jnp.log(jnp.maximum(cnt, 1).astype(s.dtype))
  # Reference: the largest term of either kind; NaN / +inf propagate.
  ref_s, ok_s = _rows.row_ref(s, scored)
  ref_u, ok_u = _rows.row_ref(ub, has)
  any_s = jnp.any(scored)
  any_u = jnp.any(has)
  ok = (ok_s | ~any_s) & (ok_u | ~any_u) & (any_s | any_u)
  ref = jnp.maximum(
    jnp.where(any_s, ref_s, -jnp.inf), jnp.where(any_u, ref_u, -jnp.inf)
  )
  ref = jnp.where(jnp.isfinite(ref), ref, 0.0)
  head = _rows.log_mass(s, keep, ref)
  tail_s = _rows.log_mass(s, scored & ~keep, ref)
  tail_u = _rows.log_mass(ub, has, ref)
  log_u = jnp.logaddexp(tail_s.log, tail_u.log)
  err = (
    head.err + tail_s.err + tail_u.err + jnp.abs(ub).max(initial=0.0, where=has)
  )
  n_terms = s.shape[-1] + cnt.shape[-1]
  out = _rows.finish_log_bound(log_u, head.log, err, n_terms, ok)
  # Logits off by at most delta: tail up by e^delta, head down by e^-delta,
  # so the odds and hence the bound grow by at most e^{2 delta}.
  delta = jnp.asarray(logit_error, s.dtype)
  return jnp.minimum(out + 2 * delta, 0.0)


@jax.jit
def blockwise_log_bound(
  logits: Float[ArrayLike, "*b n"],
  keep: Bool[ArrayLike, "*b n"],
  scored: Bool[ArrayLike, "*b n"],
  block_upper: Float[ArrayLike, "*b nb"],
  block_count: Int[ArrayLike, "*b nb"],
  mask: Bool[ArrayLike, "*b n"] | None = None,
  *,
  logit_error: Float[ArrayLike, "*b"] | None = None,
) -> Float[Array, "*b"]:
  """log of the blockwise tail bound over any leading axes (THEORY 3.3).

  Args:
    logits: ``[..., n_keys]``; only entries where ``scored`` is True are read.
    keep: ``[..., n_keys]`` bool kept set H; entries not scored are ignored
      (a key that was not scored cannot be kept).
    scored: ``[..., n_keys]`` bool, the keys S whose logits were computed.
    block_upper: ``[..., n_blocks]`` sound upper bounds u_b on the logits of
      the UNSCORED blocks (e.g. from ``box_upper_bound``).
    block_count: ``[..., n_blocks]`` number of real keys in each unscored
      block; 0 for blocks that were scored (their keys are in ``scored``).
    mask: optional ``[..., n_keys]`` bool, False for padded keys.
    logit_error: optional ``[...]`` (or scalar) bound delta on how far each
      given logit may be from the exact one (e.g.
      ``jaxtopk.selection.core.logit_error_of`` when the logits were
      computed in float32 from q and k); the bound then
      holds for the exact logits: log bound + 2 delta (tail up, head down).
      Without it the bound holds for the logits as given.

  Returns:
    ``[...]`` log of an upper bound on tau, rounded up; 0 (tau <= 1) when
    nothing is kept, -inf when no real mass lies outside H; NaN for a row
    with no distribution (no real key, or a NaN / +inf real logit or bound).
  """
  logits = jnp.asarray(logits)
  _tail.check_same_shape(logits, keep=keep, scored=scored, mask=mask)
  if jnp.shape(block_upper) != jnp.shape(block_count):
    raise ValueError(
      f"block_upper has shape {jnp.shape(block_upper)} but block_count has"
      f" shape {jnp.shape(block_count)}; they must match."
    )
  _rows.check_has_key_axis(logits)
  valid = _tail._valid(logits, mask)
  dt = _tail.compute_dtype(logits.dtype)
  delta = jnp.broadcast_to(
    jnp.asarray(0.0 if logit_error is None else logit_error, dt),
    logits.shape[:-1],
  )
  return _rows.apply_rows(
    blockwise_log_bound_row,
    0,
    (),
    logits,
    keep,
    scored,
    block_upper,
    block_count,
    valid,
    delta,
  )


def blockwise_bound(
  logits: Float[ArrayLike, "*b n"],
  keep: Bool[ArrayLike, "*b n"],
  scored: Bool[ArrayLike, "*b n"],
  block_upper: Float[ArrayLike, "*b nb"],
  block_count: Int[ArrayLike, "*b nb"],
  mask: Bool[ArrayLike, "*b n"] | None = None,
  *,
  logit_error: Float[ArrayLike, "*b"] | None = None,
) -> Float[Array, "*b"]:
  """Upper bound on tau from scored keys plus unscored block bounds.

  THEORY 3.3: tau <= U / (Z_H + U) with
  U = sum_{scored, not kept} e^{s_i} + sum_{unscored blocks} |B_b| e^{u_b}.
  Sound whenever every u_b bounds its block's logits (use ``box_upper_bound``
  or ``ball_upper_bound``, or their minimum). See ``blockwise_log_bound`` for
  the arguments.

  Returns:
    ``[...]`` upper bound on tau in float32 (float64 for float64 input); at
    least the smallest normal number when positive (XLA flushes subnormals),
    so use ``blockwise_log_bound`` for tiny tails.
  """
  return _rows.exp_up(
    blockwise_log_bound(
      logits,
      keep,
      scored,
      block_upper,
      block_count,
      mask,
      logit_error=logit_error,
    )
  )
