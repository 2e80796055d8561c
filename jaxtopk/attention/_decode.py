"""One decode step over a KVCache: Top-k attention with a Certificate.

THEORY 8.1 (exact Top-k decoding), 6.1-6.3 (certified searches), 3.3 (block
bounds from the cached boxes), 4.2/4.4 (output error). One new query per
sequence and head attends to the filled cache positions. Every certificate
comes from ``jaxtopk.selection.core`` (``PartialSoftmax`` statistics of the kept
and dropped keys, merged and finalised there); selection only decides the
kept set (``jaxtopk.selection.threshold``).

The XLA path is built to cost about the logits (the floor: one einsum over
the head-major cache, which reads every key) plus a few light passes over
the ``[b, h, n]`` logits and the kept values only:

1. logits s = scale q.K over the head-major cache;              [b, h, n]
2. maxima of strided columns of the row (one vectorised pass);    [b, h, n/g]
3. a BRACKET lo, from the column maxima alone, such that every key the
   policy keeps is >= lo: the topk-th largest column max (fixed counts: the
   topk columns above it hold topk distinct keys >= it), or, for
   ``Certified(eps)``, the largest lo whose dropped mass is bounded by
   ``Z - sum_{columns with max >= lo} e^{max}`` <= eps Z (each column max is
   a distinct key >= lo);
4. one pass: the keys >= lo (the candidates) compacted into a static
   capacity (``threshold.mask_indices``), and the partial softmax
   statistics of the keys below lo (``core.PartialSoftmax``, for the
   certificate);
5. the exact threshold among the candidates (``threshold.topk_threshold``
   or ``budget_threshold`` with the mass below lo as extra), the kept keys
   compacted, their values gathered (a dense value product instead where a
   row keeps more than the gather capacity), and the certificate of kept +
   dropped candidates + keys below lo.

When a row has more candidates than the capacity (flat rows, ties, no
bracket), the whole batch takes the exact full-row path (``lax.cond``; under
vmap both branches run): full-row thresholds, and for Certified a dense
(chunked) value product when more keys are kept than the gather capacity.
Ties at a fixed-count threshold: the kept tied keys are chosen in strided
column order (deterministic, not by position); the certificate counts the
tied keys left out.

Certified(search='delta'|'mc') scores cache blocks in the order of their
box bounds and stops by the THEORY 6.2 rule (``keys_scored`` reports the
products needed, and 2 key-equivalents per block for the box read).
``Auto`` on rows its sample calls concentrated tries the same over at most
``SEARCH_CAPACITY`` of each row's blocks first (``_box_search``: work and
memory for the scored blocks only, a paged cache's pages read where
scored). Every strategy honours ``Certified.max_topk``.
"""

import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxtopk.attention import _cache
from jaxtopk.attention import _prefill
from jaxtopk.attention import checks
from jaxtopk.attention import registry
from jaxtopk.attention._cache import KVCache
from jaxtopk.selection import Certificate
from jaxtopk.selection import Certified
from jaxtopk.selection import DeltaSearch
from jaxtopk.selection import FixedCount
from jaxtopk.selection import Policy
from jaxtopk.selection import core
from jaxtopk.selection import key_codes
from jaxtopk.selection import threshold
from jaxtopk.selection.internal import FEATURES
from jaxtopk.selection.internal import TableBlocks
from jaxtopk.selection.internal import box_upper_bound_dot
from jaxtopk.selection.internal import capabilities
from jaxtopk.selection.internal import finish_compact
from jaxtopk.selection.internal import rng_argument
from jaxtopk.selection.internal import search_row_compact
from jaxtopk.selection.internal import search_row_partial

# What the XLA decode honours: every policy, strategy and field but the
# low-rank key bound (certified_search has it).
SUPPORTS = capabilities(
  "policy=Dense",
  "policy=FixedK",
  "policy=Ratio",
  "policy=PowerLaw",
  "policy=Certified",
  "search=exact",
  "search=delta",
  "search=mc",
  "bound=box",
  "bound=codes",
  "max_topk",
)
_BACKEND = "decode_attention(implementation='xla')"

FIXED_GROUP = 32  # strided column height for fixed-count brackets
CERTIFIED_GROUP = 16  # column height for certified brackets (tighter bound)
BRACKET_BINS = 256  # bins of the certified bracket's column-mass histogram
# Static gather capacity of Certified(eps) (kept keys), as a fraction of the
# cache: rows keeping more take the dense value product.
CERTIFIED_CAPACITY = 1 / 32
# A kept set this many times smaller than the capacity gathers that many
# slots (``_values_at``).
GATHER_TIERS = 8
# Auto's box stage (``_box_search``) scores at most this share of a row's
# blocks; a batch with a row that needs more goes on as without it.
SEARCH_CAPACITY = 1 / 8
# Caches shorter than CANDIDATE_MIN_KEYS take the full-row path of the
# fixed counts and of Certified's exact search directly (no bracket, no
# candidates): below it the full row costs no more (measured at n = 512 to
# 16,384, docs/performance.md "Decode over a KVCache") and the program is
# half the size (no second path to compile).
CANDIDATE_MIN_KEYS = 8192
# Auto over a KVCache (``_codes_rows``): caches shorter than AUTO_MIN_KEYS
# run the exact search; longer rows estimate AUTO_SAMPLE strided keys'
# logits from their codes and take the key-code path when the sample needs
# at most AUTO_THRESHOLD of its keys for 1 - eps of its mass
# (experiments/bound_study.py: over the 72 MiniLM heads no head then costs
# more than the exact search plus the sample, and the concentrated heads
# keep their saving), and keep every key otherwise (``_sample_choice``);
# a batch takes the codes only when every row chose them (``_codes_rows``).
AUTO_MIN_KEYS = 1024
# Platforms where the key-code path was measured to pay. On an H100 (jax
# 0.11, docs/performance.md "GPU") it cost 4.5-4.9x the logits floor at n =
# 16K-64K where the exact search cost 1.8-2.3x: Auto runs the exact search
# there, and on TPU until measured.
AUTO_CODES_PLATFORMS = ("cpu",)
AUTO_SAMPLE = 32
AUTO_THRESHOLD = 0.6
# Query heads per kv head up to which the key codes pay. Their bounds,
# thresholds and candidate gathers are per query, the dense product's key
# reads are shared by the group: on concentrated rows (n = 4K-32K,
# head_dim 128, CPU) the codes cost 0.41x dense at 1 query per kv head and
# 1.28-1.35x at 4, where the exact search costs 1.04x; over a paged cache
# read page slot by page slot, 0.67x dense at 1 and 1.2x at 4, where the
# exact search costs 0.8x (docs/performance.md). Past it, concentrated
# rows run the exact search.
AUTO_CODES_MAX_GROUP = 2
# The key-code path: candidates compacted into n / CODES_SMALL slots (or
# n when more), their keys and values gathered CODES_CHUNK at a time.
CODES_SMALL = 8
CODES_CHUNK = 1024
# Queries of at least CHUNK_MIN_STEPS[policy.kind] steps (a prefill chunk)
# run through the blockwise prefill (``_chunk``) where it honours the
# policy: tiles of query rows, one coarse threshold pass, Delta-Search over
# key blocks, instead of one [q_len g, n] logits array per kv head and the
# decode's passes over it. Measured on 2 CPU cores, 8 heads over 2 kv
# heads, head_dim 128, 8K-32K keys (docs/performance.md "Decode over a
# KVCache"): Certified pays from 32 steps (0.6-0.8x the folded rows), Dense
# from 512 (0.66-0.77x; 0.9-1.2x below), fixed counts, whose folded rows
# gather only the kept values, at 2,048 (0.83x; 1.5x at 512), where the
# folded rows also hold 11 GB.
CHUNK_MIN_STEPS = {"certified": 32, "dense": 512, "count": 2048}
_HIGHEST = core.PRECISION  # full float32 products (the bounds assume it)

# ``{implementation name: fn}`` of the registered decode ops over a KVCache
# (read-only, from ``registry.OPS``; None is the default).
DECODE_IMPLEMENTATIONS = registry.ImplementationView("decode", KVCache)


def register_decode_implementation(name: str, fn: Callable) -> None:
  """Plugs a backend over a KVCache into ``decode_attention`` (an op).

  Kept for compatibility: ``fn`` has the signature of
  ``xla_decode_attention`` (checked arguments) and refuses by itself what
  it cannot honour (the op declares every policy feature); registering an
  ``registry.AttentionOp`` declares that instead. The op attends one query
  step (q_len = 1) and returns no residual: it refuses 'multi_query' and
  'return_residual' by name.
  """

  def op_fn(query, cache, *, policy, scale, rng):
    scale, rng = checks.check_decode_call(query, cache, policy, scale, rng)
    return fn(query, cache, rng, policy=policy, scale=scale)

  registry.register(
    registry.AttentionOp(
      name=f"{name}_decode",
      implementation=name,
      kind="decode",
      fn=op_fn,
      label=f"decode_attention(implementation={name!r})",
      supports=FEATURES,
      arguments=frozenset({"traced_scale"}),
      cache_types=(KVCache,),
    )
  )


