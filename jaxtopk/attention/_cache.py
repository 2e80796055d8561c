"""KV cache for decode, head-major, with incrementally kept key summaries.

DESIGN: the cache is head-major inside (``[batch, kv_heads, max_len, d]``;
the einsum over a head-major cache is ~15x faster on CPU than over the jax.nn
layout) and is transposed once per appended step, never per decode step.
Next to the keys it keeps, per block of ``block_size`` positions, the
per-dimension min/max box of the keys (THEORY 3.3, box form) and the largest
value norm (THEORY 4.2), both updated by scatter-min/max when steps are
appended, so a decode step can bound a block's logits and its values without
reading it. It also keeps what every decode step's certificate needs and
would otherwise recompute over the whole cache (``core.norms_up`` costs ~6x
a plain norm): each value's norm (``value_norms``, computed once when the
step is appended; the certificate reduces it over the kept and dropped keys)
and, per row, the largest |k_c| per dimension, the largest key norm and
whether a key holds subnormal components (the inputs of
``core.logit_error_bound``), all running maxima updated in O(steps). And
each key's 8-bit code (THEORY 3.5, ``selection.key_codes``): the exponent
and int8 components from which a decode step bounds every key's logit at a
quarter of the bytes of the keys (float32), stored d-major so that the code
products read each component row once; encoded once per appended step.

``KVCache.create`` makes an empty cache, ``cache.append`` appends steps.
The append donates the cache to a jitted update (``jax.jit`` with
``donate_argnums``), so XLA writes the new steps and summaries into the
cache's own buffers: O(new steps) per call in a plain Python loop, where a
functional update would copy every buffer (O(max_len)). The old object's
arrays are deleted; ``append(..., donate=False)`` keeps them (and copies).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxtopk import _deprecation
from jaxtopk.attention import checks
from jaxtopk.selection import core
from jaxtopk.selection import key_codes
from jaxtopk.theory import BoxSummary


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Keys, values and block summaries of a decode cache.

  Make one with ``KVCache.create``; ``cache = cache.append(keys, values)``.

  Attributes:
    keys: ``[batch, kv_heads, max_len, head_dim]`` (cache dtype).
    values: ``[batch, kv_heads, max_len, head_dim_v]`` (cache dtype).
    length: ``[batch]`` int32 number of filled positions.
    kmin: ``[batch, kv_heads, n_blocks, head_dim]`` float32 per-block
      per-dimension minimum of the filled keys (+inf for an empty block).
    kmax: ``[batch, kv_heads, n_blocks, head_dim]`` float32 maximum (-inf
      for an empty block).
    vnorm: ``[batch, kv_heads, n_blocks]`` float32 largest ||v||_2 of the
      block's filled values, rounded up (0 for an empty block; as stored by
      ``core.value_norms``, compressed above 2^126).
    value_norms: ``[batch, kv_heads, max_len]`` float32 ||v_j||_2 of each
      filled value, rounded up (``core.value_norms``: NaN for a value with a
      non-finite component, compressed above 2^126; 0 at empty positions).
    kabs: ``[batch, kv_heads, head_dim]`` float32 largest |k_c| over the
      filled keys (0 when empty).
    knorm: ``[batch, kv_heads]`` float32 largest ||k_j||_2 over the filled
      keys, rounded up (``core.norms_up``; NaN or inf for a non-finite key).
    kflushed: ``[batch, kv_heads]`` bool, some filled key has subnormal
      components (``core.flushed``: the CPU reads them as 0).
    vmax: ``[batch, kv_heads]`` float32 largest ``value_norms`` over the
      filled values (NaN if one is NaN; 0 when empty): a bound on the norm
      of any dropped value.
    key_codes: ``[batch, kv_heads, head_dim, max_len]`` int8 codes of the
      filled keys, d-major (``key_codes.encode_keys``; 0 when empty).
    key_exponents: ``[batch, kv_heads, max_len]`` their exponents (int8;
      int16 for float64 keys): |k_c - 2^e c| <= 2^(e - 1).
    block_size: static positions per block; max_len is a multiple of it.
  """

  keys: jax.Array
  values: jax.Array
  length: jax.Array
  kmin: jax.Array
  kmax: jax.Array
  vnorm: jax.Array
  value_norms: jax.Array
  kabs: jax.Array
  knorm: jax.Array
  kflushed: jax.Array
  vmax: jax.Array
  key_codes: jax.Array
  key_exponents: jax.Array
  block_size: int = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def create(
    cls,
    batch: int,
    max_len: int,
    kv_heads: int,
    head_dim: int,
    *,
    block_size: int = 64,
    dtype=jnp.float32,
    value_dim: int | None = None,
  ) -> "KVCache":
    """An empty cache (``length`` 0 in every sequence).

    Args:
      batch: sequences.
      max_len: capacity in positions; a multiple of ``block_size``.
      kv_heads: key/value heads.
      head_dim: key head dimension.
      block_size: positions per summary block (static).
      dtype: storage dtype of keys and values (summaries are float32, or
        float64 for float64).
      value_dim: value head dimension, default ``head_dim``.

    Returns:
      A KVCache with length 0.

    Raises:
      ValueError: for non-positive sizes (named) or ``max_len`` not a
        multiple of ``block_size``.

    Example:
      >>> import jax, jaxtopk
      >>> cache = jaxtopk.KVCache.create(2, 256, 4, 32, block_size=64)
      >>> k = jax.random.normal(jax.random.key(0), (2, 5, 4, 32))
      >>> cache = cache.append(k, k)  # the old ``cache`` is gone: rebind it
      >>> cache.length.tolist()
      [5, 5]
    """
    return _create(
      batch,
      max_len,
      kv_heads,
      head_dim,
      block_size=block_size,
      dtype=dtype,
      value_dim=value_dim,
    )

  def append(
    self, keys, values, *, num_steps=None, donate: bool = True
  ) -> "KVCache":
    """Appends ``steps`` positions to every sequence; O(steps) work.

    Keys and values are written at positions ``length .. length + steps -
    1`` of each sequence (sequences may have different lengths), and the
    block boxes, value norms, key codes and key summaries are updated by
    scatter-min/max and running maxima over the new steps only (no
    re-scan). Positions past ``max_len`` are dropped and ``length``
    saturates at ``max_len``.

    The append DONATES this cache: its buffers are updated in place and
    become the returned cache's, so a step costs O(steps), not a copy of
    the cache. This object must not be used afterwards (rebind:
    ``cache = cache.append(k, v)``); using it raises jax's deleted-array
    RuntimeError (from ``append`` itself, one naming it), never a wrong
    result. To keep it, append to a copy (``jax.tree.map(jnp.copy,
    cache).append(k, v)``) or pass ``donate=False``. Under ``jax.jit``
    nothing is donated (the caller's jit decides).

    Args:
      keys: ``[batch, steps, kv_heads, head_dim]`` (jax.nn layout).
      values: ``[batch, steps, kv_heads, head_dim_v]``.
      num_steps: optional ``[batch]`` integers (or one integer for every
        sequence), how many of the ``steps`` are real for each sequence
        (ragged appends, e.g. a right-padded prefill of prompts of
        different lengths); the rest are not written. Default: all.
        Concrete values must lie in [0, steps]; traced ones (under jit) are
        clipped to it.
      donate: False leaves this cache valid and copies it (O(max_len) per
        call outside jit): for a cache that something else still holds (a
        Flax variable that a cloned module shares, a model's cache decoded
        under several policies).

    Returns:
      The updated KVCache.

    Raises:
      TypeError: keys or values not real floating (complex keys are not
        cast to real), num_steps not integers.
      ValueError: if keys/values shapes do not match the cache, or
        num_steps is not ``[batch]`` / a scalar or out of range.
      RuntimeError: this cache was donated to an earlier append.
    """
    keys, values, num_steps = _checked(self, keys, values, num_steps, "append")
    return (_append if donate else _update)(self, keys, values, num_steps)

  @property
  def max_len(self) -> int:
    return self.keys.shape[2]

  @property
  def num_blocks(self) -> int:
    return self.kmin.shape[2]

  def block_count(self) -> jax.Array:
    """``[batch, 1, n_blocks]`` int32 filled positions per block."""
    start = jnp.arange(self.num_blocks, dtype=jnp.int32) * self.block_size
    cnt = jnp.clip(self.length[:, None] - start[None, :], 0, self.block_size)
    return cnt[:, None, :].astype(jnp.int32)

  def valid(self) -> jax.Array:
    """``[batch, 1, max_len]`` bool, True at filled positions."""
    pos = jnp.arange(self.max_len, dtype=jnp.int32)
    return (pos[None, :] < self.length[:, None])[:, None, :]

  def box(self, *, zero_empty: bool = True) -> BoxSummary:
    """The key boxes as a theory BoxSummary. ``zero_empty``: empty blocks
    get a zero box (as ``theory.box_summary``); False: they keep the
    cache's initial +-inf, for readers that mask them by count
    (``box_upper_bound_dot``: no copy of the boxes)."""
    cnt = jnp.broadcast_to(self.block_count(), self.vnorm.shape)
    if not zero_empty:
      return BoxSummary(kmin=self.kmin, kmax=self.kmax, count=cnt)
    empty = (cnt == 0)[..., None]
    return BoxSummary(
      kmin=jnp.where(empty, 0.0, self.kmin),
      kmax=jnp.where(empty, 0.0, self.kmax),
      count=cnt,
    )


