"""One decode step over a KV cache whose positions are split across devices.

THEORY 8.1 and 6.5, DESIGN.md "one decode step". The cache
(``jaxtopk.attention.KVCache``, head-major ``[batch, kv_heads, max_len,
head_dim]``) is sharded along ``max_len`` over the mesh's ``kv`` axis
(contiguous slices), along batch over ``data`` and along kv heads over
``heads``. Each shard scores the new query against its slice (filled
positions only: ``position < length``), the selection is global (exact
global Top-k, or a global-eps certified threshold), and the partial
(o, l, m) and log tail masses are merged as in ``_kv_sharded.py``: the output
and certificate equal the single-device ones (same kept set for count
policies) and the certificate is global and sound.

GQA needs no copy of the cache: the ``group = heads / kv_heads`` query heads
sharing a kv head become ``group`` query rows of that head.

Per decode step and query row, the collectives carry: for count policies an
all-gather of ``kv_shards * min(topk, n_local)`` candidate logits or, when
cheaper, 4 psums of 256-bin radix counts (``global_topk_keep``), for
Certified two psums of 64-bin histograms, then one psum of (v_dim + 1)
floats, an all-gather of one float per shard and a few pmax/psum scalars.
The cache's block summaries are not read: Certified 'delta' and 'mc' run the
exact search here (``keys_scored`` says every filled position was scored).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxtopk.parallel import _compat
from jaxtopk.parallel import _kv_sharded
from jaxtopk.parallel import _mesh
from jaxtopk.selection import Certificate
from jaxtopk.selection import Policy


@functools.lru_cache(maxsize=64)
def _build(mesh, policy, scale, axes, max_len):
  b_ax, h_ax, s_ax = axes
  n_shards = 1 if s_ax is None else mesh.shape[s_ax]
  n_local = max_len // n_shards

  def per_shard(q, keys, values, length):
    b, _, h, d = q.shape  # local sizes
    hk = keys.shape[1]
    g = h // hk
    q = q.reshape(b, hk, g, d)  # [b, hk, g, d]: group = query rows
    first = 0 if s_ax is None else lax.axis_index(s_ax) * n_local
    pos = first + jnp.arange(n_local)
    valid = (pos[None, :] < length[:, None])[:, None, None, :]  # [b,1,1,s]
    out, cert = _kv_sharded.kv_shard_attention(
      q,
      keys,
      values,
      valid,
      policy=policy,
      scale=scale,
      axis_name=s_ax,
      n_total=max_len,
    )
    out = out.reshape(b, 1, h, -1)  # [b, 1, h, dv]
    cert = jax.tree.map(lambda x: x.reshape(b, 1, h), cert)
    return out, cert

  row = P(b_ax, None, h_ax)
  cert_spec = Certificate(
    tv_bound=row,
    log_tv_bound=row,
    k_kept=row,
    keys_scored=row,
    output_error_bound=row,
    valid=row,
  )
  cache_spec = P(b_ax, h_ax, s_ax, None)
  fn = _compat.shard_map(
    per_shard,
    mesh=mesh,
    in_specs=(P(b_ax, None, h_ax, None), cache_spec, cache_spec, P(b_ax)),
    out_specs=(P(b_ax, None, h_ax, None), cert_spec),
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

  Keys and values are split along positions; the small block summaries are
  replicated along ``kv`` (they are not read by the sharded decode step).

  Returns:
    A KVCache-shaped pytree of NamedSharding for ``jax.device_put``.
  """
  from jax.sharding import NamedSharding

  b, h, s = (
    _mesh.axis_or_none(mesh, a) for a in (batch_axis, head_axis, kv_axis)
  )
  kv = NamedSharding(mesh, P(b, h, s, None))
  box = NamedSharding(mesh, P(b, h, None, None))  # small: replicated on kv
  return type(cache)(
    keys=kv,
    values=kv,
    length=NamedSharding(mesh, P(b)),
    kmin=box,
    kmax=box,
    vnorm=NamedSharding(mesh, P(b, h, None)),
    block_size=cache.block_size,
  )


def sharded_decode_attention(
  query,
  cache,
  *,
  policy: Policy,
  mesh: jax.sharding.Mesh,
  scale: float | None = None,
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
      positions) or Certified with a GLOBAL eps (every search runs the exact
      one).
    mesh: the mesh; ``kv`` splits the cache positions, ``data`` the batch,
      ``heads`` the kv heads.
    scale: logit scale, default 1/sqrt(head_dim).
    batch_axis, head_axis, kv_axis: mesh axis names (None: not sharded).

  Returns:
    ``(output, certificate)``: ``[batch, 1, num_heads, head_dim_v]`` in the
    query's dtype, and a Certificate of ``[batch, 1, num_heads]`` arrays.

  Raises:
    ValueError: on bad shapes, or sizes not divisible by their mesh axes.
  """
  query = jnp.asarray(query)
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
  scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
  if not scale > 0:
    raise ValueError(f"{scale=} must be > 0")
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
  fn = _build(mesh, policy, scale, axes, max_len)
  return fn(query, cache.keys, cache.values, cache.length)
