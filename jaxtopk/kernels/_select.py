"""Certified block selection from exact block masses (THEORY 3.3, 6.1).

Selection runs in XLA outside the kernels (compiled kernels cannot sort). Per
query, blocks are kept by mass, largest first, until the dropped mass is at
most eps; the kept set of a query tile is the union over its queries (the
sparse kernel tiles queries, so a tile shares one block list). The union only
adds mass to the head, so each query's dropped mass stays <= eps. With
``max_blocks`` the tile keeps at most that many blocks (those with the largest
share of any query's mass); the certificate then reports what was really
dropped, which may exceed eps.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.scipy.special import logsumexp

from jaxtopk.kernels import _common


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockSelection:
  """Kept key blocks per query tile.

  Attributes:
    block_idx: ``[b, h, n_q_tiles, max_kept]`` int32 kept block indices in
      ascending order; entries past ``block_count`` repeat the last kept
      index (so a TPU pipeline does not fetch a new block for them).
    block_count: ``[b, h, n_q_tiles]`` int32 number of kept blocks.
    kept: ``[b, h, n_q_tiles, n_blocks]`` bool, the same set as a mask.
  """

  block_idx: jax.Array
  block_count: jax.Array
  kept: jax.Array


@functools.partial(jax.jit, static_argnames=("eps",))
def per_query_kept(lse, *, eps: float, log_margin=None) -> jax.Array:
  """``[..., n_blocks]`` bool: fewest blocks by mass with dropped <= eps.

  Args:
    lse: ``[..., n_blocks]`` block log-masses (-inf for empty blocks).
    eps: dropped-mass budget in [0, 1).
    log_margin: optional ``[...]`` log-space margin to aim below eps by
      (``core.search_log_margin``: the certificate's rounding slack);
      +inf keeps every block with mass.

  Returns:
    Kept mask; every block with mass is kept when eps == 0.
  """
  if not 0.0 <= eps < 1.0:
    raise ValueError(f"{eps=} must be in [0, 1)")
  total = logsumexp(lse, axis=-1, keepdims=True)
  share = lse - total  # log share of each block
  order = jnp.argsort(-share, axis=-1)
  srt = jnp.take_along_axis(share, order, axis=-1)  # descending
  # suffix[j] = log of the mass of sorted blocks j.. (the tail if j dropped).
  suffix = jnp.flip(jnp.logaddexp.accumulate(jnp.flip(srt, -1), axis=-1), -1)
  after = jnp.concatenate(
    [suffix[..., 1:], jnp.full_like(suffix[..., :1], -jnp.inf)], axis=-1
  )  # log mass dropped if sorted blocks 0..j are kept
  log_eps = jnp.log(eps) if eps > 0 else -jnp.inf
  if log_margin is not None:
    log_eps = log_eps - jnp.asarray(log_margin, lse.dtype)[..., None]
  ok = after <= log_eps
  n_keep = jnp.argmax(ok, axis=-1) + 1  # first j that satisfies the budget
  n_keep = jnp.where(jnp.isfinite(srt[..., 0]), n_keep, 0)
  rank = jnp.argsort(order, axis=-1)
  return (rank < n_keep[..., None]) & jnp.isfinite(lse)


@functools.partial(jax.jit, static_argnames=("eps", "block_q", "max_blocks"))
def select_blocks(
  lse,
  *,
  eps: float,
  block_q: int,
  max_blocks: int | None = None,
  log_margin=None,
) -> BlockSelection:
  """Certified block lists per query tile from exact block masses.

  Args:
    lse: ``[b, h, q_len, n_blocks]`` block log-masses (``BlockStats.lse``).
    eps: per-query dropped-mass budget in [0, 1).
    block_q: queries per tile of the sparse kernel.
    max_blocks: optional static cap on kept blocks per tile.
    log_margin: optional ``[b, h, q_len]`` margin below log eps
      (``per_query_kept``).

  Returns:
    BlockSelection with ``max_kept = min(max_blocks, n_blocks)``.
  """
  if max_blocks is not None and max_blocks < 1:
    raise ValueError(f"{max_blocks=} must be >= 1 or None")
  b, h, nq, nb = lse.shape
  keep_q = per_query_kept(lse, eps=eps, log_margin=log_margin)
  share = lse - logsumexp(lse, axis=-1, keepdims=True)
  share = jnp.where(jnp.isfinite(lse), share, -jnp.inf)
  keep_q = _common.pad_to(keep_q, 2, block_q, False)
  share = _common.pad_to(share, 2, block_q, -jnp.inf)
  nqt = keep_q.shape[2] // block_q
  kept = jnp.any(keep_q.reshape(b, h, nqt, block_q, nb), axis=3)
  score = jnp.max(share.reshape(b, h, nqt, block_q, nb), axis=3)
  max_kept = nb if max_blocks is None else min(max_blocks, nb)
  if max_kept < nb:
    _, top = jax.lax.top_k(jnp.where(kept, score, -jnp.inf), max_kept)
    capped = (
      jnp.zeros_like(kept)
      .at[
        jnp.arange(b)[:, None, None, None],
        jnp.arange(h)[None, :, None, None],
        jnp.arange(nqt)[None, None, :, None],
        top,
      ]
      .set(True)
    )
    kept = kept & capped
  count = jnp.sum(kept, axis=-1, dtype=jnp.int32)
  # Kept blocks first, ascending; then pad with the last kept index.
  order = jnp.argsort(~kept, axis=-1, stable=True)[..., :max_kept]
  order = order.astype(jnp.int32)
  last = jnp.take_along_axis(
    order, jnp.maximum(count - 1, 0)[..., None], axis=-1
  )
  pos = jnp.arange(max_kept, dtype=jnp.int32)
  idx = jnp.where(pos < count[..., None], order, last)
  return BlockSelection(block_idx=idx, block_count=count, kept=kept)