@dataclasses.dataclass(frozen=True)
class _Step:
  """The arrays every decode strategy reads (leading ``[b, hk, g]``).

  Attributes:
    q: ``[b, hk, g, d]`` queries in the compute dtype.
    s: ``[b, hk, g, n]`` logits in the compute dtype.
    valid: ``[b, 1, 1, n]`` bool filled positions (``[b, 1, g, n]`` for
      q_len > 1 steps folded into the groups: each row's causal prefix).
    delta: ``[b, hk, g]`` logit error bound (``core.logit_error_bound``).
    vn: ``[b, hk, 1, n]`` value norms (``cache.value_norms``).
    n_valid: ``[b, hk, g]`` int32 filled positions.
    scale_ok: bool or ``[]``, a traced scale is finite and >=
      ``core.MIN_SCALE``.
    cache: the KVCache.
    scale: the logit scale (float or traced 0-d array).
    residual: static, whether results carry the log-sum-exp residual.
    candidates: static, whether the fixed counts and the exact certified
      search try the bracket and candidates before the full row
      (``CANDIDATE_MIN_KEYS``).
  """

  q: jax.Array
  s: jax.Array
  valid: jax.Array
  delta: jax.Array
  vn: jax.Array
  n_valid: jax.Array
  scale_ok: jax.Array
  cache: KVCache
  scale: object
  residual: bool = False
  candidates: bool = True

  @property
  def real(self) -> jax.Array:
    return jnp.broadcast_to(self.valid, self.s.shape)


def _queries(query, cache):
  """(query ``[b, hk, g, d]`` as given, in the compute dtype)."""
  b, _, h, d = query.shape
  hk = cache.keys.shape[1]
  dt = core.compute_dtype(jnp.result_type(query.dtype, cache.keys.dtype))
  q_in = query.reshape(b, hk, h // hk, d)  # [b, hk, g, d], input dtype
  return q_in, q_in.astype(dt)


def _logit_error(q_in, q, cache, scale):
  """``[b, hk, g]`` delta of the computed logits (``core``), from the
  cache's running key summaries."""
  abs_dot = core.abs_dot_box(q, cache.kabs[:, :, None, :])[..., 0]  # [b,hk,g]
  return core.logit_error_bound(
    q_norm=core.norms_up(q_in),
    k_norm=cache.knorm[..., None],
    head_dim=q.shape[-1],
    scale=scale,
    abs_dot=abs_dot,
    q_flushed=core.flushed(q_in),
    k_flushed=cache.kflushed[..., None],
    q_absmax=jnp.max(jnp.abs(q), -1),
    k_absmax=jnp.max(cache.kabs, -1)[..., None],
  )


def _row_limits(length, q_len, rows):
  """``[b, rows]`` int32: how many positions each folded row attends to.

  Row r holds query step i = r // (rows / q_len), at position length -
  q_len + i; it attends to the positions <= its own (0 where the step falls
  before the first key: a row with no real key).
  """
  step = jnp.arange(rows, dtype=jnp.int32) // (rows // q_len)
  limit = length[:, None] - q_len + 1 + step[None, :]
  return jnp.maximum(limit, 0).astype(jnp.int32)


def _fold(query, hk):
  """``[b, q_len, h, d]`` -> ``[b, 1, hk q_len g, d]``: the query steps
  folded into each kv head's group (row order (step, group))."""
  b, t, h, d = query.shape
  g = h // hk
  x = query.reshape(b, t, hk, g, d).transpose(0, 2, 1, 3, 4)
  return x.reshape(b, 1, hk * t * g, d)


def _unfold(x, hk, q_len):
  """``[b, hk, q_len g, ...]`` -> ``[b, q_len, hk g, ...]`` (``_fold``'s
  inverse on the row axes)."""
  b, _, rows = x.shape[:3]
  g = rows // q_len
  x = x.reshape(b, hk, q_len, g, *x.shape[3:])
  x = jnp.moveaxis(x, 2, 1)  # [b, q_len, hk, g, ...]
  return x.reshape(b, q_len, hk * g, *x.shape[4:])


def _step(
  query,
  cache,
  scale,
  s=None,
  *,
  q_len=1,
  residual=False,
  candidates=True,
  delta=None,
) -> _Step:
  """The arrays of a step; ``s`` given: the logits are not computed (the
  key-code path passes its upper bounds, of which only the shape is read
  by the finishing helpers). ``q_len`` > 1: the query steps are folded
  into the groups (``_fold``), each row limited to its causal prefix.
  ``delta`` given: the logit error (``_logit_error``) computed once by a
  caller whose branches each build a step."""
  q_in, q = _queries(query, cache)
  dt = q.dtype
  if s is None:
    s = _cache.row_logits(cache.keys, q, _HIGHEST) * scale  # [b, hk, g, n]
  if delta is None:
    delta = _logit_error(q_in, q, cache, scale)
  if q_len == 1:
    valid = cache.valid()[:, :, None]  # [b, 1, 1, n]
    n_valid = jnp.broadcast_to(cache.length[:, None, None], s.shape[:-1])
  else:
    limit = _row_limits(cache.length, q_len, s.shape[2])  # [b, rows]
    pos = jnp.arange(s.shape[-1], dtype=jnp.int32)
    valid = (pos < limit[..., None])[:, None]  # [b, 1, rows, n]
    n_valid = jnp.broadcast_to(limit[:, None], s.shape[:-1])
  return _Step(
    q=q,
    s=s,
    valid=valid,
    delta=delta,
    vn=cache.value_norms[:, :, None].astype(dt),
    n_valid=n_valid,
    scale_ok=checks.scale_ok(scale),
    cache=cache,
    scale=scale,
    residual=residual,
    candidates=candidates,
  )


# ---------------------------------------------------------------- values


def _gather_values(values, idx):
  """``values[b, hk, idx]``: ``[b, hk, n, dv]`` x ``[b, hk, g, K]`` ->
  ``[b, hk, g, K, dv]`` (the kept rows only; from the pool of a paged
  cache's view)."""
  return _cache.take_rows(values, idx)


def _dense_values(p, values):
  """sum_n p_n v_n: ``[b, hk, g, n]`` x ``[b, hk, n, dv]`` -> ``[b, hk, g,
  dv]``, one einsum. (Splitting n into chunks as a batch axis of the dot,
  once 2-3x faster on XLA:CPU, measured 1.1-1.5x slower with jax 0.10 at
  n = 1K-131K, g = 1-8: docs/performance.md.)"""
  return _cache.row_weighted_sum(values, p, _HIGHEST)


def _kept_values_fn(keep, values, capacity):
  """``p -> sum_i p_i v_i`` over the kept keys ``keep`` ``[b, hk, g, n]``.

  A gather of the kept values when every row keeps <= ``capacity`` keys,
  else the dense (chunked) product; a ``value_fn`` for ``PartialSoftmax``.
  """
  n = keep.shape[-1]
  if capacity >= n:
    return lambda p: _dense_values(jnp.where(keep, p, 0.0), values)
  idx, ok, count = threshold.mask_indices(keep, capacity)

  def fn(p):
    def gathered():
      pk = jnp.where(ok, jnp.take_along_axis(p, idx, -1), 0.0)
      vals = _gather_values(values, idx).astype(p.dtype)
      return jnp.einsum("bkgt,bkgtd->bkgd", pk, vals, precision=_HIGHEST)

    def dense():
      return _dense_values(jnp.where(keep, p, 0.0), values)

    return lax.cond(jnp.all(count <= capacity), gathered, dense)

  return fn


# ------------------------------------------------------------ certificates


def _with_output(part, d_v):
  """``part`` with a zero output (a PartialSoftmax of dropped keys only)."""
  o = jnp.zeros((*part.m.shape, d_v), part.m.dtype)
  return dataclasses.replace(part, o=o)


def _full_row(st: _Step, keep, capacity):
  """The PartialSoftmax of a row whose kept set ``keep`` ``[b, hk, g, n]`` is
  known."""
  return core.PartialSoftmax.from_logits(
    st.s,
    keep,
    st.real,
    logit_error=st.delta,
    value_fn=_kept_values_fn(keep, st.cache.values, capacity),
    value_norms=st.vn,
    keys_scored=st.n_valid,
  )


def _below(st: _Step, below, group, row_ok):
  """The PartialSoftmax of the keys ``below`` (all dropped), with a zero output.

  Strided columns of ``group`` keys (a vectorised pass); the value norm of
  a dropped key is bounded by the cache's largest (``cache.vmax``), so no
  pass over the norms; ``row_ok`` (from the row max) replaces the NaN check.
  """
  part = core.PartialSoftmax.from_dropped(
    st.s,
    below,
    logit_error=st.delta,
    d_v=st.cache.values.shape[-1],
    group=group,
    logits_ok=row_ok,
  )
  zero = jnp.zeros(part.m.shape, part.m.dtype)
  vmax = jnp.broadcast_to(st.cache.vmax[..., None], zero.shape)
  return dataclasses.replace(part, head_norm=zero, tail_norm=vmax)


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=("part", "n_terms", "scale_ok", "empty"),
  meta_fields=("failure_prob", "residual"),
)
@dataclasses.dataclass(frozen=True)
class _Done:
  """A decided step before its finish: every branch of a program returns
  one and the program finishes once (``_final``). XLA compiles each branch
  of a ``lax.cond``: a finish inside the branches (the output bound above
  all) would be compiled once per branch.

  Attributes:
    part: the ``core.PartialSoftmax`` of every row, output and
      ``keys_scored`` included.
    n_terms: ``[]`` int32 terms of its masses (``finalize``'s).
    scale_ok: bool ``[]`` (``_Step.scale_ok``).
    empty: ``[b, hk, g]`` bool rows with no real key.
    failure_prob: static (MC-Search's).
    residual: static, whether the log-sum-exp residual is returned.
  """

  part: core.PartialSoftmax
  n_terms: jax.Array
  scale_ok: jax.Array
  empty: jax.Array
  failure_prob: float = 0.0
  residual: bool = False

  def tv_bound(self) -> jax.Array:
    """The finished certificate's ``tv_bound`` (for a safety net)."""
    return self.part.tv_bound(n_terms=self.n_terms, scale_ok=self.scale_ok)


