"""Certified Top-k attention with the keys split across devices.

DESIGN.md layer 6, THEORY 2.1, 2.4, 3.4, 4.2, 6.1. The key/value sequence of
every row is split into contiguous slices, one per shard of a mapped axis
(``kv`` of a mesh under shard_map, or a vmap axis in tests). Per row, each
shard:

1. scores its keys, s_i = scale * q.k_i (float32, HIGHEST precision so that a
   TPU does not use bf16 passes), and takes part in one ``pmax`` of (its max
   logit, its max key norm, a non-finite flag): the global max M;
2. takes part in the global selection (``_global_select``): exact global
   top-k for count policies, a global-eps threshold for ``Certified``;
3. returns its partial softmax statistics over its KEPT keys relative to M,
   o = sum_H exp(s_i - M) v_i and l = sum_H exp(s_i - M), and the log of its
   DROPPED mass lse_T = log sum_T exp(s_i) (log space, so a shard whose keys
   all sit far below M still reports a positive tail, not an underflowed 0).

One ``psum`` of (o, l, counts) and one ``all_gather`` of the per-shard
lse_T (a few floats per row) merge them. The output o / l is exactly the
single-device Top-k output over the union of kept keys (l >= 1: the global
max is always kept). The global certificate is

  log tau <= lse_T - logaddexp(lse_T, M + log l) + 2 E + 2 slack(n),

the global dropped mass over the global partition function (THEORY 2.1;
tau = Z_T / (Z_T + Z_H) by 2.4). It is sound because each term is a sum of
the shards' own exact sums: Z_T = sum over shards of Z_T(shard), Z_H
likewise, with nothing estimated. ``slack(n)`` is the float rounding of those
sums (``theory._tail.log_slack``); E bounds the float32 rounding of the
logits themselves, |s~_i - s_i| <= (d + 2) eps32 scale sum_c |q_c k_ic| <=
(d + 2) eps32 scale ||q|| max_i ||k_i|| (Cauchy-Schwarz), doubled to cover
the norms' own rounding; the tail can be e^E larger and the head e^E
smaller than computed, hence 2 E.

The output-error bound is THEORY 4.2 with 4.4: ||Attn - Attn_k|| <= tau
(||mu_head|| + max_T ||v_j||) <= tau (max_H ||v_j|| + max_T ||v_j||), with tau
replaced by its bound and both maxima merged by one pmax (as
``selection._certify.output_error_bound``).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.special import logsumexp
from jax.sharding import PartitionSpec as P

from jaxtopk.parallel import _compat
from jaxtopk.parallel import _global_select
from jaxtopk.parallel import _mesh
from jaxtopk.selection import Certificate
from jaxtopk.selection import Certified
from jaxtopk.selection import Dense
from jaxtopk.selection import Policy
from jaxtopk.selection import _certify
from jaxtopk.selection import _select as _select_lib
from jaxtopk.theory import _tail

_HIGHEST = lax.Precision.HIGHEST


def _select(s, valid, row_max, log_err, n_valid, *, policy, n_total, axis_name):
  """The policy's global kept set, as this shard's local mask.

  Count policies use ``selection.count_kept`` over each row's real keys
  (``n_valid``, global), as ``jaxtopk.topk_attention`` does.
  """
  if isinstance(policy, Dense):
    return valid
  if isinstance(policy, Certified):
    # 'delta' and 'mc' score only part of a row; with every logit already
    # computed here they fall back to the exact search, as topk_attention
    # does in prefill (keys_scored then says every key was scored).
    dt = s.dtype
    # Reserve room for the rounding that the certificate adds (2 E + 2 slack)
    # and for the histogram's own rounding (2 more slacks).
    slack = _tail.log_slack(n_total, dt)
    log_budget = jnp.log(jnp.asarray(policy.eps, dt)) - log_err - 4 * slack
    keep = _global_select.global_certified_keep(
      s, valid, row_max, log_budget, n_total=n_total, axis_name=axis_name
    )
    if policy.max_topk is not None and policy.max_topk < n_total:
      capped = _global_select.global_topk_keep(
        s, valid, topk=policy.max_topk, axis_name=axis_name
      )
      n_keep = _global_select.psum(jnp.sum(keep, -1), axis_name)
      keep = jnp.where((n_keep > policy.max_topk)[..., None], capped, keep)
    return keep
  topk = policy.num_kept(n_total)
  if topk is None:
    raise ValueError(f"{policy=} gives no static number of kept keys")
  row_topk = _select_lib.count_kept(policy, n_valid, n_total)
  return _global_select.global_topk_keep(
    s, valid, topk=topk, axis_name=axis_name, row_topk=row_topk
  )


def kv_shard_attention(
  query,
  key,
  value,
  valid,
  *,
  policy: Policy,
  scale: float,
  axis_name,
  n_total: int,
  return_keep: bool = False,
):
  """Top-k attention for this shard's slice of keys, merged globally.

  Call inside ``shard_map`` (``axis_name`` = the mesh axis the keys are split
  over) or ``jax.vmap(..., axis_name=...)``; with ``axis_name=None`` it is
  plain single-device Top-k attention. Head-major layout.

  Args:
    query: ``[batch, heads, q_len, head_dim]`` (the same on every shard).
    key: ``[batch, heads, n_local, head_dim]`` this shard's keys.
    value: ``[batch, heads, n_local, v_dim]`` this shard's values.
    valid: bool broadcastable to ``[batch, heads, q_len, n_local]``, True for
      a real key (padding and causal masks already applied).
    policy: a selection policy, applied to the whole (global) row: Dense,
      FixedK, Ratio, PowerLaw (per-row count over the row's real keys), or
      Certified with a global eps (every search runs the exact one here).
    scale: positive logit scale.
    axis_name: the mapped axis the keys are split over, or None.
    n_total: static number of keys over all shards (``devices * n_local``).
    return_keep: also return this shard's kept set (for tests and tools).

  Returns:
    ``(output, certificate)``: output ``[batch, heads, q_len, v_dim]`` in the
    query's dtype, identical on every shard; a Certificate of
    ``[batch, heads, q_len]`` fields (tv_bound and output_error_bound sound
    against exact arithmetic, see the module docstring). With
    ``return_keep``, a third item: ``[batch, heads, q_len, n_local]`` bool.
  """
  dt = _tail.compute_dtype(query.dtype)
  eps = jnp.finfo(dt).eps
  q = query.astype(dt)
  # Keys and values stay in their storage dtype (no float32 copy of the
  # cache): the dots accumulate in float32. bf16 x bf16 products are exact
  # in float32, so the rounding bound below is unchanged.
  k, v = key, value
  d = q.shape[-1]
  s = jnp.einsum(
    "bhtd,bhsd->bhts",
    q.astype(jnp.promote_types(query.dtype, key.dtype)),
    k,
    precision=_HIGHEST,
    preferred_element_type=dt,
  )
  s = s * scale
  valid = jnp.broadcast_to(jnp.asarray(valid, bool), s.shape)
  s_ng = lax.stop_gradient(s)

  # One pmax (global max logit, max key norm, any non-finite real logit) and
  # one psum (number of real keys).
  k_f = lax.stop_gradient(k).astype(dt)  # fused into the reduction
  k_norm = jnp.sqrt(jnp.sum(k_f * k_f, axis=-1))  # [b, h, s]
  local_max = jnp.max(s_ng, axis=-1, where=valid, initial=-jnp.inf)
  local_kn = jnp.max(
    jnp.where(valid, k_norm[:, :, None, :], 0.0), axis=-1, initial=0.0
  )
  local_bad = jnp.any(valid & ~jnp.isfinite(s_ng), axis=-1).astype(dt)
  row_max, kn, bad = _global_select.pmax(
    (local_max, local_kn, local_bad), axis_name
  )  # [b, h, t] each
  n_valid = _global_select.psum(
    jnp.sum(valid, axis=-1, dtype=jnp.int32), axis_name
  )
  row_ok = jnp.isfinite(row_max) & (bad == 0)
  q_norm = jnp.linalg.norm(lax.stop_gradient(q), axis=-1)  # [b, h, t]
  log_err = 2.0 * (2.0 * (d + 2) * eps * scale * q_norm * kn)  # 2 E
  log_err = jnp.where(row_ok, log_err, 0.0)

  keep = _select(
    s_ng,
    valid,
    row_max,
    log_err,
    n_valid,
    policy=policy,
    n_total=n_total,
    axis_name=axis_name,
  )
  tail = valid & ~keep

  m = lax.stop_gradient(jnp.where(row_ok, row_max, 0.0))[..., None]
  w = jnp.where(keep, jnp.exp(jnp.where(keep, s, m) - m), 0.0)  # [b,h,t,s]
  num = jnp.einsum("bhts,bhse->bhte", w, v, precision=_HIGHEST)
  den = jnp.sum(w, axis=-1)  # [b, h, t]
  lse_tail_local = logsumexp(s_ng, axis=-1, where=tail)  # -inf if empty
  v_norm = _certify.value_norms(lax.stop_gradient(v))[:, :, None, :]
  vmax_local = jnp.stack(
    [_certify.max_norm(v_norm, keep), _certify.max_norm(v_norm, tail)], -1
  )  # [b, h, t, 2]: kept and dropped values' largest norms
  counts = jnp.stack(
    [jnp.sum(keep, axis=-1), jnp.sum(valid, axis=-1)], axis=-1
  ).astype(jnp.int32)  # [b, h, t, 2]

  # The merge: one psum and one all-gather of small per-row statistics.
  num, den, counts = _global_select.psum((num, den, counts), axis_name)
  lse_tails = _global_select.gather_last(lse_tail_local[..., None], axis_name)
  vmax = _global_select.pmax(vmax_local, axis_name)
  lse_tail = logsumexp(lse_tails, axis=-1)  # [b, h, t]

  den_safe = jnp.where(row_ok, den, 1.0)
  out = num / den_safe[..., None]
  out = jnp.where(row_ok[..., None], out, 0.0)

  lse_head = m[..., 0] + jnp.log(den_safe)
  slack = _tail.log_slack(n_total, dt)
  log_tv = lse_tail - jnp.logaddexp(lse_tail, lse_head) + log_err + 2 * slack
  log_tv = jnp.minimum(log_tv, 0.0)
  # exp underflows (and XLA flushes subnormals) below the smallest normal
  # float: round a positive bound up to it so tv_bound stays >= the truth.
  tv = jnp.where(
    log_tv > -jnp.inf, jnp.maximum(jnp.exp(log_tv), jnp.finfo(dt).tiny), 0.0
  )
  err = _certify.output_error_bound(tv, vmax[..., 0], vmax[..., 1])

  nan = jnp.asarray(jnp.nan, dt)
  cert = Certificate(
    tv_bound=jnp.where(row_ok, tv, nan).astype(jnp.float32),
    log_tv_bound=jnp.where(row_ok, log_tv, nan).astype(jnp.float32),
    k_kept=counts[..., 0],
    keys_scored=counts[..., 1],
    output_error_bound=jnp.where(row_ok, err, nan).astype(jnp.float32),
    valid=row_ok,
  )
  if return_keep:
    return out.astype(query.dtype), cert, keep
  return out.astype(query.dtype), cert


def _mask_spec(mask_shape, full_shape, axes):
  """PartitionSpec for a [b, h, t, s]-rank mask; size-1 dims replicated."""
  spec = []
  for dim, (size, full, ax) in enumerate(
    zip(mask_shape, full_shape, axes, strict=True)
  ):
    if size == full:
      spec.append(ax)
    elif size == 1:
      spec.append(None)
    else:
      raise ValueError(
        f"mask dim {dim} has size {size}; it must be 1 or {full} (mask shape"
        f" {mask_shape} must broadcast to [batch, heads, q_len, kv_len] ="
        f" {full_shape})"
      )
  return P(*spec)


@functools.lru_cache(maxsize=64)
def _build(mesh, policy, scale, is_causal, n_total, axes, mask_spec, has_mask):
  """A jitted shard_map for one configuration (cached: no retracing)."""
  b_ax, h_ax, s_ax = axes
  n_shards = 1 if s_ax is None else mesh.shape[s_ax]
  n_local = n_total // n_shards

  def per_shard(q, k, v, mask):
    b, t, h, d = q.shape  # local sizes
    hk = k.shape[2]
    g = h // hk  # GQA: the g query heads of a kv head become g * t rows
    q = q.reshape(b, t, hk, g, d).transpose(0, 2, 3, 1, 4)  # [b,hk,g,t,d]
    q = q.reshape(b, hk, g * t, d)
    k = jnp.swapaxes(k, 1, 2)  # [b, hk, s, d]
    v = jnp.swapaxes(v, 1, 2)  # [b, hk, s, e]
    if mask is None:
      valid = jnp.ones((1, 1, 1, 1, n_local), bool)
    elif mask.shape[1] == 1:
      valid = mask[:, :, None]  # [b|1, 1, 1, t|1, s]
    else:
      valid = mask.reshape(mask.shape[0], hk, g, *mask.shape[2:])
    if is_causal:
      first = 0 if s_ax is None else lax.axis_index(s_ax) * n_local
      k_pos = first + jnp.arange(n_local)
      valid = valid & (k_pos[None, :] <= jnp.arange(t)[:, None])
    valid = jnp.broadcast_to(valid, (*valid.shape[:2], g, t, n_local))
    valid = valid.reshape(*valid.shape[:2], g * t, n_local)
    out, cert = kv_shard_attention(
      q,
      k,
      v,
      valid,
      policy=policy,
      scale=scale,
      axis_name=s_ax,
      n_total=n_total,
    )

    def to_bth(x):  # [b, hk, g * t, ...] -> [b, t, h, ...]
      x = x.reshape(b, hk, g, t, *x.shape[3:])
      x = jnp.moveaxis(x, 3, 1)  # [b, t, hk, g, ...]
      return x.reshape(b, t, h, *x.shape[4:])

    return to_bth(out), jax.tree.map(to_bth, cert)

  q_spec = P(b_ax, None, h_ax, None)
  kv_spec = P(b_ax, s_ax, h_ax, None)
  row = P(b_ax, None, h_ax)
  cert_spec = Certificate(
    tv_bound=row,
    log_tv_bound=row,
    k_kept=row,
    keys_scored=row,
    output_error_bound=row,
    valid=row,
  )
  in_specs = (q_spec, kv_spec, kv_spec, mask_spec if has_mask else None)
  fn = _compat.shard_map(
    per_shard,
    mesh=mesh,
    in_specs=in_specs,
    out_specs=(P(b_ax, None, h_ax, None), cert_spec),
  )
  return jax.jit(fn)


def make_sharded_attention(
  mesh: jax.sharding.Mesh,
  *,
  policy: Policy,
  kv_len: int,
  head_dim: int,
  mask_shape: tuple[int, ...] | None = None,
  batch_heads_qlen: tuple[int, int, int] | None = None,
  is_causal: bool = False,
  scale: float | None = None,
  batch_axis: str | None = _mesh.DATA,
  head_axis: str | None = _mesh.HEADS,
  kv_axis: str | None = _mesh.KV,
):
  """The jitted shard_map behind ``sharded_topk_attention``.

  Useful to ``.lower()`` with ``jax.ShapeDtypeStruct``s (compile without
  allocating, e.g. to read the collectives of a 1M-key decode step).

  Args:
    mesh, policy, is_causal, scale, *_axis: as ``sharded_topk_attention``.
    kv_len: static number of keys.
    head_dim: query/key head dim (for the default scale).
    mask_shape: the 4-d shape of the mask that will be passed, or None for no
      mask (then call with ``mask=None``).
    batch_heads_qlen: (batch, heads, q_len), needed to shard a mask.

  Returns:
    ``fn(query, key, value, mask) -> (output, certificate)``, jitted.
  """
  scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
  if not scale > 0:
    raise ValueError(f"{scale=} must be > 0")
  axes = tuple(
    _mesh.axis_or_none(mesh, a) for a in (batch_axis, head_axis, kv_axis)
  )
  if axes[2] is not None and kv_len % mesh.shape[axes[2]]:
    raise ValueError(
      f"kv_len={kv_len} must be divisible by mesh axis {axes[2]!r} of size"
      f" {mesh.shape[axes[2]]}"
    )
  mask_spec = None
  if mask_shape is not None:
    b, h, t = batch_heads_qlen
    mask_axes = (axes[0], axes[1], None, axes[2])
    mask_spec = _mask_spec(tuple(mask_shape), (b, h, t, kv_len), mask_axes)
  return _build(
    mesh,
    policy,
    scale,
    bool(is_causal),
    kv_len,
    axes,
    mask_spec,
    mask_shape is not None,
  )


def sharded_topk_attention(
  query,
  key,
  value,
  *,
  policy: Policy,
  mesh: jax.sharding.Mesh,
  mask=None,
  is_causal: bool = False,
  scale: float | None = None,
  batch_axis: str | None = _mesh.DATA,
  head_axis: str | None = _mesh.HEADS,
  kv_axis: str | None = _mesh.KV,
):
  """Certified Top-k attention sharded over batch, heads and key sequence.

  jax.nn layout at the boundary. Batch and heads are embarrassingly parallel;
  along ``kv_axis`` the keys are split into contiguous slices and the
  selection, output and certificate are GLOBAL over the whole row (see the
  module docstring): the result equals single-device Top-k attention.

  Args:
    query: ``[batch, q_len, heads, head_dim]``.
    key: ``[batch, kv_len, kv_heads, head_dim]``; heads a multiple of
      kv_heads (GQA: no copy of the keys, the query heads of a kv head are
      rows of one attention problem).
    value: ``[batch, kv_len, kv_heads, v_dim]``.
    policy: Dense, FixedK, Ratio, PowerLaw (per-row count over the row's
      real keys, as ``topk_attention``) or Certified with a GLOBAL eps
      (searches 'delta' and 'mc' run the exact search: every logit is
      computed).
    mesh: the device mesh. Axes it lacks (or of size 1) are not sharded.
    mask: optional bool, broadcastable to ``[batch, heads, q_len, kv_len]``
      (jax.nn convention: True = attend); each dim of size 1 or full.
    is_causal: key j is visible to query i iff j <= i (as jax.nn).
    scale: logit scale, default ``1 / sqrt(head_dim)``.
    batch_axis: mesh axis for the batch, or None.
    head_axis: mesh axis for the heads, or None.
    kv_axis: mesh axis for the key sequence, or None.

  Returns:
    ``(output, certificate)``: output ``[batch, q_len, heads, v_dim]`` in the
    query's dtype; Certificate fields ``[batch, q_len, heads]``.

  Raises:
    ValueError: for mismatched shapes, sizes not divisible by their mesh axis,
      or a non-positive scale.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxtopk import FixedK, parallel
    >>> mesh = parallel.make_mesh({"kv": 1})
    >>> x = jax.random.normal(jax.random.key(0), (1, 4, 2, 8))
    >>> out, cert = parallel.sharded_topk_attention(
    ...     x, x, x, policy=FixedK(2), mesh=mesh)
    >>> out.shape, cert.k_kept.shape
    ((1, 4, 2, 8), (1, 4, 2))
  """
  query, key, value = map(jnp.asarray, (query, key, value))
  if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
    raise ValueError(
      f"query, key, value must be [batch, seq, heads, dim]; got"
      f" {query.shape=}, {key.shape=}, {value.shape=}"
    )
  b, t, h, d = query.shape
  if key.shape[0] != b or key.shape[3] != d:
    raise ValueError(f"{key.shape=} does not match {query.shape=}")
  if h % key.shape[2]:
    raise ValueError(
      f"num_heads={h} must be a multiple of num_kv_heads={key.shape[2]} (GQA)"
    )
  if value.shape[:3] != key.shape[:3]:
    raise ValueError(f"{value.shape=} does not match {key.shape=}")
  hk = key.shape[2]
  for name, size, ax in (
    ("batch", b, batch_axis),
    ("num_kv_heads", hk, head_axis),
  ):
    ax = _mesh.axis_or_none(mesh, ax)
    if ax is not None and size % mesh.shape[ax]:
      raise ValueError(
        f"{name}={size} must be divisible by mesh axis {ax!r} of size"
        f" {mesh.shape[ax]}"
      )
  mask_shape = None
  if mask is not None:
    mask = jnp.asarray(mask, bool)
    if mask.ndim > 4:
      raise ValueError(f"{mask.shape=} has more than 4 dims")
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    mask_shape = mask.shape
  fn = make_sharded_attention(
    mesh,
    policy=policy,
    kv_len=key.shape[1],
    head_dim=d,
    mask_shape=mask_shape,
    batch_heads_qlen=(b, h, t),
    is_causal=is_causal,
    scale=scale,
    batch_axis=batch_axis,
    head_axis=head_axis,
    kv_axis=kv_axis,
  )
  return fn(query, key, value, mask)
