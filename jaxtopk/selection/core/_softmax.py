"""Softmax statistics: ``PartialSoftmax``, the mergeable state of part of a
row's keys, its merges and the online (flash) step
(``jaxtopk.selection.core``).
"""

import dataclasses

import jax
import jax.numpy as jnp

from jaxtopk.selection._certificate import Certificate
from jaxtopk.selection.core._finish import finish_certificate
from jaxtopk.selection.core._finish import logits_ok
from jaxtopk.selection.core._finish import row_valid
from jaxtopk.selection.core._finish import tail_log_bound
from jaxtopk.selection.core._finish import tv_up
from jaxtopk.selection.core._numerics import _EXP_ULPS
from jaxtopk.selection.core._numerics import _eps
from jaxtopk.selection.core._numerics import _leaf_err
from jaxtopk.selection.core._numerics import _log_tiny_inv
from jaxtopk.selection.core._numerics import compute_dtype
from jaxtopk.selection.core._numerics import log_slack
from jaxtopk.selection.core._numerics import max_norm


def _log_sum_exp_parts(x, where):
  """(max, sum e^{x - max}) over the last axis; (-inf, 0) when empty."""
  m = jnp.max(jnp.where(where, x, -jnp.inf), axis=-1, initial=-jnp.inf)
  ms = jnp.where(m > -jnp.inf, m, 0.0)
  ms = jax.lax.stop_gradient(jnp.where(jnp.isfinite(ms), ms, 0.0))
  ms = ms[..., None]
  e = jnp.where(where, jnp.exp(jnp.where(where, x, ms) - ms), 0.0)
  return m, jnp.sum(e, axis=-1), e


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PartialSoftmax:
  """PartialSoftmax softmax statistics of part of a row's keys, mergeable.

  The state of a blockwise (flash) prefill, a split-K decode, a kernel's
  output or one KV shard: everything a Certificate needs, for the keys seen
  so far. Masses are kept as (max, sum relative to max) pairs, so nothing
  underflows (a tail 100 logits below the head still has its own max) and
  merges do not accumulate the magnitude of the logits into the error.

  Attributes:
    o: ``[..., d_v]`` NORMALISED output over the kept keys, sum_H p_i v_i /
      sum_H p_i (a convex combination of kept values: it overflows only if a
      value is within a few ulps of the largest float); zeros when nothing
      is kept; None when no output is carried.
    m: ``[...]`` largest kept logit; -inf when nothing is kept.
    denom: ``[...]`` sum over kept keys of e^{s_i - m}; 0 when nothing is kept.
    tail_m: ``[...]`` largest log mass term of the dropped part (a dropped
      logit, or log(|B| e^{u_B}) for an unscored block); -inf if none.
    tail_sum: ``[...]`` sum of e^{term - tail_m} over the dropped part.
    err: ``[...]`` rounding of log denom and log tail_sum, in units of eps.
    logit_error: ``[...]`` delta bounding |computed - exact| for every logit
      that entered (``logit_error_bound``); unscored bounds already bound
      exact logits.
    k_kept: ``[...]`` int32 kept real keys of positive mass.
    keys_scored: ``[...]`` int32 q.k products computed.
    head_norm: ``[...]`` max kept value norm, or None.
    tail_norm: ``[...]`` max dropped (or unscored) value norm, or None.
    logits_ok: ``[...]`` bool, no real logit seen is NaN or +inf (and, when
      norms are carried, no real value is non-finite).
  """

  o: jax.Array | None
  m: jax.Array
  denom: jax.Array
  tail_m: jax.Array
  tail_sum: jax.Array
  err: jax.Array
  logit_error: jax.Array
  k_kept: jax.Array
  keys_scored: jax.Array
  head_norm: jax.Array | None
  tail_norm: jax.Array | None
  logits_ok: jax.Array

  @property
  def log_head(self) -> jax.Array:
    """``[...]`` log Z_H (absolute; -inf when nothing is kept)."""
    return self.m + jnp.log(self.denom)

  @property
  def log_tail(self) -> jax.Array:
    """``[...]`` log of the tail bound (absolute; -inf when empty)."""
    return self.tail_m + jnp.log(self.tail_sum)

  @classmethod
  def from_logits(
    cls,
    logits,
    keep,
    real,
    *,
    logit_error=0.0,
    value_fn=None,
    value_norms=None,
    keys_scored=None,
  ) -> "PartialSoftmax":
    """Statistics of one block of scored keys.

    Args:
      logits: ``[..., n]`` computed logits (stop-gradient is the caller's
        choice: gradients flow through ``o`` via ``value_fn``).
      keep: ``[..., n]`` bool kept set (masked and -inf keys are ignored).
      real: ``[..., n]`` bool real keys.
      logit_error: ``[...]`` delta of these logits (0 if exact).
      value_fn: optional ``p -> sum_i p_i v_i``, called with the normalised
        kept weights ``[..., n]`` (each <= 1, summing to 1), returning
        ``[..., d_v]``: the caller's einsum (any layout).
      value_norms: optional ``[..., n]`` (broadcastable) ``value_norms``.
      keys_scored: ``[...]`` int; default the number of real keys.

    Returns:
      A PartialSoftmax with leading shape ``[...]``.
    """
    s = jnp.asarray(logits)
    dt = compute_dtype(s.dtype)
    s = s.astype(dt)
    real = jnp.broadcast_to(jnp.asarray(real, bool), s.shape)
    pos = real & (s > -jnp.inf)  # keys with (possible) mass
    ok = logits_ok(s, real)
    keep = jnp.asarray(keep, bool) & pos
    tail = pos & ~keep
    m, denom, e = _log_sum_exp_parts(s, keep)
    tm, tl, _ = _log_sum_exp_parts(jax.lax.stop_gradient(s), tail)
    o = None
    if value_fn is not None:
      p = e / jnp.where(denom > 0, denom, 1.0)[..., None]
      o = value_fn(p)
    head_norm = tail_norm = None
    if value_norms is not None:
      vn = jnp.broadcast_to(jnp.asarray(value_norms, dt), s.shape)
      head_norm = max_norm(vn, keep)
      tail_norm = max_norm(vn, tail)
      ok = ok & ~jnp.any(real & jnp.isnan(vn), axis=-1)
    lead = s.shape[:-1]
    if keys_scored is None:
      keys_scored = jnp.sum(real, axis=-1, dtype=jnp.int32)
    return cls(
      o=o,
      m=jax.lax.stop_gradient(m),
      denom=denom,
      tail_m=tm,
      tail_sum=tl,
      err=jnp.full(lead, _leaf_err(dt), dt),
      logit_error=jnp.broadcast_to(jnp.asarray(logit_error, dt), lead),
      k_kept=jnp.sum(keep, axis=-1, dtype=jnp.int32),
      keys_scored=jnp.broadcast_to(keys_scored, lead).astype(jnp.int32),
      head_norm=head_norm,
      tail_norm=tail_norm,
      logits_ok=ok,
    )

  @classmethod
  def from_dropped(
    cls,
    logits,
    where,
    *,
    logit_error=0.0,
    value_norms=None,
    d_v=None,
    group=None,
    logits_ok=None,
  ) -> "PartialSoftmax":
    """Statistics of scored keys that are all dropped (nothing kept).

    ``from_logits`` with an empty kept set, in two passes over the logits
    (the tail's max, then its sum), as a path needs for the keys it never
    keeps (e.g. below a bracket). With ``group`` the row is read as strided
    columns (``[..., group, n / group]``, column j holding positions j + k n
    / group): each column's statistics come from a reduction over the major
    axis, which XLA:CPU vectorises (~2x faster than over the row), and the
    columns are merged by ``PartialSoftmax.reduce`` (its rounding tracked).

    Args:
      logits: ``[..., n]`` computed logits.
      where: ``[..., n]`` bool, the dropped real keys (masked keys False; a
        -inf logit has no mass, a NaN or +inf one makes the row invalid).
      logit_error: ``[...]`` delta of these logits.
      value_norms: optional ``[..., n]`` (broadcastable) ``value_norms``.
      d_v: value dim: the PartialSoftmax carries a zero output of that size
        (to merge with one that carries an output), or None.
      group: optional static column height (must divide n).
      logits_ok: optional ``[...]`` bool, the caller's own ``logits_ok`` of
        the row (e.g. from its row max: a NaN or +inf logit makes the max NaN
        or +inf); saves the check's pass.

    Returns:
      A PartialSoftmax with leading shape ``[...]``, ``k_kept`` and
      ``keys_scored``
      0.
    """
    s = jnp.asarray(logits)
    dt = compute_dtype(s.dtype)
    s = jax.lax.stop_gradient(s.astype(dt))
    lead, n = s.shape[:-1], s.shape[-1]
    where = jnp.broadcast_to(jnp.asarray(where, bool), s.shape)
    vn = None
    if value_norms is not None:
      vn = jnp.broadcast_to(jnp.asarray(value_norms, dt), s.shape)
    ax = -1
    if group is not None:
      if n % group:
        raise ValueError(f"{group=} must divide the key axis {n=}")
      cols = lambda x: x.reshape(*lead, group, n // group)  # noqa: E731
      s, where = cols(s), cols(where)
      vn = None if vn is None else cols(vn)
      ax = -2
    if logits_ok is None:
      ok = ~jnp.any(where & (jnp.isnan(s) | (s == jnp.inf)), axis=ax)
    elif group is None:
      ok = jnp.asarray(logits_ok, bool)
    else:
      ok = jnp.asarray(logits_ok, bool)[..., None]
    pos = where & (s > -jnp.inf)
    tm = jnp.max(jnp.where(pos, s, -jnp.inf), axis=ax, initial=-jnp.inf)
    ms = jnp.where(jnp.isfinite(tm), tm, 0.0)
    e = jnp.exp(
      jnp.where(pos, s, jnp.expand_dims(ms, ax)) - jnp.expand_dims(ms, ax)
    )
    tl = jnp.sum(jnp.where(pos, e, 0.0), axis=ax)
    shape = tm.shape
    # The empty head, as constants. Where columns are merged (``reduce``),
    # they pass an optimization barrier: XLA would otherwise evaluate their
    # reductions at compile time, one entry at a time (constant folding:
    # 45-50 s of compile for 2,048 folded query rows over 32,768 keys,
    # 2-5 s at 4,096 rows over 8,192); at run time they cost a pass over
    # n / group entries.
    head = dict(
      m=jnp.full(shape, -jnp.inf, dt),
      denom=jnp.zeros(shape, dt),
      err=jnp.full(shape, _leaf_err(dt), dt),
      k_kept=jnp.zeros(shape, jnp.int32),
      keys_scored=jnp.zeros(shape, jnp.int32),
      head_norm=None if vn is None else jnp.zeros(shape, dt),
    )
    if group is not None:
      head = jax.lax.optimization_barrier(head)
    tail_norm = None
    if vn is not None:
      tail_norm = max_norm(
        jnp.moveaxis(vn, ax, -1), jnp.moveaxis(where, ax, -1)
      )
      ok = ok & ~jnp.any(where & jnp.isnan(vn), axis=ax)
    part = cls(
      **head,
      o=None,  # nothing kept: zeros, attached after the columns merge
      tail_m=tm,
      tail_sum=tl,
      logit_error=jnp.broadcast_to(
        jnp.asarray(logit_error, dt)[..., None] if group else logit_error,
        shape,
      ).astype(dt),
      tail_norm=tail_norm,
      logits_ok=jnp.broadcast_to(ok, shape),
    )
    if group is not None:
      part = PartialSoftmax.reduce(part, -1)
    if d_v is None:
      return part
    # Not merged as columns: a [..., n / group, d_v] block of zeros through
    # the barrier and the merge came out holding NaNs at XLA:CPU's default
    # optimization level (d_v >= 512; jax 0.10), and cost a pass of its own.
    o = jnp.zeros((*part.m.shape, d_v), dt)
    return dataclasses.replace(part, o=o)

  @classmethod
  def empty(cls, shape, dtype=jnp.float32, *, d_v=None, norms=False):
    """The identity of ``merge``: nothing seen (a loop's initial carry).

    Args:
      shape: leading shape ``[...]``.
      dtype: compute dtype.
      d_v: value dim when an output is carried (``o`` zeros), else None.
      norms: whether value norms are carried.
    """
    dt = compute_dtype(dtype)
    z = jnp.zeros(shape, dt)
    ninf = jnp.full(shape, -jnp.inf, dt)
    return cls(
      o=None if d_v is None else jnp.zeros((*shape, d_v), dt),
      m=ninf,
      denom=z,
      tail_m=ninf,
      tail_sum=z,
      err=z,
      logit_error=z,
      k_kept=jnp.zeros(shape, jnp.int32),
      keys_scored=jnp.zeros(shape, jnp.int32),
      head_norm=z if norms else None,
      tail_norm=z if norms else None,
      logits_ok=jnp.ones(shape, bool),
    )

  @classmethod
  def from_stats(
    cls,
    m,
    denom,
    *,
    tail=False,
    o=None,
    err=None,
    logit_error=0.0,
    k_kept=0,
    keys_scored=0,
    head_norm=None,
    tail_norm=None,
    logits_ok=True,
  ) -> "PartialSoftmax":
    """Statistics of keys summed elsewhere, e.g. by a Pallas kernel.

    For a part whose mass was computed as (max, sum of e^{s - max}) outside
    ``from_logits``: a kernel's block log-sum-exps, or the running head of
    an ``online_step`` loop. ``m`` may hold a finite mask value where
    nothing was seen (``denom`` 0): such entries become empty (-inf).

    Args:
      m: ``[...]`` max logit of the part.
      denom: ``[...]`` sum over the part of e^{s_i - m} (0 if empty).
      tail: False for kept keys (the head), True for dropped ones.
      o: ``[..., d_v]`` normalised output of the head, or None.
      err: ``[...]`` rounding of ``denom`` in units of eps (an
        ``online_step`` loop's); default one leaf (each term computed once
        relative to ``m``, as ``from_logits``).
      logit_error: ``[...]`` delta of the logits that entered.
      k_kept: ``[...]`` int kept real keys (0 for a tail part).
      keys_scored: ``[...]`` int q.k products computed.
      head_norm: ``[...]`` max kept value norm (None: no norms carried).
      tail_norm: ``[...]`` max dropped value norm (with ``head_norm``).
      logits_ok: ``[...]`` bool, no NaN / +inf real logit or broken value.

    Returns:
      A PartialSoftmax with leading shape ``m.shape``.
    """
    m = jnp.asarray(m)
    dt = compute_dtype(m.dtype)
    m = m.astype(dt)
    denom = jnp.asarray(denom, dt)
    has = denom > 0
    m = jnp.where(has, m, -jnp.inf)
    denom = jnp.where(has, denom, 0.0)
    shape = m.shape
    if err is None:
      err = jnp.full(shape, _leaf_err(dt), dt)
    ninf = jnp.full(shape, -jnp.inf, dt)
    zero = jnp.zeros(shape, dt)
    if (head_norm is None) != (tail_norm is None):
      raise ValueError("from_stats: give head_norm and tail_norm, or neither")
    norms = {}
    if head_norm is not None:
      norms = dict(
        head_norm=jnp.broadcast_to(jnp.asarray(head_norm, dt), shape),
        tail_norm=jnp.broadcast_to(jnp.asarray(tail_norm, dt), shape),
      )
    if o is not None:
      o = jnp.where(has[..., None], jnp.asarray(o).astype(dt), 0.0)
    return cls(
      o=o,
      m=ninf if tail else m,
      denom=zero if tail else denom,
      tail_m=m if tail else ninf,
      tail_sum=denom if tail else zero,
      err=jnp.broadcast_to(jnp.asarray(err, dt), shape),
      logit_error=jnp.broadcast_to(jnp.asarray(logit_error, dt), shape),
      k_kept=jnp.broadcast_to(jnp.asarray(k_kept, jnp.int32), shape),
      keys_scored=jnp.broadcast_to(jnp.asarray(keys_scored, jnp.int32), shape),
      head_norm=norms.get("head_norm"),
      tail_norm=norms.get("tail_norm"),
      logits_ok=jnp.broadcast_to(jnp.asarray(logits_ok, bool), shape),
    )

  def add_tail(self, log_terms, where, *, norms=None) -> "PartialSoftmax":
    """Adds upper bounds on the mass of unscored keys to the tail.

    Args:
      log_terms: ``[..., nb]`` log of a sound upper bound on each unscored
        block's mass (e.g. u_b + log|B_b|, u_b a box bound on its EXACT
        logits); NaN or +inf makes the row invalid.
      where: ``[..., nb]`` bool, the blocks that hold real keys and were not
        scored.
      norms: optional ``[..., nb]`` max value norm of each block's real keys
        (required when this PartialSoftmax carries norms).

    Returns:
      A PartialSoftmax with the terms merged into its tail.
    """
    dt = self.m.dtype
    x = jnp.asarray(log_terms).astype(dt)
    where = jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
    where = where & (x > -jnp.inf)
    bad = jnp.any(where & (jnp.isnan(x) | (x == jnp.inf)), axis=-1)
    tm, tl, _ = _log_sum_exp_parts(jax.lax.stop_gradient(x), where)
    tail_norm = self.tail_norm
    if tail_norm is not None:
      if norms is None:
        raise ValueError(
          "add_tail needs norms=: this PartialSoftmax carries norms"
        )
      tail_norm = jnp.maximum(tail_norm, max_norm(norms, where))
    pm = jnp.stack([self.tail_m, tm])
    m, denom, _ = _rescale(pm, jnp.stack([self.tail_sum, tl]), 0)
    leaf = jnp.full(tm.shape, _leaf_err(dt), dt)
    step = _merge_step(pm, m, 0)
    err = jnp.maximum(self.err + step[0], leaf + step[1]) + _EXP_ULPS
    return dataclasses.replace(
      self,
      tail_m=m,
      tail_sum=denom,
      err=err,
      tail_norm=tail_norm,
      logits_ok=self.logits_ok & ~bad,
    )

  @staticmethod
  def reduce(parts: "PartialSoftmax", axis: int) -> "PartialSoftmax":
    """Merges the Partials stacked along ``axis`` of the leading shape.

    One level: every part is rescaled to the common maximum and summed (the
    reduction's own rounding is added to ``err``). ``axis`` indexes the
    leading shape ``[...]`` (``o`` has one more trailing axis).
    """
    nd = parts.m.ndim
    ax = axis % nd
    dt = parts.m.dtype
    red = lambda x, f: f(x, axis=ax)  # noqa: E731
    m, denom, w = _rescale(parts.m, parts.denom, ax)
    tm, tl, _ = _rescale(parts.tail_m, parts.tail_sum, ax)
    o = None
    if parts.o is not None:
      # Convex weights of the parts (they sum to 1): o stays normalised.
      frac = w / jnp.expand_dims(jnp.where(denom > 0, denom, 1.0), ax)
      o = jnp.sum(frac[..., None] * parts.o, axis=ax)
    k = parts.m.shape[ax]
    step = _merge_step(parts.m, m, ax) + _merge_step(parts.tail_m, tm, ax)
    grow = log_slack(k, dt) / _eps(dt) + _EXP_ULPS
    err = red(parts.err + step, jnp.max) + grow
    opt = lambda x, f: None if x is None else red(x, f)  # noqa: E731
    return PartialSoftmax(
      o=o,
      m=m,
      denom=denom,
      tail_m=tm,
      tail_sum=tl,
      err=err,
      logit_error=red(parts.logit_error, jnp.max),
      k_kept=red(parts.k_kept, jnp.sum).astype(jnp.int32),
      keys_scored=red(parts.keys_scored, jnp.sum).astype(jnp.int32),
      head_norm=opt(parts.head_norm, jnp.max),
      tail_norm=opt(parts.tail_norm, jnp.max),
      logits_ok=red(parts.logits_ok, jnp.all),
    )

  def _log_tv(self, *, n_terms, scale_ok=True):
    """``(log_tv, valid)``: the rounded-up log tv bound (``tail_log_bound``)
    and the row validity (``row_valid``) of ``finalize``."""
    out_ok = True
    if self.o is not None:
      out_ok = jnp.all(jnp.isfinite(self.o), axis=-1)
    norms_ok = True
    if self.head_norm is not None:
      norms_ok = ~(jnp.isnan(self.head_norm) | jnp.isnan(self.tail_norm))
    has_head = (self.denom > 0) & jnp.isfinite(self.m)
    valid = row_valid(
      has_head=has_head,
      logits_ok=self.logits_ok,
      norms_ok=norms_ok,
      output_ok=out_ok,
      scale_ok=scale_ok,
    )
    dt = self.m.dtype
    m = jnp.where(jnp.isfinite(self.m), self.m, 0.0)
    gap = self.tail_m - m  # the tail relative to the head's maximum
    log_tail = gap + jnp.log(self.tail_sum)
    log_head = jnp.log(jnp.where(self.denom > 0, self.denom, 1.0))
    # fl(tail_m - m) is off by eps/2 |gap| <= eps/2 (|x| + |log denom| +
    # |log tail_sum|): finish_log_bound's |x| term covers the first part.
    err = 2 * self.err + 2 * jnp.log1p(jnp.asarray(n_terms, dt))
    log_tv = tail_log_bound(
      log_head,
      log_tail,
      err=err,
      n_terms=n_terms,
      logit_error=self.logit_error,
      ok=valid,
    )
    return log_tv, valid

  def tv_bound(self, *, n_terms, scale_ok=True) -> jax.Array:
    """``finalize``'s ``Certificate.tv_bound`` alone (NaN on invalid rows),
    without the output bound: for a check before the finish (a safety net
    that redoes rows certified above eps), the finish itself once after."""
    return tv_up(*self._log_tv(n_terms=n_terms, scale_ok=scale_ok))

  def finalize(
    self, *, n_terms, failure_prob: float = 0.0, scale_ok=True
  ) -> tuple[jax.Array | None, Certificate]:
    """The output and Certificate of a row whose keys have all been seen.

    Args:
      n_terms: number of terms reduced into the masses (keys plus unscored
        blocks; a static int or an int array), for ``log_slack``.
      failure_prob: static probability that the bound fails (MC-Search).
      scale_ok: bool (or ``[...]``), False for a traced scale that is not
        finite and > 0.

    Returns:
      ``(o, certificate)``: ``o`` ``[..., d_v]`` (zeros on invalid rows) or
      None, and the Certificate (``row_valid``; tv_bound from
      ``tail_log_bound``, output_error_bound from ``output_error_bound``).
    """
    log_tv, valid = self._log_tv(n_terms=n_terms, scale_ok=scale_ok)
    cert = finish_certificate(
      log_tv,
      valid,
      k_kept=self.k_kept,
      keys_scored=self.keys_scored,
      head_norm=self.head_norm,
      tail_norm=self.tail_norm,
      logit_error=self.logit_error,
      failure_prob=failure_prob,
    )
    o = self.o
    if o is not None:
      o = jnp.where(valid[..., None], o, jnp.zeros((), self.m.dtype))
    return o, cert


def _rescale(m_parts, l_parts, ax):
  """Common max, rescaled sum and per-part weights of (m, l) pairs."""
  m = jnp.max(m_parts, axis=ax)
  ms = jnp.where(jnp.isfinite(m), m, 0.0)
  ms_b = jnp.expand_dims(ms, ax)
  w = jnp.where(
    l_parts > 0, jnp.exp(jnp.where(l_parts > 0, m_parts, ms_b) - ms_b), 0.0
  )
  w = w * l_parts
  return m, jnp.sum(w, axis=ax), w


def _merge_step(m_parts, m, ax):
  """eps-units rounding added when a part is rescaled to the max ``m``."""
  dt = m_parts.dtype
  gap = jnp.abs(m_parts - jnp.expand_dims(jnp.where(jnp.isfinite(m), m, 0), ax))
  lim = _log_tiny_inv(dt) + 1.0
  gap = jnp.where(jnp.isfinite(gap), jnp.minimum(gap, lim), 0.0)
  return 0.5 * gap + _EXP_ULPS


def online_step(
  m, denom, o, err, logits, valid, value_fn, *, mask_value, axis=-1
):
  """One block of a flash (online-softmax) loop: the pairwise ``merge``.

  The running head (``m``, ``denom``, normalised ``o``, ``err``, as a
  ``PartialSoftmax``'s fields) absorbs one block of logits. The form of
  ``PartialSoftmax.reduce`` for two parts, written elementwise so that it runs
  inside a Pallas kernel body (no -inf, no ``isfinite``: empty entries hold
  the finite ``mask_value``): m' = max(m, max s), the old part rescaled by
  e^{m - m'}, the block's terms e^{s - m'} computed once (a leaf), and the
  output kept a convex combination, o' = (e^{m - m'} denom o + sum_j p_j
  v_j) / denom' with every weight <= 1, so values near the largest float do
  not overflow (an unnormalised accumulator would). ``err`` grows as in
  ``PartialSoftmax.reduce`` (the rescale's 0.5 |m - m'| + ulps, a leaf for the
  block, the addition's slack); ``PartialSoftmax.from_stats(m, denom, o=o,
  err=err)`` turns the result into a PartialSoftmax.

  Args:
    m: ``[r, 1]`` running max (``mask_value`` before any real key).
    denom: ``[r, 1]`` running sum of e^{s - m} (0 before any real key).
    o: ``[r, d_v]`` running normalised output (0 before any real key).
    err: ``[r, 1]`` running rounding of ``denom`` in eps units (0 at first).
    logits: ``[r, bk]`` the block's logits (or ``[bk, r]`` with ``axis=0``).
    valid: bool, same shape: real keys.
    value_fn: ``p -> [r, d_v]``, sum_j p_j v_j of the block for weights p
      shaped like ``logits`` (each <= 1, summing to <= 1).
    mask_value: a large negative finite number (e.g. -0.7 max float).
    axis: the block's key axis of ``logits`` (-1 or 0).

  Returns:
    ``(m, denom, o, err)`` after the block.
  """
  dt = m.dtype
  s = jnp.where(valid, logits, mask_value)
  m_new = jnp.maximum(m, jnp.max(s, axis=axis, keepdims=True))
  corr = jnp.exp(m - m_new)  # <= 1
  p = jnp.where(valid, jnp.exp(s - m_new), 0.0)  # each <= 1
  d_new = corr * denom + jnp.sum(p, axis=axis, keepdims=True)
  inv = 1.0 / jnp.where(d_new > 0, d_new, 1.0)
  o_new = (corr * denom * inv) * o + value_fn(p * inv)
  lim = _log_tiny_inv(dt) + 1.0
  with jax.ensure_compile_time_eval():
    grow = float(log_slack(2, dt)) / float(_eps(dt)) + _EXP_ULPS
  step = 0.5 * jnp.minimum(m_new - m, lim) + 2 * _EXP_ULPS
  err_new = jnp.maximum(err + step, _leaf_err(dt) + _EXP_ULPS) + grow
  return m_new, d_new, o_new, err_new


def merge(a: PartialSoftmax, b: PartialSoftmax) -> PartialSoftmax:
  """Merges two Partials of disjoint key sets of the same rows.

  Associative and commutative up to rounding (the rounding is tracked in
  ``err``); ``PartialSoftmax.empty`` is its identity. The output stays
  normalised:
  o = (w_a o_a + w_b o_b) / (w_a + w_b), a convex combination.

  Raises:
    ValueError: if one PartialSoftmax carries an output (or norms) and the other
      does not.
  """
  if (a.o is None) != (b.o is None) or (a.head_norm is None) != (
    b.head_norm is None
  ):
    raise ValueError(
      "merge: both Partials must carry an output and norms, or neither;"
      f" got o: {a.o is not None}, {b.o is not None}; norms:"
      f" {a.head_norm is not None}, {b.head_norm is not None}"
    )
  parts = jax.tree.map(lambda x, y: jnp.stack([x, y]), a, b)
  return PartialSoftmax.reduce(parts, 0)


def certificate_from_logits(
  logits,
  keep,
  real,
  *,
  logit_error=0.0,
  value_norms=None,
  keys_scored=None,
  failure_prob: float = 0.0,
) -> Certificate:
  """The Certificate of a kept set when every logit of the row is known.

  THEORY 2.1/2.5 (tau of the kept set, rounded up), 3.4 (logits off by at
  most ``logit_error``), 4.2/4.4 (output error from value norms).

  Args:
    logits: ``[..., n]`` logits (any float dtype).
    keep: ``[..., n]`` bool kept set.
    real: ``[..., n]`` bool real keys.
    logit_error: ``[...]`` delta of the logits; 0 when they are exact (e.g.
      given by the user to ``select``).
    value_norms: optional ``[..., n]`` (broadcastable) ``value_norms``.
    keys_scored: optional ``[...]`` int; default the real keys.
    failure_prob: static.

  Returns:
    A Certificate ``[...]``.
  """
  s = jax.lax.stop_gradient(jnp.asarray(logits))
  p = PartialSoftmax.from_logits(
    s,
    keep,
    real,
    logit_error=logit_error,
    value_norms=value_norms,
    keys_scored=keys_scored,
  )
  _, cert = p.finalize(n_terms=s.shape[-1], failure_prob=failure_prob)
  return cert
