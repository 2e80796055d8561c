"""One decode step over a KV cache whose positions are split across devices.

THEORY 8.1 and 6.5, DESIGN.md "one decode step". The cache
(``jaxtopk.attention.KVCache``, head-major ``[batch, kv_heads, max_len,
head_dim]``) is sharded along ``max_len`` over the mesh's ``kv`` axis
(contiguous slices), along batch over ``data`` and along kv heads over
``heads``. Each shard scores the new query against its slice (filled
positions only: ``position < length``), the selection is global (exact
global Top-k, or a global-eps certified threshold), and each shard's
partial statistics (a ``core.PartialSoftmax``) are merged by the certificate
core,
as in ``_kv_sharded.py``: the output and certificate equal the
single-device ones up to rounding (same kept set for count policies), and
the certificate is global and sound.

GQA needs no copy of the cache: the ``group = heads / kv_heads`` query heads
sharing a kv head become ``group`` query rows of that head.

Per decode step and query row, the collectives carry: for count policies an
all-gather of ``kv_shards * min(topk, n_local)`` candidate logits or, when
cheaper, 4 psums of 256-bin radix counts (``global_topk_keep``), for
Certified two psums of 64-bin histograms, then one all-gather of the
shards' Partials (``v_dim + 11`` numbers per shard) and a few pmax/psum
key summaries. Value norms come from the cache's block norms (an upper
bound per block, kept at ``KVCache.append``), never recomputed per step.
The cache's key boxes are not read: ``Certified`` runs the exact search,
and Delta- / MC-Search are refused by name (``UnsupportedPolicyError``).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxtopk.attention import KVCache
from jaxtopk.attention import checks
from jaxtopk.attention import registry
from jaxtopk.parallel import _compat
from jaxtopk.parallel import _kv_sharded
from jaxtopk.parallel import _mesh
from jaxtopk.selection import Policy


def decode_shard_attention(
  query,
  keys,
  values,
  length,
  *,
  policy: Policy,
  scale,
  axis_name,
  n_total: int,
  block_norms=None,
  block_size: int | None = None,
):
  """This shard's part of one decode step, merged globally.

  Call inside ``shard_map`` over the cache positions (``axis_name`` = the
  mesh axis they are split over) or ``jax.vmap(..., axis_name=...)``; with
  ``axis_name=None`` it is a single-device decode step. Shard i holds the
  positions ``[i * n_local, (i + 1) * n_local)``.

  Args:
    query: ``[batch, 1, num_heads, head_dim]``.
    keys: ``[batch, kv_heads, n_local, head_dim]`` this shard's cache slice.
    values: ``[batch, kv_heads, n_local, v_dim]``.
    length: ``[batch]`` int filled positions of each sequence (global).
    policy: as ``kv_shard_attention`` (Delta- / MC-Search refused).
    scale: positive logit scale (float or 0-d array).
    axis_name: the mapped axis of the positions, or None.
    n_total: static cache capacity over all shards.
    block_norms: optional ``[batch, kv_heads, n_blocks]`` largest value norm
      per cache block (``KVCache.vnorm``, all blocks); with ``block_size``
      they bound each position's value norm (else norms are computed).
    block_size: positions per block of ``block_norms``.

  Returns:
    ``(output, certificate)``: ``[batch, 1, num_heads, v_dim]`` in the
    query's dtype and a Certificate of ``[batch, 1, num_heads]`` arrays.
  """
  b, _, h, d = query.shape
  hk, n_local = keys.shape[1], keys.shape[2]
  g = h // hk
  q = query.reshape(b, hk, g, d)  # [b, hk, g, d]: the group = query rows
  first = 0 if axis_name is None else lax.axis_index(axis_name) * n_local
  pos = first + jnp.arange(n_local)
  valid = (pos[None, :] < length[:, None])[:, None, None, :]  # [b,1,1,s]
  vn = None
  if block_norms is not None:
    if block_size is None:
      raise ValueError("decode_shard_attention: block_norms needs block_size")
    vn = jnp.take(block_norms, pos // block_size, axis=-1)  # [b, hk, s]
  out, cert = _kv_sharded.kv_shard_attention(
    q,
    keys,
    values,
    valid,
    policy=policy,
    scale=scale,
    axis_name=axis_name,
    n_total=n_total,
    value_norms=vn,
  )
  out = out.reshape(b, 1, h, -1)  # [b, 1, h, dv]
  cert = jax.tree.map(lambda x: x.reshape(b, 1, h), cert)
  return out, cert


@functools.lru_cache(maxsize=64)
def _build(mesh, policy, scale, axes, max_len, block_size):
  _, _, s_ax = axes
  b_ax, h_ax, _ = axes

  def per_shard(q, keys, values, length, vnorm, *scl):
    return decode_shard_attention(
      q,
      keys,
      values,
      length,
      policy=policy,
      scale=scale if not scl else scl[0],
      axis_name=s_ax,
      n_total=max_len,
      block_norms=vnorm,
      block_size=block_size,
    )

  row = P(b_ax, None, h_ax)
  cache_spec = P(b_ax, h_ax, s_ax, None)
  in_specs = (
    P(b_ax, None, h_ax, None),
    cache_spec,
    cache_spec,
    P(b_ax),
    P(b_ax, h_ax, None),
  )
  if scale is None:
    in_specs = in_specs + (P(),)
  fn = _compat.shard_map(
    per_shard,
    mesh=mesh,
    in_specs=in_specs,
    out_specs=(P(b_ax, None, h_ax, None), _kv_sharded._cert_spec(row)),
  )
  return jax.jit(fn)


def cache_shardings(
  mesh: jax.sharding.Mesh,
  cache,
  *,
  batch_axis: str | None = _mesh.DATA,
  head_axis: str | None = _mesh.HEADS,
  kv_axis: str | None = _mesh.KV,
):
  """NamedShardings for a KVCache: positions over ``kv``.

  Keys, values and per-position value norms are split along positions; the
  small block and row summaries are replicated along ``kv`` (the decode
  step reads the block value norms of its own positions).

  Returns:
    A KVCache-shaped pytree of NamedSharding for ``jax.device_put``.
  """
  from jax.sharding import NamedSharding

  b, h, s = (
    _mesh.axis_or_none(mesh, a) for a in (batch_axis, head_axis, kv_axis)
  )
  kv = NamedSharding(mesh, P(b, h, s, None))
  box = NamedSharding(mesh, P(b, h, None, None))  # small: replicated on kv
  per_row = NamedSharding(mesh, P(b, h))  # [b, hk] summaries
  return type(cache)(
    keys=kv,
    values=kv,
    length=NamedSharding(mesh, P(b)),
    kmin=box,
    kmax=box,
    vnorm=NamedSharding(mesh, P(b, h, None)),
    value_norms=NamedSharding(mesh, P(b, h, s)),  # per position, like keys
    kabs=NamedSharding(mesh, P(b, h, None)),
    knorm=per_row,
    kflushed=per_row,
    vmax=per_row,
    key_codes=NamedSharding(mesh, P(b, h, None, s)),  # d-major, per position
    key_exponents=NamedSharding(mesh, P(b, h, s)),
    block_size=cache.block_size,
  )


def sharded_decode_attention(
  query,
  cache,
  *,
  policy: Policy,
  mesh: jax.sharding.Mesh,
  scale=None,
  batch_axis: str | None = _mesh.DATA,
  head_axis: str | None = _mesh.HEADS,
  kv_axis: str | None = _mesh.KV,
):
  """``jaxtopk.decode_attention`` with the cache sharded over a mesh.

  Args:
    query: ``[batch, 1, num_heads, head_dim]``; num_heads a multiple of the
      cache's kv heads.
    cache: a ``jaxtopk.attention.KVCache`` (place it with
      ``cache_shardings`` to avoid a reshard per step).
    policy: Dense, FixedK, Ratio, PowerLaw (counts over the filled
      positions) or Certified with a GLOBAL eps, the exact search and
      optionally ``max_topk``; Delta- / MC-Search are refused by name.
    mesh: the mesh; ``kv`` splits the cache positions, ``data`` the batch,
      ``heads`` the kv heads.
    scale: logit scale, default 1/sqrt(head_dim); a Python number (finite,
      > 0) or a 0-d array (rows with a bad traced scale are invalid).
    batch_axis, head_axis, kv_axis: mesh axis names (None: not sharded).

  Returns:
    ``(output, certificate)``: ``[batch, 1, num_heads, head_dim_v]`` in the
    query's dtype (zeros on an empty row), and a Certificate of ``[batch,
    1, num_heads]`` arrays (invalid on an empty row).

  Raises:
    TypeError: a non-floating query, a bad scale type.
    ValueError: bad shapes, sizes not divisible by their mesh axes, a scale
      that is not finite and > 0.
    UnsupportedPolicyError: a policy field this path does not honour.
  """
  query = checks.check_array(query, "query")
  checks.check_policy(policy, "sharded_decode_attention", _kv_sharded.SUPPORTS)
  b, hk, max_len, d = cache.keys.shape
  if query.ndim != 4 or query.shape[:2] != (b, 1) or query.shape[3] != d:
    raise ValueError(
      f"query must be [batch={b}, 1, num_heads, head_dim={d}]; got"
      f" {query.shape=}"
    )
  if query.shape[2] % hk:
    raise ValueError(
      f"num_heads={query.shape[2]} must be a multiple of num_kv_heads={hk}"
    )
  scale = checks.check_scale(scale, d)
  axes = tuple(
    _mesh.axis_or_none(mesh, a) for a in (batch_axis, head_axis, kv_axis)
  )
  for name, size, ax in zip(
    ("batch", "num_kv_heads", "max_len"), (b, hk, max_len), axes, strict=True
  ):
    if ax is not None and size % mesh.shape[ax]:
      raise ValueError(
        f"{name}={size} must be divisible by mesh axis {ax!r} of size"
        f" {mesh.shape[ax]}"
      )
  dynamic = not isinstance(scale, float)
  fn = _build(
    mesh, policy, None if dynamic else scale, axes, max_len, cache.block_size
  )
  args = (query, cache.keys, cache.values, cache.length, cache.vnorm)
  if dynamic:
    return fn(*args, scale)
  return fn(*args)


def _decode_op(query, cache, *, policy, scale, rng):
  """``sharded_decode_attention`` over the mesh of ``jax.set_mesh``, as the
  registry calls it (unchecked arguments)."""
  del rng  # no random search here (MC-Search is refused)
  mesh = _mesh.context_mesh(DECODE_OP.label)
  return sharded_decode_attention(
    query, cache, policy=policy, mesh=mesh, scale=scale
  )


# ``decode_attention(implementation='sharded')`` under ``jax.set_mesh``.
DECODE_OP = registry.register(
  registry.AttentionOp(
    name="sharded_decode",
    implementation="sharded",
    kind="decode",
    fn=_decode_op,
    label="decode_attention(implementation='sharded')",
    supports=_kv_sharded.SUPPORTS,
    arguments=frozenset({"traced_scale"}),  # one query step, no residual
    cache_types=(KVCache,),
  )
)
