"""Certified Top-k attention with the keys split across devices.

DESIGN.md layer 6, THEORY 2.1, 2.4, 3.4, 4.2, 6.1. The key/value sequence of
every row is split into contiguous slices, one per shard of a mapped axis
(``kv`` of a mesh under shard_map, or a vmap axis in tests). Per row, each
shard:

1. scores its keys, s_i = scale q.k_i (+ bias_i) in the compute dtype
   (HIGHEST precision, so that a TPU does not use bf16 passes; the
   certificate assumes full-precision products);
2. takes part in one ``pmax`` of its key summaries (largest key norm,
   per-dimension |k| maxima, subnormal flags, largest |bias|) from which
   ``core.logit_error_bound`` bounds the rounding of EVERY logit of the row,
   and of its max logit and non-finite flag;
3. takes part in the global selection (``_global_select``): exact global
   top-k for count policies, a global-eps threshold for ``Certified``;
4. summarises its keys as a ``core.PartialSoftmax`` (normalised output over its
   kept keys, head and tail masses with their own maxima, counts, value
   norms).

One ``all_gather`` of the shards' Partials (``v_dim`` + 11 numbers per row
and shard) and ``core.PartialSoftmax.reduce`` merge them, and ``finalize`` gives
the output and the GLOBAL certificate (THEORY 2.1: the dropped mass of the
whole row over its whole partition function). Nothing is estimated: every
sum is a sum of the shards' own sums, so the certificate is sound whatever
the selection decided, and equals the single-device one up to rounding.

Policies: Dense, FixedK, Ratio, PowerLaw (per-row count over the row's real
keys) and ``Certified`` with the exact search (every logit is computed here)
and ``max_topk``. Delta- and MC-Search skip key blocks by their summaries,
which this path does not keep: ``Certified(..., search='delta' | 'mc')`` is
refused by name (``UnsupportedPolicyError``), never silently run as exact.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxtopk.attention import checks
from jaxtopk.attention import registry
from jaxtopk.parallel import _compat
from jaxtopk.parallel import _global_select
from jaxtopk.parallel import _mesh
from jaxtopk.selection import Certificate
from jaxtopk.selection import Policy
from jaxtopk.selection import core
from jaxtopk.selection.internal import capabilities

_HIGHEST = core.PRECISION  # full float32 products (the bounds assume it)

# What the KV-sharded paths honour (every other policy field is refused):
# the policy features of the registry's 'sharded_prefill' and
# 'sharded_decode' ops.
SUPPORTS = capabilities(
  "policy=Dense",
  "policy=FixedK",
  "policy=Ratio",
  "policy=PowerLaw",
  "policy=Certified",
  "search=exact",
  "max_topk",
)


def _select(s, real, row_max, delta, n_real, *, policy, n_total, axis_name):
  """The policy's global kept set, as this shard's local mask."""
  if policy.kind == "dense":
    return real
  if policy.kind == "certified":
    # Aim below log eps by the margin the finished certificate adds (its
    # slacks and 2 delta) and the histogram's own rounding.
    dt = s.dtype
    margin = core.search_log_margin(n_total, delta, dt)
    log_budget = jnp.log(jnp.asarray(policy.eps, dt)) - margin
    keep = _global_select.global_certified_keep(
      s, real, row_max, log_budget, n_total=n_total, axis_name=axis_name
    )
    if policy.max_topk is not None and policy.max_topk < n_total:
      capped = _global_select.global_topk_keep(
        s, real, topk=policy.max_topk, axis_name=axis_name
      )
      n_keep = _global_select.psum(jnp.sum(keep, -1), axis_name)
      keep = jnp.where((n_keep > policy.max_topk)[..., None], capped, keep)
    return keep
  row_topk = policy.row_num_kept(n_real, n_total)
  return _global_select.global_topk_keep(
    s,
    real,
    topk=policy.num_kept(n_total),
    axis_name=axis_name,
    row_topk=row_topk,
  )


def _logit_error(q, k, used, bias, real, *, scale, axis_name):
  """``[b, h, t]`` bound on |computed - exact| for every logit of each row.

  From per-row query summaries and GLOBAL key summaries (one pmax): the
  largest key norm, per-dimension |k| maxima (box form), whether any key
  has subnormal components, and the largest finite |bias|.
  """
  dt = core.compute_dtype(jnp.result_type(q.dtype, k.dtype))
  d = q.shape[-1]
  k_norm = core.max_norm(core.norms_up(k), used)  # [b, h]
  kabs = core.max_nan(
    jnp.where(used[..., None], jnp.abs(k.astype(dt)), 0.0), axis=-2
  )  # [b, h, d]
  k_fl = jnp.any(used & core.flushed(k), axis=-1).astype(dt)  # [b, h]
  stats = [k_norm, kabs, k_fl]
  if bias is not None:
    b_abs = jnp.max(
      jnp.where(real, jnp.abs(bias.astype(dt)), 0.0), axis=-1
    )  # [b, h, t]
    stats.append(b_abs)
  stats = _global_select.pmax(tuple(stats), axis_name)
  k_norm, kabs, k_fl = stats[:3]
  abs_dot = core.abs_dot_box(q, kabs[..., None, :])[..., 0]  # [b, h, t]
  return core.logit_error_bound(
    q_norm=core.norms_up(q),
    k_norm=k_norm[..., None],
    head_dim=d,
    scale=scale,
    abs_dot=abs_dot,
    q_flushed=core.flushed(q),
    k_flushed=(k_fl > 0)[..., None],
    q_absmax=jnp.max(jnp.abs(q.astype(dt)), -1),
    k_absmax=jnp.max(kabs, -1)[..., None],
    bias_abs=stats[3] if bias is not None else None,
  )


def kv_shard_attention(
  query,
  key,
  value,
  valid,
  *,
  policy: Policy,
  scale,
  axis_name,
  n_total: int,
  bias=None,
  value_norms=None,
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
    policy: applied to the whole (global) row: Dense, FixedK, Ratio,
      PowerLaw (per-row count over the row's real keys), or Certified with
      a global eps, the exact search and optionally ``max_topk``; anything
      else raises ``UnsupportedPolicyError`` naming the field.
    scale: positive logit scale (Python float, or a traced 0-d array; rows
      with a scale that is not finite and >= ``core.MIN_SCALE`` are
      invalid).
    axis_name: the mapped axis the keys are split over, or None.
    n_total: static number of keys over all shards (``devices * n_local``).
    bias: optional additive bias broadcastable to ``[batch, heads, q_len,
      n_local]`` (this shard's slice); -inf is a key of zero mass.
    value_norms: optional ``[batch, heads, n_local]`` upper bounds on
      ||v_j|| (e.g. a cache's block norms; NaN marks a broken value);
      computed with ``core.value_norms`` when None.
    return_keep: also return this shard's kept set (for tests and tools).

  Returns:
    ``(output, certificate)``: output ``[batch, heads, q_len, v_dim]`` in the
    query's dtype, identical on every shard (zeros on invalid rows); a
    Certificate of ``[batch, heads, q_len]`` fields, sound against exact
    arithmetic (``jaxtopk.selection.core``). With ``return_keep``, a third
    item: ``[batch, heads, q_len, n_local]`` bool.

  Raises:
    UnsupportedPolicyError: a policy field this path does not honour.
  """
  checks.check_policy(policy, "kv_shard_attention", SUPPORTS)
  dt = core.compute_dtype(jnp.result_type(query.dtype, key.dtype))
  # Keys and values stay in their storage dtype (no float32 copy of the
  # cache): the dots accumulate in the compute dtype at full precision.
  s = jnp.einsum(
    "bhtd,bhsd->bhts",
    query.astype(jnp.promote_types(query.dtype, key.dtype)),
    key,
    precision=_HIGHEST,
    preferred_element_type=dt,
  )
  s = s * jnp.asarray(scale, dt)
  if bias is not None:
    s = s + jnp.broadcast_to(bias, s.shape).astype(dt)
  valid = jnp.broadcast_to(jnp.asarray(valid, bool), s.shape)
  sg = lax.stop_gradient(s)
  real = valid & (sg > -jnp.inf)

  qs, ks = lax.stop_gradient(query), lax.stop_gradient(key)
  used = jnp.any(valid, axis=-2)  # [b, h, s]: keys some row attends to
  bias_b = None if bias is None else jnp.broadcast_to(bias, s.shape)
  delta = _logit_error(
    qs, ks, used, bias_b, real, scale=scale, axis_name=axis_name
  )
  row_max = _global_select.pmax(
    jnp.max(jnp.where(real, sg, -jnp.inf), axis=-1, initial=-jnp.inf),
    axis_name,
  )
  n_real = _global_select.psum(
    jnp.sum(real, axis=-1, dtype=jnp.int32), axis_name
  )
  keep = _select(
    sg,
    real,
    row_max,
    delta,
    n_real,
    policy=policy,
    n_total=n_total,
    axis_name=axis_name,
  )
  if value_norms is None:
    value_norms = core.value_norms(lax.stop_gradient(value))  # [b, h, s]
  # A non-finite value enters no output: a row with such a REAL key is
  # invalid through its NaN norm (core), and a key a row does not attend to
  # (masked for that row) must not turn its output to NaN via 0 * NaN.
  value_f = jnp.where(jnp.isfinite(value), value, jnp.zeros((), value.dtype))

  def value_fn(p):  # [b, h, t, s] normalised kept weights
    return jnp.einsum(
      "bhts,bhse->bhte",
      p,
      value_f,
      precision=_HIGHEST,
      preferred_element_type=dt,
    )

  part = core.PartialSoftmax.from_logits(
    s,
    keep,
    valid,
    logit_error=delta,
    value_fn=value_fn,
    value_norms=value_norms[:, :, None, :],
    keys_scored=jnp.sum(valid, axis=-1, dtype=jnp.int32),
  )
  if axis_name is not None:
    parts = jax.tree.map(lambda x: lax.all_gather(x, axis_name), part)
    part = core.PartialSoftmax.reduce(parts, 0)
  out, cert = part.finalize(n_terms=n_total, scale_ok=checks.scale_ok(scale))
  out = out.astype(query.dtype)
  if return_keep:
    return out, cert, keep
  return out, cert