def _done(st: _Step, part, *, n_terms=None, failure_prob=0.0, keys_scored=None):
  """``part`` decided: ``keys_scored`` (default every real key) and
  ``n_terms`` (default 2 n) set."""
  if keys_scored is None:
    keys_scored = st.n_valid
  part = dataclasses.replace(part, keys_scored=keys_scored)
  n = st.s.shape[-1]
  return _Done(
    part=part,
    n_terms=jnp.asarray(2 * n if n_terms is None else n_terms, jnp.int32),
    scale_ok=jnp.asarray(st.scale_ok),
    empty=st.n_valid == 0,
    failure_prob=failure_prob,
    residual=st.residual,
  )


def _final(done: _Done):
  """``(o, Certificate, lse)`` of a decided step (``lse`` None unless
  ``residual``: ``core.log_sum_exp_residual``)."""
  part = done.part
  o, cert = part.finalize(
    n_terms=done.n_terms,
    failure_prob=done.failure_prob,
    scale_ok=done.scale_ok,
  )
  lse = None
  if done.residual:
    lse = core.log_sum_exp_residual(part.log_head, cert.valid, done.empty)
  return o, cert, lse


def _over_eps(done: _Done, st: _Step, policy: Certified, m_top=None):
  """``[]`` bool: some valid row's finished bound exceeds eps (float
  rounding beyond the margins, or an aim that missed), and it could have
  kept more (fewer than ``m_top`` kept): a safety net redoes the batch."""
  over = (done.tv_bound() > policy.eps) & (st.delta < jnp.inf)
  if m_top is not None:
    over = over & (done.part.k_kept < m_top)
  return jnp.any(over)


# ------------------------------------------------------------ candidates


@dataclasses.dataclass(frozen=True)
class _Candidates:
  """The keys >= a bracket lo of every row, compacted (capacity ``cap``).

  Attributes:
    idx: ``[b, hk, g, cap]`` int32 positions.
    ok: ``[b, hk, g, cap]`` bool used slots.
    s: ``[b, hk, g, cap]`` their logits (-inf in unused slots).
    vn: ``[b, hk, g, cap]`` their value norms.
    below: PartialSoftmax of the keys < lo (dropped whatever the candidates
    keep).
  """

  idx: jax.Array
  ok: jax.Array
  s: jax.Array
  vn: jax.Array
  below: core.PartialSoftmax


def _row_ok(bmax):
  """``[...]`` no real logit of the row is NaN or +inf (column maxima of
  ``threshold.column_max`` propagate both)."""
  return ~jnp.any(jnp.isnan(bmax) | (bmax == jnp.inf), axis=-1)


def _candidates(st: _Step, lo, compact, group, row_ok) -> _Candidates:
  """The candidates >= lo from ``compact = (idx, ok, count)``."""
  idx, ok, _ = compact
  cs = jnp.where(ok, jnp.take_along_axis(st.s, idx, -1), -jnp.inf)
  vn = jnp.broadcast_to(st.vn, st.s.shape)
  cvn = jnp.where(ok, jnp.take_along_axis(vn, idx, -1), 0.0)
  below = st.real & ~(st.s >= lo[..., None])
  return _Candidates(idx, ok, cs, cvn, _below(st, below, group, row_ok))


def _compact_ge(st: _Step, lo, cap, group):
  """``mask_indices`` of the real keys >= lo: ``(idx, ok, count)``."""
  ge = st.real & (st.s >= lo[..., None])
  return threshold.mask_indices(ge, cap, group=group)


