"""A KV cache whose keys are grouped by content, with sound group summaries.

THEORY 3.3 (any sound per-group logit bound gives the blockwise
tail bound), 6.2/6.3 (searches over the groups, ``_index_search.py``).

Blocks of consecutive positions have loose summaries on real keys (a block's
bound sits ~5 logits above its keys on MiniLM, RESULTS 5): neighbouring
tokens are not close in key space. Here keys are grouped by CONTENT:

- Build (``IndexedKVCache.build``): Lloyd k-means in key space (Euclidean, the
  metric of the ball bound) into ``num_clusters`` clusters, then every
  cluster is cut into groups of at most ``group_size`` keys along the
  direction from its centre to its farthest key (so a big cluster becomes
  several tight groups). With ``G = ceil(max_len / C) + num_clusters``
  groups of capacity ``C`` every cluster fits (it wastes less than one
  group), and the spare groups take appended keys.
- Storage: keys and values live GROUPED, head-major, contiguous per group
  (``[batch, kv_heads, groups, C, head_dim]``), so a search that skips a
  group never reads its keys or values; ``position`` maps slots back to
  sequence positions and ``slot`` positions to slots.
- Summary per group (float32, float64 under x64): the centre c (mean of the
  members at build time, or the first key of a group opened later), the
  radius r >= max ||k_i - c|| rounded up (scaled norms, flushed subnormals
  covered), ||c|| rounded up, the member count and the largest value norm.
  The ball bound scale (q.c + ||q|| r) >= scale q.k_i (Cauchy-Schwarz) is
  computed, with its rounding, in ``_index_search.group_upper_bounds``.
- Append (``IndexedKVCache.append``, one decode step): a new key joins the
  nearest non-full group (its centre is NOT moved, its radius grows to
  cover the key: summaries stay sound with O(groups * head_dim) work and no
  rebuild). If the key lies farther than ``OPEN_FACTOR`` times that
  group's radius and times the build's mean radius (``open_radius``), it
  opens a spare empty group with itself as centre instead (online leader
  clustering; in high dimension a cluster's keys sit at nearly the same
  distance from its centre, so a key just past the largest one seen still
  belongs to it, while another cluster's keys lie several radii away).
  Keys that had to enlarge a ball beyond that threshold (no spare group
  left) are counted in ``spilled``;
  ``IndexedKVCache.rebuild`` re-clusters everything (the caller decides when,
  e.g. every few thousand steps or when ``spilled / length`` passes a
  threshold; BUILD_NOTES measures the cost of not rebuilding).

Masked or unfilled positions are simply absent from every group.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtopk import _deprecation
from jaxtopk.attention import _decode
from jaxtopk.attention import _kmeans
from jaxtopk.attention import checks
from jaxtopk.attention._cache import KVCache
from jaxtopk.attention._cache import check_append
from jaxtopk.attention._cache import check_live
from jaxtopk.selection import core
from jaxtopk.selection import key_codes
from jaxtopk.selection.internal import rng_argument

DEFAULT_GROUP_SIZE = 64
OPEN_FACTOR = 1.5  # an appended key this many radii away opens a group
_ROUND_MACS = 1 << 17  # multiply-adds of q.k per search round (default)


def norm_up(x) -> jax.Array:
  """``[...]`` ||x||_2 over the last axis, rounded up (``core.norms_up``)."""
  return core.norms_up(x, -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class IndexedKVCache:
  """Keys and values grouped by content, with per-group ball summaries.

  Make one with ``IndexedKVCache.build`` (or ``from_cache``); append with
  ``index = index.append(keys, values)`` (donating, as ``KVCache.append``);
  re-cluster with ``index.rebuild()``.

  Shapes use ``b`` batch, ``hk`` kv heads, ``G`` groups, ``C`` group
  capacity (``group_size``), ``d`` head dim, ``dv`` value dim, ``n`` the
  capacity in positions (``max_len``).

  Attributes:
    keys: ``[b, hk, G, C, d]`` stored keys (cache dtype), grouped.
    values: ``[b, hk, G, C, dv]`` stored values (cache dtype), grouped.
    position: ``[b, hk, G, C]`` int32 sequence position of each slot, -1 for
      an empty slot. A group's members occupy its first ``count`` slots.
    count: ``[b, hk, G]`` int32 members per group.
    centre: ``[b, hk, G, d]`` float32 group centre c (0 for empty groups).
    radius: ``[b, hk, G]`` float32 r >= max_i ||k_i - c|| (exact values of
      the stored keys and of c), rounded up; NaN for a group holding a key
      with a non-finite component (its keys cannot be bounded: a row that
      leaves them unscored is invalid).
    centre_norm: ``[b, hk, G]`` float32 ||c|| rounded up.
    vnorm: ``[b, hk, G]`` float32 largest ||v|| of the members, rounded up
      (``core.value_norms``: compressed above 2^126).
    value_norms: ``[b, hk, G, C]`` float32 ||v|| of each slot's value as
      ``core.value_norms`` gives it (NaN for a value with a non-finite
      component; 0 in empty slots), kept at build and append so that no
      decode recomputes them.
    slot: ``[b, hk, n]`` int32 ``g * C + j`` of each filled position, -1
      for unfilled positions.
    key_absmax: ``[b, hk, d]`` float32 max_i |k_ic| over the stored keys
      (bounds the rounding of every logit, ``core.abs_dot_box``).
    key_norm: ``[b, hk]`` float32 max_i ||k_i|| rounded up.
    key_flushed: ``[b, hk]`` bool, some stored key has subnormal
      components (read as 0 by a CPU; ``core.logit_error_bound``).
    open_radius: ``[b, hk]`` float32 mean group radius at build: a new key
      farther than ``OPEN_FACTOR`` times this (and its nearest group's
      radius) opens a group.
    spilled: ``[b, hk]`` int32 appended keys that enlarged a group's ball
      beyond that threshold (a quality statistic; rebuild when it grows).
    length: ``[b]`` int32 filled positions (0 .. length - 1).
    key_codes: ``[b, hk, d, n]`` int8 8-bit codes of the stored keys in
      POSITION order, d-major (THEORY 3.5, ``selection.key_codes``; 0 at
      unfilled positions): per-key logit bounds at a quarter of the keys'
      bytes, summed per group by the searches.
    key_exponents: ``[b, hk, n]`` their exponents.
    group_size: static capacity C of a group.
    groups_per_round: static number of groups the searches score per round.
  """

  keys: jax.Array
  values: jax.Array
  position: jax.Array
  count: jax.Array
  centre: jax.Array
  radius: jax.Array
  centre_norm: jax.Array
  vnorm: jax.Array
  value_norms: jax.Array
  slot: jax.Array
  key_absmax: jax.Array
  key_norm: jax.Array
  key_flushed: jax.Array
  open_radius: jax.Array
  spilled: jax.Array
  length: jax.Array
  key_codes: jax.Array
  key_exponents: jax.Array
  group_size: int = dataclasses.field(metadata=dict(static=True))
  groups_per_round: int = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def build(
    cls,
    keys,
    values,
    *,
    lengths=None,
    max_len: int | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    num_clusters: int | None = None,
    kmeans_iters: int = 8,
    groups_per_round: int | None = None,
    seed: int = 0,
  ) -> "IndexedKVCache":
    """Groups keys by content (k-means, then split) and indexes them.

    Args:
      keys: ``[batch, n, kv_heads, head_dim]`` (jax.nn layout; transposed
        to head-major once here).
      values: ``[batch, n, kv_heads, head_dim_v]``.
      lengths: optional ``[batch]`` integers (or one for every row), real
        positions per row (the first ``lengths[b]``), in [0, n]; default
        all ``n`` (traced lengths are clipped to [0, n]).
      max_len: capacity in positions (>= n), room for ``append``; default
        ``n``.
      group_size: capacity C of a group (static), the unit the searches
        read.
      num_clusters: k-means clusters (static), default ``ceil(max_len /
        C)`` (clusters of about C keys); the index holds ``ceil(max_len /
        C) + num_clusters`` groups, i.e. ``1 + num_clusters C / max_len``
        times the positions' memory (2x by default). Fewer clusters save
        memory but merge clusters into looser groups.
      kmeans_iters: Lloyd iterations (static), on a sample of ``16 *
        num_clusters`` evenly spaced keys; then every key is assigned.
      groups_per_round: groups each search round scores (static), default
        ``max(1, 2**17 // (group_size * head_dim))``: ~131K multiply-adds
        a round (1,024 keys at head_dim 128), enough to amortise a round's
        fixed cost, small enough to keep the gathered keys in cache (on
        XLA:CPU one gather of a quarter of a 65,536-key cache took 3x the
        whole logits einsum; BUILD_NOTES).
      seed: seed of the k-means++ seeding (static).

    Returns:
      An IndexedKVCache holding the first ``lengths`` positions of each
      row.

    Raises:
      TypeError: keys or values not real floating (int, bool and complex
        are refused by name), lengths not integers.
      ValueError: on bad shapes or sizes, lengths out of [0, n].

    Example:
      >>> import jax, jaxtopk
      >>> k = jax.random.normal(jax.random.key(0), (1, 300, 2, 16))
      >>> index = jaxtopk.IndexedKVCache.build(k, k, group_size=32)
      >>> index.keys.shape  # ceil(300 / 32) + 10 clusters: 20 groups of 32
      (1, 2, 20, 32, 16)
    """
    return _build_checked(
      keys,
      values,
      lengths=lengths,
      max_len=max_len,
      group_size=group_size,
      num_clusters=num_clusters,
      kmeans_iters=kmeans_iters,
      groups_per_round=groups_per_round,
      seed=seed,
    )

  @classmethod
  def from_cache(cls, cache: KVCache, **kwargs) -> "IndexedKVCache":
    """``IndexedKVCache.build`` over a ``KVCache``'s filled positions.

    Keeps its ``max_len``; ``kwargs`` as ``build``. ``cache`` stays valid.
    """
    check_live(cache, "from_cache")
    keys = jnp.swapaxes(cache.keys, 1, 2)  # back to [b, n, hk, d]
    values = jnp.swapaxes(cache.values, 1, 2)
    kwargs.setdefault("max_len", cache.max_len)
    return cls.build(keys, values, lengths=cache.length, **kwargs)

  def append(
    self, keys, values, *, num_steps=None, donate: bool = True
  ) -> "IndexedKVCache":
    """Appends ``steps`` positions to every batch row (a decode step, ...).

    Each key joins its nearest non-full group (or opens a spare group when
    it lies outside every ball; see the module docstring); the group's
    radius, value norm and the index's key maxima grow to cover it, so
    every summary stays sound. O(steps * groups * head_dim) work per head
    (the nearest group), no rebuild and no copy of the index. Positions
    past ``max_len`` are dropped and ``length`` saturates.

    The append DONATES this index, as ``KVCache.append``: its buffers are
    updated in place and become the returned index's. This object must not
    be used afterwards (rebind: ``index = index.append(k, v)``); using it
    raises jax's deleted-array RuntimeError, never a wrong result. To keep
    it, append to a copy (``jax.tree.map(jnp.copy, index)``) or pass
    ``donate=False``. Under ``jax.jit`` nothing is donated (the caller's
    jit decides).

    Args:
      keys: ``[batch, steps, kv_heads, head_dim]`` (jax.nn layout).
      values: ``[batch, steps, kv_heads, head_dim_v]``.
      num_steps: optional ``[batch]`` integers (or one for every row), how
        many of the steps are real (ragged appends, as ``KVCache.append``:
        in [0, steps] when concrete, clipped when traced).
      donate: False leaves this index valid and copies it (as
        ``KVCache.append``).

    Returns:
      The updated IndexedKVCache.

    Raises:
      TypeError: keys or values not real floating, num_steps not integers.
      ValueError: if keys/values shapes do not match the index, or
        num_steps is not ``[batch]`` / a scalar or out of range.
      RuntimeError: this index was donated to an earlier append.
    """
    keys, values, num_steps = _checked(self, keys, values, num_steps)
    update = _index_append if donate else _index_update
    return update(self, keys, values, num_steps)

  def rebuild(self, **kwargs) -> "IndexedKVCache":
    """Re-clusters every stored key from scratch (same capacity).

    ``kwargs`` override ``build``'s options (default: this index's group
    size and rounds, ``num_clusters`` from the group count). This index
    stays valid.
    """
    check_live(self, "rebuild")
    return _rebuild(self, **kwargs)

  @property
  def max_len(self) -> int:
    return self.slot.shape[2]

  @property
  def num_groups(self) -> int:
    return self.count.shape[2]

  @property
  def head_dim(self) -> int:
    return self.keys.shape[-1]

  def decode_attention(
    self,
    query,
    *,
    policy,
    scale=None,
    implementation=None,
    rng=None,
    return_residual=False,
    key=None,
  ):
    """``jaxtopk.decode_attention`` over this index (see there)."""
    rng = rng_argument(rng, key, "IndexedKVCache.decode_attention")
    return _decode.decode_attention(
      query,
      self,
      policy=policy,
      scale=scale,
      implementation=implementation,
      rng=rng,
      return_residual=return_residual,
    )


def _segment_max(x, seg, num, fill):
  return jax.ops.segment_max(x, seg, num, indices_are_sorted=False).clip(
    min=fill
  )


def _group_summaries(x, v, valid, grp, num_groups):
  """Centre, radius, ||c||, count, value-norm max of each group of a row,
  and the value norm of each key (0 where not valid)."""
  w = valid.astype(x.dtype)
  g = jnp.where(valid, grp, num_groups)  # invalid keys: dropped segment
  cnt = jax.ops.segment_sum(valid.astype(jnp.int32), g, num_groups + 1)
  tot = jax.ops.segment_sum(x * w[:, None], g, num_groups + 1)
  centre = tot / jnp.maximum(cnt, 1)[:, None].astype(x.dtype)
  centre = centre[:num_groups]  # [G, d]
  dist = radius_to(x, centre[jnp.minimum(g, num_groups - 1)])  # [n]
  dist = jnp.where(valid, dist, 0.0)
  radius = _segment_max(dist, g, num_groups + 1, 0.0)[:num_groups]
  # segment_max drops NaN; a non-finite key makes its group's radius NaN
  # (read by ``group_upper_bounds``), a non-finite value its group's norm.
  kbad = ~jnp.all(jnp.isfinite(x), -1) & valid
  kbad = jax.ops.segment_max(kbad.astype(jnp.int32), g, num_groups + 1)
  radius = jnp.where(kbad[:num_groups] > 0, jnp.nan, radius)
  vn = jnp.where(valid, core.value_norms(v).astype(x.dtype), 0.0)
  bad = jax.ops.segment_max(jnp.isnan(vn).astype(jnp.int32), g, num_groups + 1)
  vnorm = _segment_max(vn, g, num_groups + 1, 0.0)[:num_groups]
  vnorm = jnp.where(bad[:num_groups] > 0, jnp.nan, vnorm)
  return centre, radius, norm_up(centre), cnt[:num_groups], vnorm, vn


def radius_to(x, c) -> jax.Array:
  """``[...]`` an upper bound on ||x - c|| for the exact stored values.

  The difference is rounded (relative eps, or flushed to 0 below the
  smallest normal): ||x - c|| <= ||fl(x - c)|| (1 + eps) + sqrt(d) tiny.
  XLA may also recompute c inside a fusion with another rounding than the
  stored c (a division turned into a multiply by a reciprocal: 1-2 ulps;
  seen in a test as a radius 1.5 ulps short), so 4 eps ||c|| is added.
  """
  dt = x.dtype
  d = x.shape[-1]
  fin = jnp.finfo(dt)
  r = norm_up(x - c) * (1 + 2 * fin.eps) + 4 * fin.eps * norm_up(c)
  return r + 2 * (d**0.5) * fin.tiny


def _chunk_slots(sub, t, valid, num_sub, c_sz, num_groups):
  """Slots of groups of at most C keys: each sub-cluster in t order.

  Returns:
    ``(slot, n_used)``: ``[n]`` int32 ``g * C + j`` (out of range for
    invalid keys) and the number of groups used.
  """
  n = sub.shape[0]
  sub = jnp.where(valid, sub, num_sub)
  order = jnp.lexsort((t, sub))  # by sub-cluster, then along t
  size = jax.ops.segment_sum(valid.astype(jnp.int32), sub, num_sub + 1)
  size = size[:num_sub]
  ngrp = (size + c_sz - 1) // c_sz  # groups per sub-cluster
  offset = jnp.cumsum(ngrp) - ngrp
  start = jnp.cumsum(size) - size
  s_s = sub[order]
  s_c = jnp.minimum(s_s, num_sub - 1)
  rank = jnp.arange(n) - start[s_c]  # rank within its sub-cluster
  slot_s = (offset[s_c] + rank // c_sz) * c_sz + rank % c_sz
  slot_s = jnp.where(s_s < num_sub, slot_s, num_groups * c_sz)  # dropped
  slot = jnp.zeros((n,), jnp.int32).at[order].set(slot_s.astype(jnp.int32))
  return slot, jnp.sum(ngrp)


def _build_row(
  keys,
  values,
  valid,
  rng,
  *,
  num_groups,
  group_size,
  num_clusters,
  iters,
  max_len,
):
  """Clusters, splits and scatters one (batch, kv head) row."""
  n, d = keys.shape
  dt = core.compute_dtype(keys.dtype)
  x = keys.astype(dt)
  c_sz = group_size
  k = num_clusters
  a, c = _kmeans.kmeans_row(
    x, valid, k, iters, min(n, 16 * k), rng
  )  # [n] in [0, K]
  sub, t = _kmeans.bisect_oversized(x, valid, a, c, c_sz)  # [n] in [0, 2K]
  slot, n_used = _chunk_slots(sub, t, valid, 2 * k, c_sz, num_groups)
  # Fallback (never needed in the runs of BUILD_NOTES): if the bisected
  # clusters need more groups than exist, chunk the k-means clusters as
  # they are (at most ceil(n / C) + K groups, which always fit).
  slot0, _ = _chunk_slots(2 * a, t, valid, 2 * k, c_sz, num_groups)
  slot = jnp.where(n_used <= num_groups, slot, slot0)
  idx = jnp.arange(n)
  grp = slot // c_sz
  flat = num_groups * c_sz
  kg = jnp.zeros((flat, d), keys.dtype).at[slot].set(keys, mode="drop")
  vg = jnp.zeros((flat, values.shape[-1]), values.dtype)
  vg = vg.at[slot].set(values, mode="drop")
  pos = jnp.full((flat,), -1, jnp.int32).at[slot].set(idx, mode="drop")
  centre, radius, cnorm, cnt, vnorm, vn = _group_summaries(
    keys.astype(dt), values, valid, grp, num_groups
  )
  vns = jnp.zeros((flat,), vn.dtype).at[slot].set(vn, mode="drop")
  slot_of = jnp.full((max_len,), -1, jnp.int32)
  slot_of = slot_of.at[idx].set(jnp.where(valid, slot, -1), mode="drop")
  absmax = core.max_nan(jnp.where(valid[:, None], jnp.abs(x), 0.0), 0)
  knorm = core.max_nan(jnp.where(valid, norm_up(x), 0.0), None, initial=0.0)
  kflush = jnp.any(valid & core.flushed(keys, -1))
  nonempty = (cnt > 0) & ~jnp.isnan(radius)  # NaN: a non-finite key
  open_r = jnp.sum(jnp.where(nonempty, radius, 0.0)) / jnp.maximum(
    jnp.sum(nonempty), 1
  )
  return dict(
    keys=kg.reshape(num_groups, c_sz, d),
    values=vg.reshape(num_groups, c_sz, -1),
    position=pos.reshape(num_groups, c_sz),
    count=cnt,
    centre=centre,
    radius=radius,
    centre_norm=cnorm,
    vnorm=vnorm,
    value_norms=vns.reshape(num_groups, c_sz),
    slot=slot_of,
    key_absmax=absmax,
    key_norm=knorm,
    key_flushed=kflush,
    open_radius=open_r,
  )


@functools.partial(
  jax.jit,
  static_argnames=(
    "max_len",
    "group_size",
    "num_clusters",
    "kmeans_iters",
    "groups_per_round",
    "seed",
  ),
)
def _build(
  keys,
  values,
  lengths,
  *,
  max_len,
  group_size,
  num_clusters,
  kmeans_iters,
  groups_per_round,
  seed,
):
  b, n, hk, d = keys.shape
  num_groups = -(-max_len // group_size) + num_clusters
  kh = jnp.swapaxes(keys, 1, 2)  # [b, hk, n, d] head-major, once
  vh = jnp.swapaxes(values, 1, 2)
  valid = jnp.arange(n)[None, :] < lengths[:, None]  # [b, n]
  fn = functools.partial(
    _build_row,
    num_groups=num_groups,
    group_size=group_size,
    num_clusters=num_clusters,
    iters=kmeans_iters,
    max_len=max_len,
  )
  rngs = jax.random.split(jax.random.key(seed), (b, hk))
  over_h = jax.vmap(fn, in_axes=(0, 0, None, 0))
  out = jax.vmap(over_h)(kh, vh, valid, rngs)
  codes, expo = key_codes.encode_keys(kh)  # [b, hk, n, d], [b, hk, n]
  real = valid[:, None, :]
  codes = jnp.swapaxes(jnp.where(real[..., None], codes, 0), -1, -2)
  expo = jnp.where(real, expo, 0)
  pad = max_len - n
  return IndexedKVCache(
    **out,
    spilled=jnp.zeros((b, hk), jnp.int32),
    length=lengths,
    key_codes=jnp.pad(codes, ((0, 0), (0, 0), (0, 0), (0, pad))),
    key_exponents=jnp.pad(expo, ((0, 0), (0, 0), (0, pad))),
    group_size=group_size,
    groups_per_round=groups_per_round,
  )


def _check_int(name, val, lo=1):
  if isinstance(val, bool | np.bool_) or not isinstance(val, int | np.integer):
    raise ValueError(f"{name}={val!r} must be an int >= {lo}")
  if val < lo:
    raise ValueError(f"{name}={val!r} must be an int >= {lo}")


def _build_checked(
  keys,
  values,
  *,
  lengths,
  max_len,
  group_size,
  num_clusters,
  kmeans_iters,
  groups_per_round,
  seed,
) -> IndexedKVCache:
  keys = checks.check_array(keys, "keys")
  values = checks.check_array(values, "values")
  if keys.ndim != 4:
    raise ValueError(
      f"keys must be [batch, n, kv_heads, head_dim]; got {keys.shape=}"
    )
  b, n, hk, d = keys.shape
  if values.ndim != 4 or values.shape[:3] != keys.shape[:3]:
    raise ValueError(
      f"values must be [batch={b}, n={n}, kv_heads={hk}, head_dim_v]; got"
      f" {values.shape=}"
    )
  max_len = n if max_len is None else max_len
  _check_int("max_len", max_len)
  _check_int("group_size", group_size)
  _check_int("kmeans_iters", kmeans_iters, lo=0)
  _check_int("seed", seed, lo=0)
  if max_len < n:
    raise ValueError(f"{max_len=} must be >= the number of keys {n=}")
  if num_clusters is None:
    num_clusters = max(1, -(-max_len // group_size))
  _check_int("num_clusters", num_clusters)
  if n < 1:
    raise ValueError(f"keys must hold at least one position; got {n=}")
  num_clusters = min(num_clusters, n)
  if groups_per_round is None:
    groups_per_round = max(1, _ROUND_MACS // (group_size * d))
  _check_int("groups_per_round", groups_per_round)
  if lengths is None:
    lengths = jnp.full((b,), n, jnp.int32)
  else:
    lengths = checks.check_counts(lengths, "lengths", b, n)
  return _build(
    keys,
    values,
    lengths,
    max_len=max_len,
    group_size=group_size,
    num_clusters=num_clusters,
    kmeans_iters=kmeans_iters,
    groups_per_round=groups_per_round,
    seed=seed,
  )


def _rebuild(index: IndexedKVCache, **kwargs) -> IndexedKVCache:
  b, hk, g, c, d = index.keys.shape
  n = index.max_len
  pos = index.position.reshape(b, hk, g * c)
  pos = jnp.where(pos >= 0, pos, n)  # empty slots: dropped

  def back(x):
    x = x.reshape(b, hk, g * c, x.shape[-1])
    out = jnp.zeros((b, hk, n, x.shape[-1]), x.dtype)
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(hk)[None, :, None]
    out = out.at[bi, hi, pos].set(x, mode="drop")
    return jnp.swapaxes(out, 1, 2)  # [b, n, hk, .]

  kwargs.setdefault("group_size", index.group_size)
  kwargs.setdefault("groups_per_round", index.groups_per_round)
  kwargs.setdefault("num_clusters", g - (-(-n // index.group_size)))
  return IndexedKVCache.build(
    back(index.keys),
    back(index.values),
    lengths=index.length,
    max_len=n,
    **kwargs,
  )


def _append_row(row, k, v, pos, write, c_sz):
  """Puts one key/value into one (batch, kv head) row of the index."""
  dt = row["centre"].dtype
  x = k.astype(dt)
  cnt = row["count"]
  dist = radius_to(x[None, :], row["centre"])  # [G]
  cand = (cnt > 0) & (cnt < c_sz)
  dn = jnp.where(cand, dist, jnp.inf)
  near = jnp.argmin(dn)
  thresh = OPEN_FACTOR * jnp.maximum(row["radius"][near], row["open_radius"])
  empty = cnt == 0
  fresh = jnp.argmax(empty)
  # near is a group with room only if some distance was finite: distances
  # of keys near the largest float overflow (inf, or NaN from inf - inf),
  # and argmin of all-inf picks group 0, full or not.
  near_ok = cand[near]
  far = ~near_ok | (dn[near] > thresh)
  opening = jnp.any(empty) & far
  room = jnp.argmax(cnt < c_sz)  # any group with room: never dropped
  g = jnp.where(opening, fresh, jnp.where(near_ok, near, room))
  j = cnt[g]
  ok = write & (j < c_sz)
  centre_g = jnp.where(opening, x, row["centre"][g])
  r_new = jnp.where(opening, radius_to(x, x), dist[g])
  # A non-finite key marks its group (NaN radius: ``group_upper_bounds``).
  r_new = jnp.where(jnp.all(jnp.isfinite(x)), r_new, jnp.nan)
  upd = lambda a, val: a.at[g].set(jnp.where(ok, val, a[g]))
  out = dict(row)
  out["centre"] = upd(row["centre"], centre_g)
  out["centre_norm"] = upd(row["centre_norm"], norm_up(centre_g))
  out["radius"] = upd(row["radius"], jnp.maximum(row["radius"][g], r_new))
  vn = core.value_norms(v[None, :])[0].astype(dt)
  vmax = jnp.where(jnp.isnan(vn), jnp.nan, jnp.maximum(row["vnorm"][g], vn))
  out["vnorm"] = upd(row["vnorm"], vmax)
  out["count"] = upd(cnt, j + 1)
  jj = jnp.where(ok, j, c_sz)  # out of range: dropped
  out["keys"] = row["keys"].at[g, jj].set(k, mode="drop")
  out["values"] = row["values"].at[g, jj].set(v, mode="drop")
  out["position"] = row["position"].at[g, jj].set(pos, mode="drop")
  out["value_norms"] = row["value_norms"].at[g, jj].set(vn, mode="drop")
  p = jnp.where(ok, pos, row["slot"].shape[0])
  out["slot"] = row["slot"].at[p].set(g * c_sz + j, mode="drop")
  absmax = jnp.maximum(row["key_absmax"], jnp.abs(x))
  out["key_absmax"] = jnp.where(ok, absmax, row["key_absmax"])
  knorm = jnp.maximum(row["key_norm"], norm_up(x))
  out["key_norm"] = jnp.where(ok, knorm, row["key_norm"])
  kflush = row["key_flushed"] | core.flushed(k, -1)
  out["key_flushed"] = jnp.where(ok, kflush, row["key_flushed"])
  grew = ok & ~opening & (dist[g] > thresh)
  out["spilled"] = row["spilled"] + grew.astype(jnp.int32)
  return out, ok


_ROW_FIELDS = (
  "keys",
  "values",
  "position",
  "count",
  "centre",
  "radius",
  "centre_norm",
  "vnorm",
  "value_norms",
  "slot",
  "key_absmax",
  "key_norm",
  "key_flushed",
  "open_radius",
  "spilled",
)


def _checked(index: IndexedKVCache, keys, values, num_steps):
  check_live(index, "append")
  b, hk, _, _, d = index.keys.shape
  return check_append(keys, values, b, hk, d, index.values.shape[-1], num_steps)


def build_kv_index(keys, values, **kwargs) -> IndexedKVCache:
  """Deprecated: ``jaxtopk.IndexedKVCache.build`` (same arguments)."""
  _deprecated("build_kv_index", "IndexedKVCache.build")
  return IndexedKVCache.build(keys, values, **kwargs)


def kv_index_from_cache(cache: KVCache, **kwargs) -> IndexedKVCache:
  """Deprecated: ``jaxtopk.IndexedKVCache.from_cache`` (same arguments)."""
  _deprecated("kv_index_from_cache", "IndexedKVCache.from_cache")
  return IndexedKVCache.from_cache(cache, **kwargs)


def rebuild_kv_index(index: IndexedKVCache, **kwargs) -> IndexedKVCache:
  """Deprecated: ``index.rebuild(**kwargs)``."""
  _deprecated("rebuild_kv_index", "IndexedKVCache.rebuild")
  return index.rebuild(**kwargs)


def kv_index_update(
  index: IndexedKVCache, key, value, *, num_steps=None
) -> IndexedKVCache:
  """Deprecated: ``index.append(key, value, num_steps=...)``.

  Unlike ``IndexedKVCache.append`` it does not donate ``index`` (it stays
  valid, and every call copies it, as before).
  """
  _deprecated("kv_index_update", "IndexedKVCache.append")
  return index.append(key, value, num_steps=num_steps, donate=False)


def _deprecated(old: str, new: str) -> None:
  _deprecation.warn(f"jaxtopk.{old}", f"jaxtopk.{new}", stacklevel=3)


def _index_update_impl(index, key, value, num_steps):
  b, hk, _, c_sz, d = index.keys.shape
  steps = key.shape[1]
  key = key.astype(index.keys.dtype)
  value = value.astype(index.values.dtype)
  row_fn = functools.partial(_append_row, c_sz=c_sz)
  over_h = jax.vmap(row_fn, in_axes=(0, 0, 0, None, None))
  over_b = jax.vmap(over_h, in_axes=(0, 0, 0, 0, 0))
  rows = {f: getattr(index, f) for f in _ROW_FIELDS}

  def step(carry, t):
    rows, length = carry
    pos = length  # [b]
    write = (t < num_steps) & (length < index.max_len)
    kt = key[:, t]  # [b, hk, d]
    vt = value[:, t]
    rows, _ = over_b(rows, kt, vt, pos, write)
    return (rows, length + write.astype(jnp.int32)), None

  (rows, length), _ = jax.lax.scan(
    step, (rows, index.length), jnp.arange(steps)
  )
  # Codes in position order: the written steps go to length .. length + k.
  t = jnp.arange(steps, dtype=jnp.int32)
  pos = index.length[:, None] + t  # [b, st]
  written = (t[None, :] < num_steps[:, None]) & (pos < index.max_len)
  pos = jnp.where(written, pos, index.max_len)  # dropped
  codes, expo = key_codes.encode_keys(key)  # [b, st, hk, d], [b, st, hk]
  bi = jnp.arange(b)[:, None]
  kc = index.key_codes.at[bi, :, :, pos].set(codes, mode="drop")
  ke = index.key_exponents.at[bi, :, pos].set(expo, mode="drop")
  return dataclasses.replace(
    index, **rows, length=length, key_codes=kc, key_exponents=ke
  )


# As ``_cache._update`` / ``_cache._append``: the second donates the index
# and updates it in place (O(steps), no copy of the index).
_index_update = jax.jit(_index_update_impl)
_index_append = jax.jit(_index_update_impl, donate_argnums=0)