# Platforms where a paged cache's keys and values are read page slot by page
# slot (``PageRows.logits``, ``PageRows.weighted_sum``: a scan whose pages
# stay in cache between the gather and the product) instead of gathered
# whole first, where the gathered array would hold PAGE_SCAN_MIN_BYTES or
# more. On XLA:CPU a gather that leaves the processor's caches copies at a
# third of the speed the product reads (8 sequences of 4K-32K keys, 8 heads
# over 2: logits 40 ms by slot against 124 ms gathered); below ~8 MiB the
# gather stays in cache and the scan's steps cost more (logits and value
# sum at 4 MiB: 1.7 ms by slot, 1.2 gathered; at 16 MiB 5.2 and 7.5;
# docs/performance.md). On a GPU a scan would launch kernels per page slot,
# so the gather stays there.
PAGE_SCAN_PLATFORMS = ("cpu",)
PAGE_SCAN_MIN_BYTES = 1 << 23
# Up to this many query rows per kv head a slot's logits are one
# matrix-vector product per row: XLA:CPU's batched product of a few rows by
# one page costs more (per-slot logits at 2 rows 45.6 -> 22.5 ms, at 4
# 50.2 -> 39.2; at 8 rows 64.0 against 69.1: docs/performance.md).
PAGE_SCAN_MAX_ROWS = 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageRows:
  """A per-position array of a page pool as the sequences see it, read
  lazily.

  Stands for the ``[batch, kv_heads, ..., pages x page_size, ...]`` array
  that gathering each sequence's pages would build (``dense``), but
  gathers only what is read: ``take`` and ``at_positions`` read chosen
  positions straight from the pool, so a decode that scores a few
  candidates never copies the rest, and a branch that does not read an
  array never gathers it. The keys, values and key codes of a paged
  cache's view (``_paged``); the decode reads a cache's keys, values and
  codes through ``dense_rows``, ``take_rows`` and ``at_positions``.

  Attributes:
    pool: ``[pages, kv_heads, ...]`` with ``page_size`` positions on
      ``axis``.
    table: ``[batch, max_pages]`` int32 page of each slot.
    axis: the position axis of ``pool`` (and of the array it stands for).
  """

  pool: jax.Array
  table: jax.Array
  axis: int = dataclasses.field(default=2, metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    s = [self.table.shape[0], *self.pool.shape[1:]]
    s[self.axis] *= self.table.shape[1]
    return tuple(s)

  @property
  def dtype(self):
    return self.pool.dtype

  def dense(self) -> jax.Array:
    """The gathered array (``shape``)."""
    g = jnp.moveaxis(self.pool[self.table], 1, self.axis)  # slots by pages
    return g.reshape(self.shape)

  @property
  def by_slot(self) -> bool:
    """Whether reads go page slot by page slot (``PAGE_SCAN_PLATFORMS``,
    ``PAGE_SCAN_MIN_BYTES``); static."""
    size = math.prod(self.shape) * jnp.dtype(self.dtype).itemsize
    on = jax.default_backend() in PAGE_SCAN_PLATFORMS
    return on and size >= PAGE_SCAN_MIN_BYTES

  def per_slot(self, fn) -> jax.Array:
    """``fn`` of each slot's pages, concatenated over the slots: ``fn``
    maps ``[b, kv_heads, ...]`` (one page per sequence) to ``[b, ...,
    page_size]``; the result is ``[b, ..., slots x page_size]``."""

    def slot(_, pages):  # [b]: one page per sequence
      return None, fn(self.pool[pages])

    _, out = lax.scan(slot, None, self.table.T)  # [slots, b, ..., ps]
    out = jnp.moveaxis(out, 0, -2)  # [b, ..., slots, page_size]
    return out.reshape(*out.shape[:-2], -1)

  def logits(self, q, precision) -> jax.Array:
    """q.k of every position: ``q`` ``[b, hk, g, d]`` -> ``[b, hk, g,
    slots x page_size]`` (keys: ``[pages, kv_heads, page_size, d]``)."""
    if not self.by_slot:
      return row_logits(self.dense(), q, precision)

    def products(k):  # [b, hk, ps, d] -> [b, hk, g, ps]
      k = k.astype(q.dtype)
      if q.shape[2] > PAGE_SCAN_MAX_ROWS:
        return jnp.einsum("bkgd,bksd->bkgs", q, k, precision=precision)
      rows = [
        jnp.einsum("bkd,bksd->bks", q[:, :, i], k, precision=precision)
        for i in range(q.shape[2])
      ]
      return jnp.stack(rows, 2)

    return self.per_slot(products)

  def weighted_sum(self, p, precision) -> jax.Array:
    """sum_n p_n v_n: ``p`` ``[b, hk, g, slots x page_size]`` -> ``[b, hk,
    g, dv]`` (values: ``[pages, kv_heads, page_size, dv]``)."""
    if not self.by_slot:
      return row_weighted_sum(self.dense(), p, precision)
    b, hk, g, _ = p.shape
    slots, ps = self.table.shape[1], self.pool.shape[2]
    p_slots = jnp.moveaxis(p.reshape(b, hk, g, slots, ps), 3, 0)

    def slot(acc, x):
      pages, p_slot = x  # [b], [b, hk, g, ps]
      v = self.pool[pages].astype(p.dtype)  # [b, hk, ps, dv]
      part = jnp.einsum("bkgs,bksd->bkgd", p_slot, v, precision=precision)
      return acc + part, None

    acc = jnp.zeros((b, hk, g, self.pool.shape[-1]), p.dtype)
    acc, _ = lax.scan(slot, acc, (self.table.T, p_slots))
    return acc

  def take(self, idx) -> jax.Array:
    """``[b, hk, g, K, dim]`` at positions ``idx`` ``[b, hk, g, K]`` (keys
    or values: ``[pages, kv_heads, page_size, dim]``, axis 2)."""
    ps = self.pool.shape[2]
    hk = idx.shape[1]
    page = jax.vmap(lambda t, i: t[i])(self.table, idx // ps)
    head = jnp.arange(hk, dtype=idx.dtype).reshape(1, hk, 1, 1)
    return self.pool[page, head, idx % ps]

  def at_positions(self, pos) -> jax.Array:
    """The array at positions ``pos`` ``[b, m]`` (on ``axis``)."""
    ps = self.pool.shape[self.axis]
    page = jnp.take_along_axis(self.table, pos // ps, axis=1)  # [b, m]
    g = self.pool[page]  # [b, m, kv_heads, ...]: m pages
    off = (pos % ps).reshape(*pos.shape, *(1,) * (g.ndim - 2))
    g = jnp.take_along_axis(g, off, axis=self.axis + 1)
    return jnp.moveaxis(jnp.squeeze(g, self.axis + 1), 1, self.axis)


def dense_rows(x) -> jax.Array:
  """A cache's keys, values or codes as an array (``PageRows`` gathered)."""
  return x.dense() if isinstance(x, PageRows) else x


def row_logits(keys, q, precision) -> jax.Array:
  """q.k of every position: ``q`` ``[b, hk, g, d]`` x ``keys`` ``[b, hk, n,
  d]`` (or ``PageRows``) -> ``[b, hk, g, n]``."""
  if isinstance(keys, PageRows):
    return keys.logits(q, precision)
  k = keys.astype(q.dtype)
  return jnp.einsum("bkgd,bknd->bkgn", q, k, precision=precision)


def row_weighted_sum(values, p, precision) -> jax.Array:
  """sum_n p_n v_n: ``p`` ``[b, hk, g, n]`` x ``values`` ``[b, hk, n, dv]``
  (or ``PageRows``) -> ``[b, hk, g, dv]``."""
  if isinstance(values, PageRows):
    return values.weighted_sum(p, precision)
  v = values.astype(p.dtype)
  return jnp.einsum("bkgn,bknd->bkgd", p, v, precision=precision)


def code_products(codes, q) -> jax.Array:
  """q.c of every key code: ``q`` ``[b, hk, g, d]`` x ``codes`` ``[b, hk,
  d, n]`` (d-major; or ``PageRows`` on axis 3) -> ``[b, hk, g, n]``
  (``key_codes.code_dot``; over pages, an einsum per page slot, ~2x faster
  on CPU than gathering the codes first)."""
  if isinstance(codes, PageRows) and codes.by_slot:
    return codes.per_slot(lambda c: key_codes.code_dot(q, c, loop=False))
  return key_codes.code_dot(q, dense_rows(codes))


def take_rows(x, idx) -> jax.Array:
  """``x[b, hk, idx]``: ``[b, hk, n, dim]`` (or ``PageRows``) x ``[b, hk,
  g, K]`` -> ``[b, hk, g, K, dim]``."""
  if isinstance(x, PageRows):
    return x.take(idx)
  return jax.vmap(jax.vmap(lambda v, i: v[i]))(x, idx)


def at_positions(x, pos, axis: int) -> jax.Array:
  """``x`` ``[b, ...]`` (or ``PageRows``) at positions ``pos`` ``[b, m]``
  of its ``axis``: the same array with m positions there."""
  if isinstance(x, PageRows):
    return x.at_positions(pos)
  return jax.vmap(lambda r, p: jnp.take(r, p, axis=axis - 1))(x, pos)


def dense_cache(cache: KVCache) -> KVCache:
  """``cache`` with arrays for keys, values and codes (``dense_rows``)."""
  return dataclasses.replace(
    cache,
    keys=dense_rows(cache.keys),
    values=dense_rows(cache.values),
    key_codes=dense_rows(cache.key_codes),
  )


def _create(
  batch,
  max_len,
  kv_heads,
  head_dim,
  *,
  block_size,
  dtype,
  value_dim,
) -> KVCache:
  for name, val in (
    ("batch", batch),
    ("max_len", max_len),
    ("kv_heads", kv_heads),
    ("head_dim", head_dim),
    ("block_size", block_size),
  ):
    if isinstance(val, bool) or not (isinstance(val, int) and val >= 1):
      raise ValueError(f"{name}={val!r} must be a positive int")
  if value_dim is not None and (
    isinstance(value_dim, bool)
    or not (isinstance(value_dim, int) and value_dim >= 1)
  ):
    raise ValueError(f"{value_dim=} must be a positive int or None")
  if max_len % block_size:
    raise ValueError(f"{max_len=} must be a multiple of {block_size=}")
  dv = head_dim if value_dim is None else value_dim
  sdt = core.compute_dtype(dtype)
  nb = max_len // block_size
  bh = (batch, kv_heads)
  return KVCache(
    keys=jnp.zeros((*bh, max_len, head_dim), dtype),
    values=jnp.zeros((*bh, max_len, dv), dtype),
    length=jnp.zeros((batch,), jnp.int32),
    kmin=jnp.full((*bh, nb, head_dim), jnp.inf, sdt),
    kmax=jnp.full((*bh, nb, head_dim), -jnp.inf, sdt),
    vnorm=jnp.zeros((*bh, nb), sdt),
    value_norms=jnp.zeros((*bh, max_len), sdt),
    kabs=jnp.zeros((*bh, head_dim), sdt),
    knorm=jnp.zeros(bh, sdt),
    kflushed=jnp.zeros(bh, bool),
    vmax=jnp.zeros(bh, sdt),
    key_codes=jnp.zeros((*bh, head_dim, max_len), jnp.int8),
    key_exponents=jnp.zeros((*bh, max_len), key_codes.exponent_dtype(dtype)),
    block_size=block_size,
  )


def check_live(cache, method: str) -> None:
  """Refuses a cache whose buffers an earlier ``append`` donated.

  Without this check jax raises its own deleted-buffer error from deep
  inside the call; this one names the method and what to do instead.

  Raises:
    RuntimeError: some array of ``cache`` has been deleted or donated.
  """
  for leaf in jax.tree.leaves(cache):
    if (
      isinstance(leaf, jax.Array)
      and not isinstance(leaf, jax.core.Tracer)
      and leaf.is_deleted()
    ):
      raise RuntimeError(
        f"{type(cache).__name__}.{method}: this cache's arrays have been"
        " deleted (donated to an earlier append, whose returned cache"
        " replaces it: write `cache = cache.append(...)` and use only the"
        " returned cache; copy it first, jax.tree.map(jnp.copy, cache), to"
        " keep both)"
      )


def check_append(keys, values, batch, kv_heads, head_dim, value_dim, num_steps):
  """Checks an append's arguments against the cache's sizes.

  Returns:
    ``(keys, values, num_steps)``, num_steps as ``[batch]`` int32.

  Raises:
    TypeError: keys or values not real floating, num_steps not integers.
    ValueError: shapes that do not match the cache, num_steps not
      ``[batch]`` / a scalar or out of [0, steps].
  """
  keys = checks.check_array(keys, "keys")
  values = checks.check_array(values, "values")
  b, h, d, dv = batch, kv_heads, head_dim, value_dim
  if keys.ndim != 4 or keys.shape[0] != b or keys.shape[2:] != (h, d):
    raise ValueError(
      f"keys must be [batch={b}, steps, kv_heads={h}, head_dim={d}]; got"
      f" {keys.shape=}"
    )
  if values.shape != keys.shape[:3] + (dv,):
    raise ValueError(
      f"values must be {keys.shape[:3] + (dv,)}; got {values.shape=}"
    )
  steps = keys.shape[1]
  if num_steps is None:
    num_steps = jnp.full((b,), steps, jnp.int32)
  else:
    num_steps = checks.check_counts(num_steps, "num_steps", b, steps)
  return keys, values, num_steps


def _checked(cache: KVCache, keys, values, num_steps, method: str):
  check_live(cache, method)
  b, h, _, d = cache.keys.shape
  return check_append(keys, values, b, h, d, cache.values.shape[-1], num_steps)


def init_kv_cache(
  batch: int,
  max_len: int,
  num_kv_heads: int,
  head_dim: int,
  *,
  block_size: int = 64,
  dtype=jnp.float32,
  value_dim: int | None = None,
) -> KVCache:
  """Deprecated: ``jaxtopk.KVCache.create`` (same arguments)."""
  _deprecation.warn("jaxtopk.init_kv_cache", "jaxtopk.KVCache.create")
  return KVCache.create(
    batch,
    max_len,
    num_kv_heads,
    head_dim,
    block_size=block_size,
    dtype=dtype,
    value_dim=value_dim,
  )


def kv_cache_update(cache: KVCache, key, value, *, num_steps=None) -> KVCache:
  """Deprecated: ``cache.append(key, value, num_steps=...)``.

  Unlike ``KVCache.append`` it does not donate ``cache`` (it stays valid,
  and every call copies it, as before).
  """
  _deprecation.warn(
    "jaxtopk.kv_cache_update",
    "jaxtopk.KVCache.append (cache = cache.append(keys, values))",
  )
  return cache.append(key, value, num_steps=num_steps, donate=False)


def write_steps(cache: KVCache, rows, pos, key, value):
  """Writes steps into ``cache`` rows and updates the block summaries.

  The one write of keys, values and their per-block and per-key summaries
  (block boxes, value norms, key codes), shared by ``KVCache.append``
  (rows are sequences) and ``PagedKVCache.append`` (rows are pages).
  Summaries bound the STORED (possibly rounded) keys and values.

  Args:
    cache: the cache written (or a page pool in KVCache form).
    rows: ``[b, st]`` int32 row of each step.
    pos: ``[b, st]`` int32 position of each step in its row; a step whose
      ``pos`` is ``>= cache.max_len`` is not written (dropped by every
      scatter).
    key: ``[b, st, kv_heads, head_dim]``.
    value: ``[b, st, kv_heads, head_dim_v]``.

  Returns:
    ``(cache, steps)``: the written cache (its running per-row summaries
    and ``length`` unchanged) and ``steps = (real [b, st, 1], k32 [b, st,
    h, d], key_norms [b, st, h], flushed [b, st, h], value_norms [b, st,
    h])``, the per-step inputs of the running summaries (only ``real``
    steps count).
  """
  blk = pos // cache.block_size  # [b, st]
  # Advanced indices (rows, pos) around a slice: updates are [b, st, h, d],
  # exactly the jax.nn layout of key/value.
  key = key.astype(cache.keys.dtype)
  value = value.astype(cache.values.dtype)
  keys = cache.keys.at[rows, :, pos].set(key, mode="drop")
  values = cache.values.at[rows, :, pos].set(value, mode="drop")
  k32 = key.astype(cache.kmin.dtype)
  kmin = cache.kmin.at[rows, :, blk].min(k32, mode="drop")
  kmax = cache.kmax.at[rows, :, blk].max(k32, mode="drop")
  vn = core.value_norms(value).astype(cache.vnorm.dtype)  # [b, st, h]
  vnorm = cache.vnorm.at[rows, :, blk].max(vn, mode="drop")
  value_norms = cache.value_norms.at[rows, :, pos].set(vn, mode="drop")
  codes, expo = key_codes.encode_keys(key)  # [b, st, h, d], [b, st, h]
  # d-major codes: the update [b, st, h, d] goes to [rows, h, d, pos].
  codes = cache.key_codes.at[rows, :, :, pos].set(codes, mode="drop")
  expo = cache.key_exponents.at[rows, :, pos].set(expo, mode="drop")
  real = (pos < cache.max_len)[:, :, None]  # [b, st, 1]
  written = dataclasses.replace(
    cache,
    keys=keys,
    values=values,
    kmin=kmin,
    kmax=kmax,
    vnorm=vnorm,
    value_norms=value_norms,
    key_codes=codes,
    key_exponents=expo,
  )
  steps = (real, k32, core.norms_up(key), core.flushed(key), vn)
  return written, steps


def _update_impl(cache, key, value, num_steps):
  b = cache.keys.shape[0]
  steps = key.shape[1]
  t = jnp.arange(steps, dtype=jnp.int32)
  pos = cache.length[:, None] + t[None, :]  # [b, st]
  # Padded steps go out of range and are dropped by every scatter.
  pos = jnp.where(t[None, :] < num_steps[:, None], pos, cache.max_len)
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], pos.shape)
  cache, (real, k32, key_norms, flushed, vn) = write_steps(
    cache, rows, pos, key, value
  )
  # Running key summaries over the written steps only ([b, st, h, ...]).
  # core.max_nan: a NaN key or value must reach the running summaries.
  kabs = core.max_nan(jnp.where(real[..., None], jnp.abs(k32), 0.0), axis=1)
  kn = core.max_nan(jnp.where(real, key_norms, 0.0), axis=1)
  kf = jnp.any(real & flushed, axis=1)  # [b, h]
  vm = core.max_nan(jnp.where(real, vn, 0.0), axis=1)  # [b, h]
  length = jnp.minimum(cache.length + num_steps, cache.max_len)
  return dataclasses.replace(
    cache,
    length=length,
    kabs=jnp.maximum(cache.kabs, kabs),
    knorm=nan_max(cache.knorm, kn.astype(cache.knorm.dtype)),
    kflushed=cache.kflushed | kf,
    vmax=nan_max(cache.vmax, vm),
  )


# The same update twice: ``_update`` leaves its input cache valid (XLA
# copies every buffer it writes), ``_append`` donates it, so that XLA
# updates the buffers in place and an append costs O(steps), not
# O(max_len) (on CPU too).
_update = jax.jit(_update_impl)
_append = jax.jit(_update_impl, donate_argnums=0)


def nan_max(a, b):
  """Elementwise max that keeps a NaN (a broken key marks its row)."""
  return jnp.where(jnp.isnan(a) | jnp.isnan(b), jnp.nan, jnp.maximum(a, b))
