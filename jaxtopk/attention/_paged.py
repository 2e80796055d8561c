"""A paged KV cache: a shared page pool, per-sequence page tables.

DESIGN: the pool is a ``KVCache`` whose rows are pages (``[num_pages + 1,
kv_heads, page_size, head_dim]``, one summary block per page), so a page
keeps exactly what a block of the contiguous cache keeps (its key box,
largest value norm, per-key value norms and key codes), written by the same
``_cache.write_steps``, and the per-row running maxima (``kabs``, ``knorm``,
``kflushed``, ``vmax``) per page. Each sequence owns the pages of its page
table row, in order; slots without a page point at the NULL page (the
pool's last), which is never allocated and stays empty, so gathering a
table reads exactly the contiguous cache the sequence would have had.

``append`` allocates pages from the free list in sequence order (the
lowest free pages first) and writes the new steps with scatters: O(new
steps). ``release(done)`` returns the pages of finished sequences to the
free list and empties them (keys, values and summaries reset), so a page
reused by another sequence carries nothing of its previous owner.

``decode_attention`` over a PagedKVCache is the registry's op
'paged_decode' (implementation 'xla'): the XLA decode over a view of the
pages as a contiguous ``KVCache``, built inside the decode's compiled
program (``_view``): the summaries gathered page by page, the keys and
values ``_cache.PageRows`` that the decode reads where it reads them.
Every policy, certificate and q_len >= 1 behave as on the contiguous cache
(equal up to the order of the value sum); the logits, the value sum and
the key codes' products run page slot by page slot on CPU
(``_cache.PAGE_SCAN_PLATFORMS``: no copy of the pages); a search that
scores a few candidates reads their keys and values straight from the
pool, and nothing else of them. ``gather`` builds the whole contiguous
cache.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxtopk.attention import _cache
from jaxtopk.attention import _decode
from jaxtopk.attention import checks
from jaxtopk.attention import registry
from jaxtopk.attention._cache import KVCache
from jaxtopk.selection import core


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """Keys and values of a batch of sequences in a shared pool of pages.

  Make one with ``PagedKVCache.create``; ``cache = cache.append(k, v)``,
  ``cache = cache.release(done)``; ``decode_attention(q, cache, ...)``.

  Attributes:
    pool: the pages as a ``KVCache`` of ``num_pages + 1`` rows of
      ``page_size`` positions (block_size ``page_size``); the last row is
      the null page. Its ``length`` is unused (zeros).
    page_table: ``[batch, max_pages_per_seq]`` int32 page of each slot of
      each sequence (``num_pages``, the null page, where none is
      allocated).
    length: ``[batch]`` int32 positions filled per sequence.
    in_use: ``[num_pages]`` bool, pages owned by some sequence.
  """

  pool: KVCache
  page_table: jax.Array
  length: jax.Array
  in_use: jax.Array

  @classmethod
  def create(
    cls,
    batch: int,
    num_pages: int,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    *,
    max_pages_per_seq: int,
    dtype=jnp.float32,
    value_dim: int | None = None,
  ) -> "PagedKVCache":
    """An empty paged cache (every page free, ``length`` 0).

    Args:
      batch: sequences.
      num_pages: pages in the shared pool.
      page_size: positions per page (also the summary block of the
        certified search: ``Certified(..., block_size=page_size)``).
      kv_heads: key/value heads.
      head_dim: key head dimension.
      max_pages_per_seq: page table slots per sequence (a sequence holds at
        most ``max_pages_per_seq * page_size`` positions).
      dtype: storage dtype of keys and values.
      value_dim: value head dimension, default ``head_dim``.

    Returns:
      A PagedKVCache.

    Raises:
      ValueError: a size that is not a positive int (named).

    Example:
      >>> import jax, jaxtopk
      >>> cache = jaxtopk.PagedKVCache.create(
      ...     2, 8, 16, 4, 32, max_pages_per_seq=4)
      >>> k = jax.random.normal(jax.random.key(0), (2, 20, 4, 32))
      >>> cache = cache.append(k, k, num_steps=[20, 3])
      >>> cache.length.tolist(), int(cache.in_use.sum())
      ([20, 3], 3)
      >>> cache = cache.release([True, False])  # its 2 pages are free again
      >>> cache.length.tolist(), int(cache.in_use.sum())
      ([0, 3], 1)
    """
    for name, val in (
      ("batch", batch),
      ("num_pages", num_pages),
      ("page_size", page_size),
      ("max_pages_per_seq", max_pages_per_seq),
    ):
      if isinstance(val, bool) or not (isinstance(val, int) and val >= 1):
        raise ValueError(f"{name}={val!r} must be a positive int")
    pool = KVCache.create(
      num_pages + 1,
      page_size,
      kv_heads,
      head_dim,
      block_size=page_size,
      dtype=dtype,
      value_dim=value_dim,
    )
    return cls(
      pool=pool,
      page_table=jnp.full((batch, max_pages_per_seq), num_pages, jnp.int32),
      length=jnp.zeros((batch,), jnp.int32),
      in_use=jnp.zeros((num_pages,), bool),
    )

  @property
  def page_size(self) -> int:
    return self.pool.block_size

  @property
  def num_pages(self) -> int:
    return self.in_use.shape[0]

  @property
  def max_pages_per_seq(self) -> int:
    return self.page_table.shape[1]

  @property
  def max_len(self) -> int:
    """Positions one sequence can hold."""
    return self.max_pages_per_seq * self.page_size

  @property
  def block_size(self) -> int:
    """The summary block (= ``page_size``), as on a KVCache."""
    return self.page_size

  def append(
    self, keys, values, *, num_steps=None, donate: bool = True
  ) -> "PagedKVCache":
    """Appends steps to every sequence, allocating pages; O(steps) work.

    Each sequence's steps go to positions ``length .. length + n - 1``; a
    sequence that crosses into a new page takes the lowest free page. With
    concrete arguments (outside jit) a sequence that would outgrow
    ``max_pages_per_seq`` pages, or a pool without enough free pages, is
    refused before anything is written (the check reads ``length`` and
    the free pages back to the host: one sync per call). Under jit (no
    such check) steps that find no page are dropped and ``length`` stops
    at the positions its pages hold.

    The append donates this cache, as ``KVCache.append`` does: rebind
    (``cache = cache.append(k, v)``), or pass ``donate=False``.

    Args:
      keys: ``[batch, steps, kv_heads, head_dim]`` (jax.nn layout).
      values: ``[batch, steps, kv_heads, head_dim_v]``.
      num_steps: optional ``[batch]`` integers (or one integer), how many
        of the ``steps`` are real per sequence (ragged appends).
      donate: False leaves this cache valid (and copies it).

    Returns:
      The updated PagedKVCache.

    Raises:
      TypeError, ValueError: as ``KVCache.append`` (shapes, dtypes,
        num_steps); ValueError: a sequence past ``max_pages_per_seq``
        pages, or too few free pages (the counts named).
      RuntimeError: this cache was donated to an earlier append.
    """
    _cache.check_live(self, "append")
    _, h, _, d = self.pool.keys.shape
    keys, values, num_steps = _cache.check_append(
      keys,
      values,
      self.length.shape[0],
      h,
      d,
      self.pool.values.shape[-1],
      num_steps,
    )
    _check_room(self, num_steps)
    return (_append if donate else _update)(self, keys, values, num_steps)

  def release(self, done) -> "PagedKVCache":
    """Frees the pages of finished sequences; their length becomes 0.

    The freed pages are emptied (keys, values and summaries reset) and go
    back to the free list; the sequences' slots start again empty. Costs
    O(pool) (one masked pass over the pages).

    Args:
      done: ``[batch]`` bool (a list or array), True for each sequence to
        release.

    Returns:
      The updated PagedKVCache (this one stays valid).

    Raises:
      ValueError: ``done`` is not ``[batch]``.
      TypeError: ``done`` is not boolean.
    """
    _cache.check_live(self, "release")
    done = jnp.asarray(done)
    b = self.length.shape[0]
    if done.shape != (b,):
      raise ValueError(f"done must be [batch={b}] bool; got {done.shape=}")
    if done.dtype != jnp.bool_:
      raise TypeError(f"done must be bool; got {done.dtype=}")
    return _release(self, done)

  def gather(self) -> KVCache:
    """Each sequence's pages as one contiguous ``KVCache``.

    ``[batch, kv_heads, max_len, ...]`` with ``block_size = page_size``:
    the cache the same appends would have built contiguously (keys,
    values and every summary equal).
    """
    _cache.check_live(self, "gather")
    return _gather(self)


def _check_room(cache: PagedKVCache, num_steps) -> None:
  """Refuses (outside jit) an append that needs pages it cannot have."""
  leaves = (cache.length, cache.in_use, num_steps)
  if any(isinstance(x, jax.core.Tracer) for x in leaves):
    return
  length = np.asarray(cache.length, np.int64)
  n = np.asarray(num_steps, np.int64)
  ps = cache.page_size
  need = -(-(length + n) // ps)
  over = np.flatnonzero(need > cache.max_pages_per_seq)
  if over.size:
    i = int(over[0])
    raise ValueError(
      f"PagedKVCache.append: sequence {i} would hold {length[i] + n[i]}"
      f" positions, more than max_pages_per_seq={cache.max_pages_per_seq}"
      f" pages of page_size={ps} hold ({cache.max_len})"
    )
  new = int(np.sum(need - (-(-length // ps))))
  free = cache.num_pages - int(np.sum(np.asarray(cache.in_use)))
  if new > free:
    raise ValueError(
      f"PagedKVCache.append needs {new} new pages; {free} of"
      f" num_pages={cache.num_pages} are free (release finished sequences,"
      " or create the cache with more pages)"
    )


def _update_impl(cache: PagedKVCache, key, value, num_steps):
  ps, m, p = cache.page_size, cache.max_pages_per_seq, cache.num_pages
  length = cache.length
  have = -(-length // ps)  # [b] pages held
  want = -(-jnp.minimum(length + num_steps, m * ps) // ps)
  # New pages, lowest free first, in sequence order.
  free_ids = jnp.nonzero(~cache.in_use, size=p, fill_value=p)[0]  # [p]
  n_free = jnp.sum(~cache.in_use)
  new = want - have
  first = jnp.cumsum(new) - new  # [b] first free_ids entry of each
  slot = jnp.arange(m, dtype=jnp.int32)[None, :]  # [1, m]
  k_idx = first[:, None] + slot - have[:, None]  # [b, m]
  fresh = (slot >= have[:, None]) & (slot < want[:, None]) & (k_idx < n_free)
  page = free_ids[jnp.clip(k_idx, 0, p - 1)]
  table = jnp.where(fresh, page, cache.page_table)
  in_use = cache.in_use.at[jnp.where(fresh, page, p)].set(True, mode="drop")
  held = have + jnp.sum(fresh, axis=1)  # pages each sequence now holds
  new_length = jnp.minimum(length + num_steps, held * ps)
  # Where each step goes: (page, offset); dropped steps go out of range.
  t = jnp.arange(key.shape[1], dtype=jnp.int32)[None, :]
  pos = length[:, None] + t  # [b, st]
  real = pos < new_length[:, None]
  rows = jnp.take_along_axis(table, jnp.clip(pos // ps, 0, m - 1), axis=1)
  off = jnp.where(real, pos % ps, ps)
  pool, (ok, k32, key_norms, flushed, vn) = _cache.write_steps(
    cache.pool, rows, off, key, value
  )
  # Running maxima per page: scatter-max of the written steps.
  rows = jnp.where(ok[..., 0], rows, p + 1)  # dropped steps: out of range
  kabs = _scatter_max(
    pool.kabs, rows, jnp.where(ok[..., None], jnp.abs(k32), 0)
  )
  knorm = _scatter_max(
    pool.knorm, rows, jnp.where(ok, key_norms, 0.0).astype(pool.knorm.dtype)
  )
  kflushed = _scatter_max(pool.kflushed, rows, ok & flushed)
  vmax = _scatter_max(pool.vmax, rows, jnp.where(ok, vn, 0.0))
  pool = dataclasses.replace(
    pool, kabs=kabs, knorm=knorm, kflushed=kflushed, vmax=vmax
  )
  return dataclasses.replace(
    cache, pool=pool, page_table=table, length=new_length, in_use=in_use
  )


def _scatter_max(x, rows, u):
  """``x.at[rows].max(u)`` that keeps a NaN of ``x`` or ``u`` whatever the
  backend's scatter does with one (``core.max_nan``'s rule); bool as any."""
  if x.dtype == jnp.bool_:
    hit = (
      jnp.zeros(x.shape, jnp.int8).at[rows].max(u.astype(jnp.int8), mode="drop")
    )
    return x | (hit > 0)
  nan = (
    jnp.zeros(x.shape, jnp.int8)
    .at[rows]
    .max(jnp.isnan(u).astype(jnp.int8), mode="drop")
  )
  out = x.at[rows].max(u, mode="drop")
  return jnp.where(jnp.isnan(x) | (nan > 0), jnp.nan, out)


_update = jax.jit(_update_impl)
_append = jax.jit(_update_impl, donate_argnums=0)


@jax.jit
def _release(cache: PagedKVCache, done):
  p = cache.num_pages
  freed = jnp.where(done[:, None], cache.page_table, p + 1)  # [b, m]
  empty = jnp.zeros((p + 1,), bool).at[freed].set(True, mode="drop")
  blank = jax.tree.map(lambda x: x[-1:], cache.pool)  # the null page

  def reset(x, null):
    e = empty.reshape((p + 1,) + (1,) * (x.ndim - 1))
    return jnp.where(e, null, x)

  pool = jax.tree.map(reset, cache.pool, blank)
  return dataclasses.replace(
    cache,
    pool=pool,
    page_table=jnp.where(done[:, None], p, cache.page_table),
    length=jnp.where(done, 0, cache.length),
    in_use=cache.in_use & ~empty[:p],
  )


def _view(cache: PagedKVCache) -> KVCache:
  """Each sequence's pages as a KVCache whose keys, values and key codes
  are ``_cache.PageRows`` (read from the pool where the decode reads them)
  and whose other summaries are gathered: the cache the same appends would
  have built contiguously."""
  pool, table = cache.pool, cache.page_table

  def rows(x, axis):
    return _cache.PageRows(x, table, axis).dense()

  def per_seq(x):
    """Running maxima of a sequence: over its pages (NaN kept)."""
    return core.max_nan(x[table], axis=1)

  return KVCache(
    keys=_cache.PageRows(pool.keys, table),
    values=_cache.PageRows(pool.values, table),
    length=cache.length,
    kmin=rows(pool.kmin, 2),
    kmax=rows(pool.kmax, 2),
    vnorm=rows(pool.vnorm, 2),
    value_norms=rows(pool.value_norms, 2),
    kabs=per_seq(pool.kabs),
    knorm=per_seq(pool.knorm),
    kflushed=jnp.any(pool.kflushed[table], axis=1),
    vmax=per_seq(pool.vmax),
    key_codes=_cache.PageRows(pool.key_codes, table, 3),
    key_exponents=rows(pool.key_exponents, 2),
    block_size=pool.block_size,
  )


@jax.jit
def _gather(cache: PagedKVCache) -> KVCache:
  return _cache.dense_cache(_view(cache))


def _paged_op(query, cache, *, policy, scale, rng, return_residual=False):
  _cache.check_live(cache, "decode_attention")
  shapes = jax.eval_shape(_gather, cache)
  scale, rng = checks.check_decode_call(query, shapes, policy, scale, rng)
  return _decode.decode_over(
    query,
    cache,
    rng,
    policy=policy,
    scale=scale,
    residual=return_residual,
    view=_view,
  )


PAGED_DECODE = registry.register(
  registry.AttentionOp(
    name="paged_decode",
    implementation="xla",
    kind="decode",
    fn=_paged_op,
    label="decode_attention(implementation='xla') over a PagedKVCache",
    supports=_decode.XLA_DECODE.supports,
    arguments=_decode.XLA_DECODE.arguments,
    cache_types=(PagedKVCache,),
  )
)