def _mask_spec(mask_shape, full_shape, axes, name="mask"):
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
        f"{name} dim {dim} has size {size}; it must be 1 or {full} ({name}"
        f" shape {mask_shape} must broadcast to [batch, heads, q_len, kv_len]"
        f" = {full_shape})"
      )
  return P(*spec)


def _cert_spec(row):
  return Certificate(
    tv_bound=row,
    log_tv_bound=row,
    k_kept=row,
    keys_scored=row,
    output_error_bound=row,
    valid=row,
  )


@functools.lru_cache(maxsize=64)
def _build(mesh, policy, scale, is_causal, n_total, axes, specs):
  """A jitted shard_map for one configuration (cached: no retracing).

  ``scale`` is a Python float, or None when it is passed as a (traced)
  argument; ``specs`` holds the mask and bias PartitionSpecs (None: absent).
  """
  b_ax, h_ax, s_ax = axes
  n_shards = 1 if s_ax is None else mesh.shape[s_ax]
  n_local = n_total // n_shards
  mask_spec, bias_spec = specs

  def per_shard(q, k, v, mask, bias, *scl):
    b, t, h, d = q.shape  # local sizes
    hk = k.shape[2]
    g = h // hk  # GQA: the g query heads of a kv head become g * t rows
    q = q.reshape(b, t, hk, g, d).transpose(0, 2, 3, 1, 4)  # [b,hk,g,t,d]
    q = q.reshape(b, hk, g * t, d)
    k = jnp.swapaxes(k, 1, 2)  # [b, hk, s, d]
    v = jnp.swapaxes(v, 1, 2)  # [b, hk, s, e]

    def rows(x, fill):  # [b|1, h|1, t|1, s] -> [b|1, hk|1, g * t, s]
      if x is None:
        return None
      if x.shape[1] == 1:
        x = x[:, :, None]  # [b|1, 1, 1, t|1, s]
      else:
        x = x.reshape(x.shape[0], hk, g, *x.shape[2:])
      x = jnp.broadcast_to(x, (*x.shape[:2], g, t, n_local))
      return x.reshape(*x.shape[:2], g * t, n_local)

    valid = rows(mask, True)
    if valid is None:
      valid = jnp.ones((1, 1, 1, n_local), bool)
    if is_causal:
      first = 0 if s_ax is None else lax.axis_index(s_ax) * n_local
      k_pos = first + jnp.arange(n_local)
      causal = k_pos[None, :] <= jnp.arange(t)[:, None]  # [t, s]
      causal = jnp.broadcast_to(causal, (g, t, n_local)).reshape(g * t, -1)
      valid = valid & causal
    out, cert = kv_shard_attention(
      q,
      k,
      v,
      valid,
      bias=rows(bias, 0.0),
      policy=policy,
      scale=scale if not scl else scl[0],
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
  in_specs = (q_spec, kv_spec, kv_spec, mask_spec, bias_spec)
  if scale is None:
    in_specs = in_specs + (P(),)
  fn = _compat.shard_map(
    per_shard,
    mesh=mesh,
    in_specs=in_specs,
    out_specs=(P(b_ax, None, h_ax, None), _cert_spec(row)),
  )
  if scale is None:
    return jax.jit(fn)
  return jax.jit(lambda q, k, v, mask, bias=None: fn(q, k, v, mask, bias))


def make_sharded_attention(
  mesh: jax.sharding.Mesh,
  *,
  policy: Policy,
  kv_len: int,
  head_dim: int,
  mask_shape: tuple[int, ...] | None = None,
  bias_shape: tuple[int, ...] | None = None,
  batch_heads_qlen: tuple[int, int, int] | None = None,
  is_causal: bool = False,
  scale=None,
  batch_axis: str | None = _mesh.DATA,
  head_axis: str | None = _mesh.HEADS,
  kv_axis: str | None = _mesh.KV,
):
  """The jitted shard_map behind ``sharded_topk_attention``.

  Useful to ``.lower()`` with ``jax.ShapeDtypeStruct``s (compile without
  allocating, e.g. to read the collectives of a 1M-key decode step).

  Args:
    mesh, policy, is_causal, *_axis: as ``sharded_topk_attention``.
    kv_len: static number of keys.
    head_dim: query/key head dim (for the default scale).
    mask_shape: the 4-d shape of the mask that will be passed, or None for no
      mask (then call with ``mask=None``).
    bias_shape: likewise for the bias.
    batch_heads_qlen: (batch, heads, q_len), needed to shard a mask or bias.
    scale: a Python float (static), None (1/sqrt(head_dim)), or the string
      'dynamic': the scale is then the fifth argument of the returned
      function (a 0-d array, e.g. a traced temperature).

  Returns:
    ``fn(query, key, value, mask, bias[, scale]) -> (output, certificate)``,
    jitted.

  Raises:
    UnsupportedPolicyError: a policy field this path does not honour.
    ValueError: sizes not divisible by their mesh axes, a bad scale.
  """
  checks.check_policy(policy, "sharded_topk_attention", SUPPORTS)
  dynamic = isinstance(scale, str) and scale == "dynamic"
  if not dynamic:
    scale = checks.check_scale(scale, head_dim)
    if not isinstance(scale, float):
      raise TypeError(
        "make_sharded_attention: an array scale must be passed at call time;"
        " use scale='dynamic'"
      )
  axes = tuple(
    _mesh.axis_or_none(mesh, a) for a in (batch_axis, head_axis, kv_axis)
  )
  if axes[2] is not None and kv_len % mesh.shape[axes[2]]:
    raise ValueError(
      f"kv_len={kv_len} must be divisible by mesh axis {axes[2]!r} of size"
      f" {mesh.shape[axes[2]]}"
    )
  specs = []
  for name, shape in (("mask", mask_shape), ("bias", bias_shape)):
    if shape is None:
      specs.append(None)
      continue
    b, h, t = batch_heads_qlen
    mask_axes = (axes[0], axes[1], None, axes[2])
    specs.append(_mask_spec(tuple(shape), (b, h, t, kv_len), mask_axes, name))
  fn = _build(
    mesh,
    policy,
    None if dynamic else scale,
    bool(is_causal),
    kv_len,
    axes,
    tuple(specs),
  )
  return fn


def sharded_topk_attention(
  query,
  key,
  value,
  *,
  policy: Policy,
  mesh: jax.sharding.Mesh,
  mask=None,
  bias=None,
  is_causal: bool = False,
  scale=None,
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
      real keys, as ``topk_attention``) or Certified with a GLOBAL eps, the
      exact search and optionally ``max_topk`` (Delta- and MC-Search are
      refused: ``UnsupportedPolicyError``).
    mesh: the device mesh. Axes it lacks (or of size 1) are not sharded.
    mask: optional bool, broadcastable to ``[batch, heads, q_len, kv_len]``
      (jax.nn convention: True = attend); each dim of size 1 or full.
    bias: optional additive float bias, same broadcasting (-inf is a key of
      zero mass).
    is_causal: key j is visible to query i iff j <= i (as jax.nn).
    scale: logit scale, default ``1 / sqrt(head_dim)``; a Python number
      (finite, >= float32's smallest normal ``core.MIN_SCALE``) or a 0-d
      array (e.g. traced; rows with a scale that is not finite and >=
      ``core.MIN_SCALE`` are invalid).
    batch_axis: mesh axis for the batch, or None.
    head_axis: mesh axis for the heads, or None.
    kv_axis: mesh axis for the key sequence, or None.

  Returns:
    ``(output, certificate)``: output ``[batch, q_len, heads, v_dim]`` in the
    query's dtype; Certificate fields ``[batch, q_len, heads]``
    (``attention.checks.empty_result`` when q_len or kv_len is 0).

  Raises:
    TypeError: non-floating inputs, a non-boolean mask, a non-bool
      ``is_causal``, a bad scale type.
    ValueError: mismatched shapes, sizes not divisible by their mesh axis,
      a scale that is not finite or below float32's smallest normal.
    UnsupportedPolicyError: a policy field this path does not honour.

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
  query, key, value, dims = checks.check_qkv(query, key, value)
  checks.check_policy(policy, "sharded_topk_attention", SUPPORTS)
  is_causal = checks.check_is_causal(is_causal)
  mask = checks.check_mask(mask, dims.logits_shape)
  bias = checks.check_bias(bias, dims.logits_shape)
  scale = checks.check_scale(scale, dims.head_dim)
  if dims.empty:
    return checks.empty_result(dims, query.dtype)
  b, t, h, d = query.shape
  hk = dims.num_kv_heads
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

  def as4(x):
    return None if x is None else x.reshape((1,) * (4 - x.ndim) + x.shape)

  mask, bias = as4(mask), as4(bias)
  dynamic = not isinstance(scale, float)
  fn = make_sharded_attention(
    mesh,
    policy=policy,
    kv_len=dims.kv_len,
    head_dim=d,
    mask_shape=None if mask is None else mask.shape,
    bias_shape=None if bias is None else bias.shape,
    batch_heads_qlen=(b, h, t),
    is_causal=is_causal,
    scale="dynamic" if dynamic else scale,
    batch_axis=batch_axis,
    head_axis=head_axis,
    kv_axis=kv_axis,
  )
  if dynamic:
    return fn(query, key, value, mask, bias, scale)
  return fn(query, key, value, mask, bias)


def _prefill_op(
  query,
  key,
  value,
  *,
  policy,
  mask,
  bias,
  is_causal,
  scale,
  values_bound,
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  local_window_size=None,
  return_residual=False,
):
  """``sharded_topk_attention`` over the mesh of ``jax.set_mesh``, as the
  registry calls it (the arguments it does not take are refused there)."""
  del query_seq_lengths, key_value_seq_lengths, local_window_size
  del return_residual
  mesh = _mesh.context_mesh(PREFILL_OP.label)
  out, cert = sharded_topk_attention(
    query,
    key,
    value,
    policy=policy,
    mesh=mesh,
    mask=mask,
    bias=bias,
    is_causal=is_causal,
    scale=scale,
  )
  if not values_bound:
    cert = dataclasses.replace(cert, output_error_bound=None)
  return out, cert, None


# ``topk_attention(implementation='sharded')`` under ``jax.set_mesh``: the
# mesh's axes 'data', 'heads' and 'kv' (``parallel.AXES``) are sharded.
PREFILL_OP = registry.register(
  registry.AttentionOp(
    name="sharded_prefill",
    implementation="sharded",
    kind="prefill",
    fn=_prefill_op,
    label="topk_attention(implementation='sharded')",
    supports=SUPPORTS,
    arguments=frozenset({"mask", "bias", "is_causal", "traced_scale"}),
  )
)