def _values_at(st: _Step, idx, kept, capacity, *, may_exceed):
  """``p -> sum p_i v_i`` over the ``kept`` slots ``[b, hk, g, cap]`` of
  the positions ``idx``: the kept values gathered, at most ``capacity``
  per row (``capacity // GATHER_TIERS`` where every row keeps that few: a
  gather costs its slots, used or not); with ``may_exceed`` (static), a
  batch where some row keeps more puts the weights back at their positions
  for the dense value product."""
  n = st.s.shape[-1]
  most = jnp.max(jnp.sum(kept, -1, dtype=jnp.int32))
  sizes = sorted({max(1, capacity // GATHER_TIERS), capacity})

  def value_fn(p):  # p: [b, hk, g, cap] normalised kept weights
    def gathered(size):
      def fn():
        kidx, kok, _ = threshold.mask_indices(kept, size, strided=False)
        pos = jnp.take_along_axis(idx, kidx, -1)  # [b, hk, g, K]
        vals = _gather_values(st.cache.values, pos)  # [b, hk, g, K, dv]
        pk = jnp.where(kok, jnp.take_along_axis(p, kidx, -1), 0.0)
        return jnp.einsum(
          "bkgt,bkgtd->bkgd", pk, vals.astype(p.dtype), precision=_HIGHEST
        )

      return fn

    def dense():  # p is 0 off the kept slots; the others are dropped
      pos = jnp.where(kept, idx, n)  # out of range: dropped
      full = jnp.zeros((*p.shape[:-1], n), p.dtype)
      full = jnp.put_along_axis(full, pos, p, -1, inplace=False, mode="drop")
      return _dense_values(full, st.cache.values)

    branches = [gathered(s) for s in sizes] + ([dense] if may_exceed else [])
    tier = sum((most > s).astype(jnp.int32) for s in sizes[: len(branches) - 1])
    return lax.switch(tier, branches) if len(branches) > 1 else branches[0]()

  return value_fn


def _finish_candidates(
  st: _Step, c: _Candidates, kept, capacity, *, may_exceed=False, **kw
):
  """The decided step (``_Done``) of ``kept`` ``[b, hk, g, cap]``
  candidates (``kw``: ``_done``'s).

  The kept values are gathered when every row keeps <= ``capacity`` keys.
  With ``may_exceed`` (static: a kept set not capped by ``capacity``), a
  batch where some row keeps more puts the weights back at their positions
  for the dense value product instead: the certificate, from the
  candidates, is the same either way (before, such a batch redid the whole
  row: 1.7x the dense decode with 4 query rows per kv head,
  docs/performance.md).
  """
  head = core.PartialSoftmax.from_logits(
    c.s,
    kept,
    c.ok,
    logit_error=st.delta,
    value_fn=_values_at(st, c.idx, kept, capacity, may_exceed=may_exceed),
    value_norms=c.vn,
    keys_scored=0,
  )
  return _done(st, core.merge(head, c.below), **kw)


def _tie_break(s, ok, thresh, n_above, need_total):
  """Keeps ``s > thresh`` and the first ``need_total - n_above`` ties."""
  t = thresh[..., None]
  above = ok & (s > t)
  tie = ok & (s == t)
  need = need_total - n_above
  n_tie = jnp.sum(tie, axis=-1, dtype=jnp.int32)
  keep_ties = lax.cond(
    jnp.any(n_tie > need),
    lambda: (
      tie & (jnp.cumsum(tie, axis=-1, dtype=jnp.int32) <= need[..., None])
    ),
    lambda: tie,
  )
  return (above | keep_ties) & (need_total > 0)[..., None]


# ---------------------------------------------------------- fixed count


def _largest_group(n, most):
  """Largest power of two <= ``most`` dividing ``n``."""
  g = 1
  while g * 2 <= most and n % (g * 2) == 0:
    g *= 2
  return g


def _group_for(n, kept):
  """Largest power of two <= FIXED_GROUP with n / g >= 2 kept (1 if none)."""
  g = 1
  while g * 2 <= FIXED_GROUP and n % (g * 2) == 0 and n // (g * 2) >= 2 * kept:
    g *= 2
  return g


def _topk_of(st: _Step, topk, capacity):
  """Exact Top-k of every row: a ``_Done``."""
  n = st.s.shape[-1]

  def full():
    t, n_above = threshold.topk_threshold(st.s, topk, st.real)
    keep = _tie_break(st.s, st.real, t, n_above, topk)
    return _done(st, _full_row(st, keep, capacity))

  group = _group_for(n, capacity)
  if group < 4 or not st.candidates:
    return full()
  cap = min(n, 2 * capacity + 16)
  bmax = threshold.column_max(st.s, st.real, group=group)  # [b, hk, g, n/g]
  lo, _ = threshold.topk_threshold(bmax, topk, bmax > -jnp.inf)
  compact = _compact_ge(st, lo, cap, group)

  # Unconditional candidate path, one cond at the end (see _certified_exact).
  c = _candidates(st, lo, compact, group, _row_ok(bmax))
  t, n_above = threshold.topk_threshold(c.s, topk, c.ok)
  kept = _tie_break(c.s, c.ok, t, n_above, topk)
  result = _finish_candidates(st, c, kept, capacity)
  count = compact[2]
  # The bracket holds when >= topk keys are >= lo (then the topk-th largest
  # key is >= lo); it may not when a row's largest keys share few columns.
  fits = jnp.all(count <= cap) & jnp.all(count >= jnp.minimum(topk, st.n_valid))
  return lax.cond(fits, lambda: result, full)


def _fixed_count(policy: FixedCount, st: _Step):
  n = st.s.shape[-1]
  if policy.kind == "dense":
    return _done(st, _full_row(st, st.real, n))
  topk = policy.row_num_kept(st.n_valid, n)  # [b, hk, g]
  return _topk_of(st, topk, policy.num_kept(n))


# -------------------------------------------------------------- certified


def _second_max(s, real, bmax, group):
  """Per strided column, the largest real logit below the column max
  (-inf if none): with the max, the column's two largest distinct keys."""
  n = s.shape[-1]
  x = jnp.where(real, s, -jnp.inf).reshape(*s.shape[:-1], group, n // group)
  return jnp.max(jnp.where(x < bmax[..., None, :], x, -jnp.inf), axis=-2)


def _budget_bracket(tops, m, z, log_frac, n_total):
  """Largest lo (a bin edge below the max) whose tail is surely in budget.

  tail(lo) <= Z - sum_{t in tops, t > lo} e^t, where ``tops`` ``[..., c]``
  are distinct keys of the row (each column's largest and second largest);
  computed from a histogram of their mass over gap bins, with Z rounded up
  by ``core.log_slack``. -inf where no edge qualifies (flat rows); +inf for
  a row without a finite max (invalid: no candidate needed).
  """
  dt = tops.dtype
  mm = jnp.where(jnp.isfinite(m), m, 0.0)
  span = jnp.log(jnp.asarray(max(n_total, 2), dt)) - log_frac + 2.0
  width = span / BRACKET_BINS  # [...]
  gap = mm[..., None] - tops  # inf for an empty column
  present = tops > -jnp.inf
  mass = jnp.where(present, jnp.exp(-gap), 0.0)
  bins = jnp.clip(jnp.floor(gap / width[..., None]), 0, BRACKET_BINS - 1)
  bins = jnp.where(present, bins.astype(jnp.int32), BRACKET_BINS - 1)
  hist = threshold.row_histogram(mass, bins, BRACKET_BINS)
  inside = jnp.cumsum(hist, axis=-1)  # mass of tops with gap < (j+1) w
  # Rounded so that z_up >= Z and inside_dn <= the tops' exact mass.
  z_up = z * jnp.exp(2 * core.log_slack(n_total, dt))
  inside_dn = inside * jnp.exp(-2 * core.log_slack(tops.shape[-1], dt))
  allowed = jnp.exp(log_frac) * z
  ok = (z_up[..., None] - inside_dn) <= allowed[..., None]
  j = jnp.argmax(ok, axis=-1)  # first qualifying edge
  lo = mm - (j + 1).astype(dt) * width
  lo = jnp.where(jnp.any(ok, axis=-1), lo, -jnp.inf)
  return jnp.where(jnp.isfinite(m), lo, jnp.inf)


def _certified_exact(policy: Certified, st: _Step):
  n = st.s.shape[-1]
  dt = st.s.dtype
  real = st.real
  margin = core.search_log_margin(2 * n, st.delta, dt)
  log_frac = jnp.log(jnp.asarray(policy.eps, dt)) - margin  # [b, hk, g]
  m_top = policy.max_topk
  if m_top is not None and m_top < n:
    capacity = m_top
  else:
    m_top = None
    capacity = max(1, min(n, int(n * CERTIFIED_CAPACITY)))

  def capped(s, ok, keep, count):
    """Top ``m_top`` of ``s`` where the budget set is larger."""
    if m_top is None:
      return keep
    t, n_above = threshold.topk_threshold(s, m_top, ok)
    top = _tie_break(s, ok, t, n_above, jnp.full(count.shape, m_top))
    return jnp.where((count > m_top)[..., None], top, keep)

  def full():
    t = threshold.budget_threshold(st.s, log_frac, real, relative=True)
    keep = real & (st.s >= t[..., None])
    keep = capped(st.s, real, keep, jnp.sum(keep, -1, dtype=jnp.int32))
    return _done(st, _full_row(st, keep, capacity))

  group = _largest_group(n, CERTIFIED_GROUP)
  if group < 4 or not st.candidates:
    return full()
  cap = min(n, 2 * capacity + 16)
  bmax = threshold.column_max(st.s, real, group=group)  # [b, hk, g, n/g]
  m = jnp.max(bmax, axis=-1)
  mm = jnp.where(jnp.isfinite(m), m, 0.0)
  z = jnp.sum(jnp.where(real, jnp.exp(st.s - mm[..., None]), 0.0), -1)
  tops = jnp.concatenate([bmax, _second_max(st.s, real, bmax, group)], -1)
  lo = _budget_bracket(tops, m, z, log_frac, n)

  # The compaction and the pass over the keys below lo run unconditionally
  # (inside a lax.cond branch, with the rest of the candidate path, they
  # cost ~0.6x the floor more at n = 131,072: XLA:CPU fuses nothing across
  # a branch); the thresholds and values of the candidates only where they
  # fit (4 query rows per kv head at n = 65,536: an overflowing batch 92 ->
  # 78-82 ms, dense 54-57); one cond at the end picks the full-row path.
  compact = _compact_ge(st, lo, cap, group)
  c = _candidates(st, lo, compact, group, _row_ok(bmax))
  holds = jnp.all(lo > -jnp.inf) & jnp.all(compact[2] <= cap)

  def candidates():
    below = c.below.tail_m + jnp.log(c.below.tail_sum)  # log mass < lo
    t = threshold.budget_threshold(
      c.s, log_frac, c.ok, relative=True, log_extra=below
    )
    keep = c.ok & (c.s >= t[..., None])
    keep = capped(c.s, c.ok, keep, jnp.sum(keep, -1, dtype=jnp.int32))
    result = _finish_candidates(st, c, keep, capacity, may_exceed=m_top is None)
    # Safety net: a row that the bracket certified but whose finished
    # bound exceeds eps (float rounding beyond the margins) is redone in
    # full.
    return result, ~_over_eps(result, st, policy, m_top)

  def overflow():
    return jax.tree.map(jnp.zeros_like, jax.eval_shape(candidates))

  result, ok = lax.cond(holds, candidates, overflow)
  return lax.cond(ok, lambda: result, full)


# ----------------------------------------------------------- delta / mc


def _certified_search(policy: Certified, st: _Step, rng):
  """Delta- or MC-Search (``policy.search``) of every row over every block
  (``_search_full``). (Auto's box stage, ``_box_search``, stops a row at a
  share of its blocks: a search that had to go on would score those blocks
  twice.)"""
  bs = st.cache.block_size
  if policy.block_size != bs:
    raise ValueError(
      f"Certified.block_size={policy.block_size} must equal the cache's"
      f" block_size={bs} for search={policy.search.name!r}"
    )
  return _search_full(policy, policy.search, st, rng)


def _block_bounds(st: _Step):
  """``(u, cnt)``: ``[b, hk, g, nb]`` box bounds of every block's exact
  logits and ``[b, hk, g, nb]`` int32 positions per block. A block's box
  and count may hold positions past a row's prefix: they only bound more
  keys (sound); the row scores its real keys only."""
  box = st.cache.box(zero_empty=False)  # [b, hk, nb, d]: broadcast over g
  u = box_upper_bound_dot(st.q, box, scale=st.scale)  # [b, hk, g, nb]
  # Box bounds use the keys as read (subnormals as 0): widen by delta.
  u = u + st.delta[..., None]
  return u, jnp.broadcast_to(box.count[:, :, None], u.shape)


def _search_rows(fn, st: _Step, rng, u, cnt):
  """``fn(q, keys, valid, u, cnt, delta, rng, value_norms)``, one row's
  search, over every (batch, kv head, group) row. A paged view's keys are
  read page by page where the search scores them (``TableBlocks``), never
  gathered."""
  cache = st.cache
  b, hk, g, _ = st.s.shape
  if st.valid.shape[2] == 1:
    valid, g_axis = cache.valid()[:, 0], None  # [b, n]
  else:  # folded query steps: each row its own causal prefix
    valid, g_axis = st.valid[:, 0], 0  # [b, g, n]
  keys, k_axes = cache.keys, (0, 0, None)
  if isinstance(keys, _cache.PageRows):
    keys = TableBlocks(keys.pool, keys.table, jnp.arange(hk))
    k_axes = (TableBlocks(None, 0, None), TableBlocks(None, None, 0), None)
  axes = (  # (batch, kv head, group) of (q, keys, valid, u, cnt, delta,
    # rng, value_norms)
    (0, k_axes[0], 0, 0, 0, 0, 0, 0),
    (0, k_axes[1], None, 0, 0, 0, 0, 0),
    (0, k_axes[2], g_axis, 0, 0, 0, 0, None),
  )
  row = fn
  for ax in reversed(axes):  # the group innermost
    row = jax.vmap(row, in_axes=ax)
  rngs = None if rng is None else jax.random.split(rng, (b, hk, g))
  return row(st.q, keys, valid, u, cnt, st.delta, rngs, cache.value_norms)


def _kept_weights(s, keep):
  """Normalised softmax weights of the kept logits (0 elsewhere)."""
  m = jnp.max(jnp.where(keep, s, -jnp.inf), -1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(keep, jnp.exp(s - m), 0.0)
  tiny = jnp.finfo(p.dtype).tiny
  return p / jnp.maximum(jnp.sum(p, -1, keepdims=True), tiny)


def _search_full(policy: Certified, search, st: _Step, rng):
  """The search over every block of every row (``search_row_partial``)."""
  n = st.s.shape[-1]
  bs = st.cache.block_size

  def fn(*args):
    return search_row_partial(
      *args[:-1],
      search=search,
      eps=policy.eps,
      scale=st.scale,
      max_topk=policy.max_topk,
      value_norms=args[-1],
      block_summary_keys=2,  # the block's box: 2 d floats
    )

  s, keep, _, part = _search_rows(fn, st, rng, *_block_bounds(st))
  capacity = min(n, policy.max_topk or max(1, int(n * CERTIFIED_CAPACITY)))
  o = _kept_values_fn(keep, st.cache.values, capacity)(_kept_weights(s, keep))
  part = dataclasses.replace(part, o=o)
  fp = search.failure_prob
  return _done(
    st, part, n_terms=n + n // bs, failure_prob=fp, keys_scored=part.keys_scored
  )


def _box_search(policy: Certified, st: _Step, fallback, *, extra=0):
  """Delta-Search over the block boxes of every row within
  ``SEARCH_CAPACITY`` of its blocks (``search_row_compact``: work for the
  scored blocks only), finished (``finish_compact``; ``extra`` products
  added to ``keys_scored``) where every row certified within them, else
  ``fallback()`` (the attempt's products added); ``fallback()`` itself
  where the capacity is every block."""
  n = st.s.shape[-1]
  bs = st.cache.block_size
  nb = n // bs
  search = DeltaSearch(bs)
  cap = max(1, int(nb * SEARCH_CAPACITY))
  if cap >= nb:
    return fallback()
  u, cnt = _block_bounds(st)

  def score(*args):
    return search_row_compact(
      *args[:-1],
      search=search,
      eps=policy.eps,
      scale=st.scale,
      capacity=cap,
    )

  rs = _search_rows(score, st, None, u, cnt)
  # What the attempt computed (the boxes: 2 d floats per block; the scored
  # blocks) counts where the fallback runs.
  tried = jnp.sum(jnp.where(rs.scored_blocks, cnt, 0), -1)
  tried = tried + 2 * jnp.sum(cnt > 0, -1)

  def fall_back():
    return _plus_scored(fallback(), tried)

  def finish():
    s, keep, _, pos, part = finish_compact(
      rs,
      st.valid,  # [b, 1, 1 or g, n]
      cnt,
      max_topk=policy.max_topk,
      value_norms=st.cache.value_norms[:, :, None],  # [b, hk, 1, n]
      block_summary_keys=2,  # the block's box: 2 d floats
    )
    capacity = min(n, policy.max_topk or max(1, int(n * CERTIFIED_CAPACITY)))
    value_fn = _values_at(st, pos, keep, capacity, may_exceed=True)
    part = dataclasses.replace(part, o=value_fn(_kept_weights(s, keep)))
    done = _done(st, part, n_terms=n + n // bs, keys_scored=part.keys_scored)
    return _plus_scored(done, extra)

  return lax.cond(jnp.all(rs.certified), finish, fall_back)


# ------------------------------------------------------------- key codes


def _by_codes(policy: Certified, cache: KVCache) -> bool:
  """Whether the key-code path runs (statically): ``bound='codes'``, or
  ``Auto`` over a cache of at least ``AUTO_MIN_KEYS`` positions on a
  platform of ``AUTO_CODES_PLATFORMS``."""
  if policy.search.name == "auto":
    on = jax.default_backend() in AUTO_CODES_PLATFORMS
    return on and cache.max_len >= AUTO_MIN_KEYS
  return policy.bound is not None and policy.bound.name == "codes"


def auto_sample_positions(length, m):
  """``[b, m]`` positions of Auto's sample: ``j length / m``, j < m (the
  first position, where attention sinks sit, included). Adding the most
  recent positions was measured worse (experiments/bound_study: a
  retrieval head's few far keys were missed more often)."""
  return (jnp.arange(m, dtype=jnp.int32) * length[:, None]) // m


def auto_sample_need(q_in, codes, exponents, length, *, eps, scale):
  """``[b, hk, g]``: how many of ``AUTO_SAMPLE`` strided keys hold 1 - eps
  of the sample's mass, their logits estimated from their codes (the
  midpoint of the code interval, a fraction of a logit off). ``q_in``
  ``[b, hk, g, d]``; ``codes`` ``[b, hk, d, n]``; ``exponents`` ``[b, hk,
  n]``; ``length`` ``[b]``. The estimate of k_eps / n behind Auto's choice
  (over a KVCache and over the content index); never part of a
  certificate."""
  m = AUTO_SAMPLE
  pos = auto_sample_positions(length, m)  # [b, m]
  codes = _cache.at_positions(codes, pos, 3)  # [b, hk, d, m]
  expo = _cache.at_positions(exponents, pos, 2)  # [b, hk, m]
  # One small einsum: for m keys the CPU's loop over d (``code_dot``) costs
  # more than its products (the sample 0.84 -> 0.55 ms at 131,072 keys, 8
  # heads, d = 128).
  u, lo = key_codes.code_bounds(q_in, codes, expo, scale=scale, loop=False)
  s = 0.5 * (u + lo)  # [b, hk, g, m]: the code estimate of the logits
  p = jnp.exp(s - jnp.max(s, -1, keepdims=True))
  p = -jnp.sort(-p / jnp.sum(p, -1, keepdims=True), axis=-1)  # decreasing
  return jnp.sum(jnp.cumsum(p, -1) < 1 - eps, -1) + 1  # NaN rows: 1


# Auto's choice per (batch, kv head) row over a KVCache.
_CODES, _EXACT, _ALL = 0, 1, 2


def _codes_pay(query, cache) -> bool:
  """Static: whether Auto may take the key codes (at most
  ``AUTO_CODES_MAX_GROUP`` query heads per kv head)."""
  return query.shape[2] // cache.keys.shape[1] <= AUTO_CODES_MAX_GROUP


def _sample_choice(policy, query, cache, scale):
  """Auto's strategy per (batch, kv head) row, from a strided sample of
  ``AUTO_SAMPLE`` keys (``auto_sample_need``):

  - the codes (``_CODES``) when some query of the row's group needs at most
    ``AUTO_THRESHOLD`` of the sample (measured: experiments/bound_study.py);
  - otherwise every key kept (``_ALL``; tv_bound 0): the row looks flat,
    and a row that keeps more than n / 32 keys takes the dense value
    product anyway, so a search would cost the logits, the threshold's
    passes and a dense product: more than dense attention. A row the
    sample misses (its mass on a few keys it did not draw) costs dense;
  - the exact search (``_EXACT``) where a ``max_topk`` caps the kept set,
    on rows of fewer than ``AUTO_MIN_KEYS`` keys (no sample drawn), and
    on concentrated rows where the codes do not pay (``_codes_pay``).

  The batch runs the most general choice of its rows (``_codes_rows``).
  Only the strategy depends on the sample; every certificate is computed
  from what was scored.

  Returns:
    ``(choice, extra)``: ``[b, hk]`` int32 (``_CODES``, ``_EXACT`` or
    ``_ALL``) and ``[b, hk]`` int32 products the sample cost (0 where none
    was drawn).
  """
  m = AUTO_SAMPLE
  q_in, q = _queries(query, cache)  # [b, hk, g, d]
  length = cache.length  # [b]
  need = auto_sample_need(
    q_in,
    cache.key_codes,
    cache.key_exponents,
    length,
    eps=policy.eps,
    scale=scale,
  )  # [b, hk, g]
  long_row = (length >= AUTO_MIN_KEYS)[:, None]  # [b, 1]
  codes = long_row & jnp.any(need <= AUTO_THRESHOLD * m, -1)
  whole = long_row & (policy.max_topk is None) & ~codes
  if not _codes_pay(query, cache):  # concentrated rows: the exact search
    codes = jnp.zeros_like(codes)
  choice = jnp.where(codes, _CODES, jnp.where(whole, _ALL, _EXACT))
  cost = key_codes.code_cost(m, q.shape[-1], cache.keys.dtype)
  extra = jnp.broadcast_to(jnp.where(long_row, cost, 0), choice.shape)
  return choice.astype(jnp.int32), extra.astype(jnp.int32)


def _certified_codes(policy: Certified, query, cache: KVCache, scale, **kw):
  """``bound='codes'``: the key-code attempt (``_codes_attempt``), the exact
  search where it missed."""
  result, redo, code_cost = _codes_attempt(policy, query, cache, scale, 0, **kw)
  return _exact_unless(redo, result, policy, query, cache, scale, code_cost, kw)


def _exact_plus(policy, query, cache, scale, cost, kw):
  """The exact search of every row, ``cost`` ``[b, hk, g]`` products
  already spent added to its ``keys_scored``."""
  done = _certified_exact(policy, _step(query, cache, scale, **kw))
  return _plus_scored(done, cost)


def _exact_unless(redo, result, policy, query, cache, scale, cost, kw):
  """``result``, or where ``redo`` (a scalar) ``_exact_plus``: one copy of
  the exact search per program."""
  exact = functools.partial(_exact_plus, policy, query, cache, scale, cost, kw)
  return lax.cond(redo, exact, lambda: result)


def _codes_attempt(
  policy: Certified, query, cache: KVCache, scale, extra, **step_kw
):
  """Certified(eps) of every row from the key codes (THEORY 3.5):
  ``(result, redo, cost)``.

  Bounds l <= s <= u of every key from its code (``key_codes``); the
  candidates are the keys with u >= t, t the largest threshold whose
  unscored mass sum_{u < t} e^u fits eps sum e^l (<= eps Z); they are
  gathered and scored exactly, the kept set is the fewest of them meeting
  eps with the unscored bound as extra tail, and the certificate is the
  core's: the scored candidates plus sum_{u < t} e^{u_i} in the tail.
  ``redo`` (a scalar): some row's finished bound exceeds eps (rounding
  past the margins): the caller runs the exact search
  (``_exact_unless``), whose ``keys_scored`` then adds ``cost`` ``[b, hk,
  g]``, the codes' products and ``extra``.

  Args:
    policy: the Certified policy.
    query: ``[b, 1, h, d]``.
    cache: the KVCache.
    scale: logit scale.
    extra: ``[]`` int32 products already computed for the row (Auto's
      sample), added to ``keys_scored``.
    **step_kw: ``_step``'s keywords (``q_len``, ``residual``,
      ``candidates``, ``delta``), the exact search's too.
  """
  q_in, q = _queries(query, cache)
  dt = q.dtype
  n = cache.max_len
  q_c, w = key_codes.query_terms(q_in)
  t = _cache.code_products(cache.key_codes, q_c)  # [b, hk, g, n]
  u, lo = key_codes.bounds_from_products(t, w, cache.key_exponents, scale=scale)
  st = _step(query, cache, scale, s=u, **step_kw)
  real = st.real
  n_terms = 2 * n
  margin = core.search_log_margin(n_terms, st.delta, dt)
  log_eps = jnp.log(jnp.asarray(policy.eps, dt))
  # sum e^u = e^sigma sum e^l: aim the unscored mass at eps sum e^l. Both
  # sums relative to the max of u (l <= u: no overflow), one pass each.
  m_u = jnp.max(jnp.where(real, u, -jnp.inf), -1, initial=-jnp.inf)
  mm = jnp.where(jnp.isfinite(m_u), m_u, 0.0)[..., None]
  z_u = jnp.sum(jnp.where(real, jnp.exp(u - mm), 0.0), -1)
  z_l = jnp.sum(jnp.where(real, jnp.exp(lo - mm), 0.0), -1)
  log_frac = log_eps - margin - jnp.log(z_u) + jnp.log(z_l)  # [b, hk, g]
  # NaN, -inf (no lower mass above the flush): every key a candidate.
  log_frac = jnp.where(jnp.isnan(log_frac), -jnp.inf, log_frac)
  # One histogram pass: the threshold's resolution (~0.1 logit) only
  # decides how many candidates are scored, never the certificate.
  t = threshold.budget_threshold(
    u, log_frac, real, relative=True, row_max=m_u, levels=2
  )
  cand = real & (u >= t[..., None])
  count = jnp.sum(cand, -1, dtype=jnp.int32)  # [b, hk, g]
  code_cost = key_codes.code_cost(st.n_valid, q.shape[-1], cache.keys.dtype)
  base_cost = code_cost + extra
  below = real & ~cand
  vmax = jnp.broadcast_to(cache.vmax[..., None, None], u.shape)
  empty = core.PartialSoftmax.empty(
    count.shape, dt, d_v=cache.values.shape[-1], norms=True
  )
  below_part = empty.add_tail(u, below, norms=vmax)  # sum_{u < t} e^u
  log_below = below_part.tail_m + jnp.log(below_part.tail_sum)
  m_top = policy.max_topk if policy.max_topk and policy.max_topk < n else None

  chunk = min(n, CODES_CHUNK)
  cap = -(-n // chunk) * chunk  # whole chunks (slots past n: unused)
  small = min(cap, max(chunk, -(-n // CODES_SMALL)))

  def compact(size):
    def fn():
      idx, ok, _ = threshold.mask_indices(cand, size)  # [b, hk, g, size]
      pad = ((0, 0),) * 3 + ((0, cap - size),)
      return jnp.pad(idx, pad), jnp.pad(ok, pad)

    return fn

  def scored():
    # One compaction of the candidates; their keys and values are gathered
    # chunk by chunk (a loop whose trip count follows the candidates, and
    # whose buffers stay small: XLA:CPU pays page faults on large
    # temporaries).
    idx, ok = lax.cond(jnp.max(count) <= small, compact(small), compact(cap))
    trips = (jnp.max(count) + chunk - 1) // chunk

    def chunk_of(x, j):
      return lax.dynamic_slice_in_dim(x, j * chunk, chunk, axis=-1)

    def logits(j, buf):
      kc = _gather_values(cache.keys, chunk_of(idx, j)).astype(dt)
      sj = jnp.einsum("bkgd,bkgtd->bkgt", q, kc, precision=_HIGHEST) * scale
      return lax.dynamic_update_slice_in_dim(buf, sj, j * chunk, axis=-1)

    cs = lax.fori_loop(0, trips, logits, jnp.zeros(idx.shape, dt))
    cs = jnp.where(ok, cs, -jnp.inf)
    vn = jnp.broadcast_to(st.vn, u.shape)
    cvn = jnp.where(ok, jnp.take_along_axis(vn, idx, -1), 0.0)
    tt = threshold.budget_threshold(
      cs, log_eps - margin, ok, relative=True, log_extra=log_below
    )
    keep = ok & (cs >= tt[..., None])
    if m_top is not None:
      t2, n_above = threshold.topk_threshold(cs, m_top, ok)
      top = _tie_break(cs, ok, t2, n_above, jnp.full(count.shape, m_top))
      n_keep = jnp.sum(keep, -1, dtype=jnp.int32)
      keep = jnp.where((n_keep > m_top)[..., None], top, keep)
    # Chunks past the last kept slot hold no weight: stop there.
    last = jnp.max(jnp.where(keep, jnp.arange(cap, dtype=jnp.int32), -1))
    v_trips = (last + chunk) // chunk

    def value_fn(p):  # normalised kept weights, 0 off the kept set
      def step(j, acc):
        vj = _gather_values(cache.values, chunk_of(idx, j)).astype(p.dtype)
        return acc + jnp.einsum(
          "bkgt,bkgtd->bkgd", chunk_of(p, j), vj, precision=_HIGHEST
        )

      zero = jnp.zeros((*p.shape[:-1], cache.values.shape[-1]), p.dtype)
      return lax.fori_loop(0, v_trips, step, zero)

    head = core.PartialSoftmax.from_logits(
      cs,
      keep,
      ok,
      logit_error=st.delta,
      value_fn=value_fn,
      value_norms=cvn,
      keys_scored=0,
    )
    part = core.merge(head, below_part)
    return _done(st, part, keys_scored=base_cost + count)

  result = scored()
  # Safety net: float rounding beyond the margins (or an aim that missed):
  # a valid row certified above eps is redone exactly.
  return result, _over_eps(result, st, policy, m_top), base_cost


def _codes_rows(
  policy: Certified,
  query,
  cache: KVCache,
  scale,
  *,
  q_len=1,
  residual=False,
  candidates=True,
):
  """Certified over the key codes; with ``Auto``, the batch's choice.

  ``bound='codes'``: every row runs ``_certified_codes``. ``Auto``: each
  (batch, kv head) row's sample chooses (``_sample_choice``) and the batch
  runs the most general choice of its rows (``_CODES`` < ``_EXACT`` <
  ``_ALL``), batched: the codes when every row chose them, every key kept
  when some row looks flat (no ``max_topk``), the exact search otherwise;
  with more than ``AUTO_CODES_MAX_GROUP`` query heads per kv head no row
  takes the codes (concentrated rows: the exact search). A batch that
  keeps no row whole tries the block boxes first (``_box_search``).
  Rows that drew a sample add its cost to ``keys_scored``.

  No loop over rows: one branch per row (``lax.map``) copied every row's
  keys and values out of the cache, 4x dense on a mixed batch at n = 32K,
  8 heads, where keeping every key costs 1.2x (CPU; docs/performance.md).
  """
  b, _, h, _ = query.shape
  hk = cache.keys.shape[1]
  g = h // hk
  # Every branch below builds a step: the logit error once, outside them.
  delta = _logit_error(*_queries(query, cache), cache, scale)
  kw = dict(q_len=q_len, residual=residual, candidates=candidates, delta=delta)
  if policy.search.name != "auto":
    return _certified_codes(policy, query, cache, scale, **kw)
  choice, extra = _sample_choice(policy, query, cache, scale)  # [b, hk]
  x = jnp.broadcast_to(extra[..., None], (b, hk, g))

  def codes_else_exact():
    """The codes where every row chose them, the exact search where some
    row did not or the codes missed (one exact search in the program)."""

    def attempt():
      return _codes_attempt(policy, query, cache, scale, x, **kw)

    def skip():  # the exact search, after the sample only
      result = jax.tree.map(jnp.zeros_like, jax.eval_shape(attempt)[0])
      return result, jnp.bool_(True), x

    result, redo, cost = lax.cond(jnp.max(choice) == _CODES, attempt, skip)
    return _exact_unless(redo, result, policy, query, cache, scale, cost, kw)

  exact = functools.partial(_exact_plus, policy, query, cache, scale, x, kw)

  def keep_all():
    st = _step(query, cache, scale, **kw)
    done = _done(st, _full_row(st, st.real, st.s.shape[-1]))
    return _plus_scored(done, x)

  def boxes_first(fallback):
    """Concentrated rows: the block boxes first (``_box_search``),
    ``fallback`` where they are too loose."""
    return _box_search(
      policy, _step(query, cache, scale, **kw), fallback, extra=x
    )

  if not _codes_pay(query, cache):  # choices _EXACT or _ALL only
    concentrated = functools.partial(boxes_first, exact)
    return lax.cond(jnp.max(choice) == _ALL, keep_all, concentrated)
  concentrated = functools.partial(boxes_first, codes_else_exact)
  return lax.cond(jnp.max(choice) == _ALL, keep_all, concentrated)


def _plus_scored(done: _Done, extra) -> _Done:
  """``done`` with ``extra`` products (a sample's, an attempt's) added to
  its keys_scored."""
  part = done.part
  part = dataclasses.replace(part, keys_scored=part.keys_scored + extra)
  return dataclasses.replace(done, part=part)


# ``_xla_decode``'s static arguments (tests that patch a route constant
# trace it through a jit of their own: tests/attention/retrace.py).
XLA_DECODE_STATIC = ("policy", "static_scale", "residual", "candidates", "view")


@functools.partial(jax.jit, static_argnames=XLA_DECODE_STATIC)
def _xla_decode(
  query,
  cache,
  rng,
  scale,
  *,
  policy,
  static_scale,
  residual,
  candidates,
  view=None,
):
  if view is not None:  # e.g. a paged cache's KVCache view, in the program
    cache = view(cache)
  b, q_len, h, _ = query.shape
  hk = cache.keys.shape[1]
  scale = scale if static_scale is None else static_scale
  if q_len >= CHUNK_MIN_STEPS[policy.kind] and _chunk_supports(policy):
    return _chunk(query, cache, scale, policy=policy, residual=residual)
  if q_len > 1:  # the steps folded into the groups, one pass over the keys
    query = _fold(query, hk)
  kw = dict(q_len=q_len, residual=residual, candidates=candidates)
  certified = policy.kind == "certified"
  if certified and _by_codes(policy, cache):
    done = _codes_rows(policy, query, cache, scale, **kw)
  elif certified:
    st = _step(query, cache, scale, **kw)
    if policy.scores_all:
      done = _certified_exact(policy, st)
    else:
      done = _certified_search(policy, st, rng)
  else:
    done = _fixed_count(policy, _step(query, cache, scale, **kw))
  out, cert, lse = _final(done)  # the one finish of the program
  if q_len > 1:
    out, cert, lse = jax.tree.map(
      lambda x: _unfold(x, hk, q_len), (out, cert, lse)
    )
  else:
    out = out.reshape(b, 1, h, -1)
    cert, lse = jax.tree.map(lambda x: x.reshape(b, 1, h), (cert, lse))
  out = out.astype(query.dtype)  # [b, q_len, h, dv]
  if residual:
    return out, cert, lse
  return out, cert


def _chunk_supports(policy) -> bool:
  """Whether the blockwise prefill honours every field of ``policy``."""
  return policy.supported_by(_prefill.SUPPORTS)


def _chunk(query, cache, scale, *, policy, residual):
  """The newest ``q_len`` steps as a prefill chunk over the cache: the
  blockwise prefill with each sequence's causal offset ``length - q_len``,
  over the cache's head-major keys and stored value norms."""
  q_len = query.shape[1]
  out, cert, lse, _ = _prefill.blockwise_attention(
    query,
    _cache.dense_rows(cache.keys),
    _cache.dense_rows(cache.values),
    policy=policy,
    is_causal=True,
    scale=scale,
    scale_ok=checks.scale_ok(scale),
    kv_lens=cache.length,
    q_offset=cache.length - q_len,
    kv_layout="bhsd",
    value_norms=cache.value_norms,
    return_lse=residual,
  )
  return (out, cert, lse) if residual else (out, cert)


def xla_decode_attention(
  query, cache, rng, *, policy, scale, return_residual=False
):
  """The XLA implementation of ``decode_attention`` (see there)."""
  return decode_over(
    query, cache, rng, policy=policy, scale=scale, residual=return_residual
  )


def decode_over(query, cache, rng, *, policy, scale, residual, view=None):
  """``xla_decode_attention`` over ``view(cache)``, a KVCache built inside
  the compiled program (None: ``cache`` is one), so that what the
  decode does not read of it is never built (a paged cache's view)."""
  checks.check_policy(policy, _BACKEND, SUPPORTS)
  # Read per call (a static argument): the path follows the constant.
  candidates = cache.max_len >= CANDIDATE_MIN_KEYS
  kw = dict(policy=policy, residual=residual, candidates=candidates, view=view)
  if isinstance(scale, float):  # static: exact in any compute dtype
    return _xla_decode(query, cache, rng, None, static_scale=scale, **kw)
  return _xla_decode(query, cache, rng, scale, static_scale=None, **kw)


def _xla_op(query, cache, *, policy, scale, rng, return_residual=False):
  scale, rng = checks.check_decode_call(query, cache, policy, scale, rng)
  return xla_decode_attention(
    query,
    cache,
    rng,
    policy=policy,
    scale=scale,
    return_residual=return_residual,
  )


XLA_DECODE = registry.register(
  registry.AttentionOp(
    name="xla_decode",
    implementation="xla",
    kind="decode",
    fn=_xla_op,
    label=_BACKEND,
    supports=SUPPORTS,
    arguments=registry.DECODE_ARGUMENTS,
    cache_types=(KVCache,),
  )
)


def decode_attention(
  query,
  cache: KVCache,
  *,
  policy: Policy,
  scale=None,
  implementation: str | Sequence[str] | None = None,
  rng=None,
  return_residual: bool = False,
  key=None,
) -> tuple[jax.Array, Certificate] | tuple[jax.Array, jax.Array, Certificate]:
  """Top-k attention of the newest query steps of each sequence over a
  KVCache.

  THEORY 8.1 and 6.5. Attends to the cache's filled positions (append the
  current steps with ``KVCache.append`` first). A query of ``q_len`` > 1
  steps (chunked prefill, speculative verification): step i of sequence b
  sits at position ``length[b] - q_len + i`` and attends causally to the
  positions <= its own; a step that falls before the sequence's first key
  is a row with no real key (invalid, zeros). Every row is certified on its
  own; the XLA op folds the steps into the query groups (one pass over the
  keys, ``q_len`` rows x the cache per kv head), or, from
  ``CHUNK_MIN_STEPS`` steps (32 for Certified, 512 for Dense, 2,048 for
  fixed counts), runs them as a prefill chunk: the blockwise prefill of
  ``topk_attention`` with each sequence's causal offset (its tiles, its
  kept sets: Certified's minimal up to one coarse bin; MC-Search, which the
  prefill refuses, stays on the folded rows). Fixed-count policies keep
  the ``topk`` largest logits (Ratio and PowerLaw count the filled
  positions) and gather only the kept values; Certified 'exact' keeps the
  fewest keys meeting eps (up to one finest histogram bin, see
  ``selection.threshold``); 'delta' and 'mc' skip blocks using the cache's
  box summaries (THEORY 6.2/6.3; ``policy.block_size`` must equal the
  cache's). ``Certified.max_topk`` caps the kept set on every strategy (the
  row then reports its true, larger bound). See the module docstring for
  how the XLA path stays close to the cost of the logits.

  The op is chosen from the registry (``attention.registry``) by
  ``implementation`` and the cache's type: over an IndexedKVCache 'xla' is
  the content index's search (``attention._index_decode``); over a
  PagedKVCache it is this XLA decode over its pages, read where they are
  read (``attention._paged``).

  Args:
    query: ``[batch, q_len, num_heads, head_dim]``, q_len >= 1; num_heads a
      multiple of the cache's kv heads. Ops that attend one step only
      ('pallas', 'sharded') refuse q_len > 1 by name.
    cache: a KVCache, a PagedKVCache (read from its page pool), or an
      IndexedKVCache (which searches its groups).
    policy: a selection policy.
    scale: logit scale, default 1/sqrt(head_dim); a number >= float32's
      smallest normal (``core.MIN_SCALE``), or a JAX scalar (traced OK; rows
      are invalid where it is not finite and >= ``core.MIN_SCALE``).
    implementation: None or 'xla', a registered implementation ('pallas';
      'sharded' under ``jax.set_mesh``), or a sequence of them tried in
      order: one that refuses the call (a policy field, the scale, the
      cache type, the platform) falls through to the next.
    rng: PRNG key for Certified(search='mc') (``key=`` is its deprecated
      name: warns).
    return_residual: also return the log-sum-exp residual (below), to merge
      partial results with ``merge_attention``; ops that cannot refuse it
      by name.

  Returns:
    ``(output, certificate)``: ``[batch, q_len, num_heads, head_dim_v]`` in
    the query's dtype (zeros for a row with no real key) and a Certificate
    with arrays ``[batch, q_len, num_heads]`` (valid = False for such a
    row). With ``return_residual``, ``(output, lse, certificate)``: ``lse``
    ``[batch, q_len, num_heads]`` in the compute dtype (float32 for
    float32/bfloat16 queries), the log-sum-exp of the scaled (computed)
    logits of the kept keys, from which the output was computed; the most
    negative finite float (log 0) for a row with no real key, NaN for a
    row with keys that is not valid (``core.log_sum_exp_residual``). Not
    differentiable (a stop-gradient).

  Raises:
    TypeError: a non-policy, or a query that is not real floating.
    ValueError: on bad shapes, heads, scale or block size, or 'mc' without
      ``rng``, or an unknown implementation.
    UnsupportedPolicyError: a policy field the implementation cannot honour
      (named).
    UnsupportedCacheError: (a ValueError) no op of the implementation
      attends over the cache's type.
    NotImplementedError: for an unregistered 'pallas' implementation.
  """
  query = checks.check_array(query, "query")
  checks.check_policy(policy)
  rng = rng_argument(rng, key, "decode_attention")
  if not isinstance(return_residual, bool):
    raise TypeError(f"{return_residual=} must be a bool")

  def call(op):
    kw = dict(return_residual=True) if return_residual else {}
    return op.fn(query, cache, policy=policy, scale=scale, rng=rng, **kw)

  result = registry.dispatch(
    "decode",
    implementation,
    call,
    policy=policy,
    cache=cache,
    given=registry.decode_arguments(
      query, scale=scale, return_residual=return_residual
    ),
  )
  if not return_residual:
    return result
  out, cert, lse = result
  return out, lax.stop_gradient(lse), cert


def topk_indices(s, topk, valid, max_topk):
  """Indices of a Top-k set of each row without sorting the row.

  The fixed-count selection of ``decode_attention`` on its own: a bracket
  from strided column maxima, the candidates above it compacted, the exact
  threshold among them (``selection.threshold``); the full row when the
  candidates do not fit.

  Args:
    s: ``[..., n]`` float32/64 logits.
    topk: ``[...]`` int32 kept count per row (<= max_topk, <= real keys).
    valid: ``[..., n]`` bool.
    max_topk: static upper bound on ``topk``.

  Returns:
    ``(idx, kept, thresh)``: ``[..., max_topk]`` int32 positions (entries
    past ``topk`` are padding), ``[..., max_topk]`` bool True for the
    ``topk`` real entries, and ``[...]`` the topk-th largest logit (the
    smallest kept). Ties at the threshold: some tied keys are kept, which
    ones is unspecified (strided column order).
  """
  s = jnp.asarray(s)
  valid = jnp.broadcast_to(valid, s.shape)
  topk = jnp.broadcast_to(jnp.asarray(topk, jnp.int32), s.shape[:-1])
  n = s.shape[-1]
  group = _group_for(n, max_topk)

  def full():
    t, n_above = threshold.topk_threshold(s, topk, valid)
    keep = _tie_break(s, valid, t, n_above, topk)
    idx, ok, _ = threshold.mask_indices(keep, max_topk)
    return idx, ok, t

  if group < 4:
    return full()
  cap = min(n, 2 * max_topk + 16)
  bmax = threshold.column_max(s, valid, group=group)
  lo, _ = threshold.topk_threshold(bmax, topk, bmax > -jnp.inf)
  ge = valid & (s >= lo[..., None])

  def fast():
    idx, ok, _ = threshold.mask_indices(ge, cap, group=group)
    cs = jnp.where(ok, jnp.take_along_axis(s, idx, -1), -jnp.inf)
    t, n_above = threshold.topk_threshold(cs, topk, ok)
    kept = _tie_break(cs, ok, t, n_above, topk)
    kidx, kok, _ = threshold.mask_indices(kept, max_topk, strided=False)
    return jnp.take_along_axis(idx, kidx, -1), kok, t

  count = jnp.sum(ge, axis=-1, dtype=jnp.int32)
  n_valid = jnp.sum(valid, axis=-1, dtype=jnp.int32)
  fits = jnp.all(count <= cap) & jnp.all(count >= jnp.minimum(topk, n_valid))
  return lax.cond(fits, fast, full)
