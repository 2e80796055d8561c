"""``certified_search``: certified selection from queries and keys.

THEORY 6.1-6.3. Unlike ``select`` (which is handed every logit), this entry
point sees the queries and keys, so 'delta' and 'mc' searches can bound
blocks of keys from cheap summaries (box and ball, THEORY 3.3) and score only
the blocks they need. 'exact' scores every key and runs the threshold search.
The certificate accounts for the float rounding of the logits it computed.
"""

import functools

import jax
import jax.numpy as jnp

from jaxtopk.selection import _certify
from jaxtopk.selection import _lowrank
from jaxtopk.selection import _policies
from jaxtopk.selection import _search
from jaxtopk.selection import _select
from jaxtopk.theory import _tail


@functools.partial(
  jax.jit, static_argnames=("policy", "scale", "use_ball", "with_values")
)
def _certified_search(
  query,
  keys,
  valid,
  values,
  rng,
  projection,
  *,
  policy,
  scale,
  use_ball,
  with_values,
):
  *lead, n, d = keys.shape
  dt = _tail.compute_dtype(jnp.result_type(query.dtype, keys.dtype))
  bs = policy.block_size
  pad = -n % bs
  q = query.astype(dt).reshape(-1, d)  # [r, d]
  k = keys.astype(dt).reshape(-1, n, d)  # [r, n, d]
  v_ok = valid.reshape(-1, n)
  k = jnp.pad(k, ((0, 0), (0, pad), (0, 0)))
  v_ok = jnp.pad(v_ok, ((0, 0), (0, pad)))
  u, cnt, box = _search.block_bounds(
    q,
    k,
    v_ok,
    block_size=bs,
    scale=scale,
    use_ball=use_ball and policy.bound == "box",
  )
  abs_dot = _search.box_abs_dot(q[:, None], box, scale)[:, 0]  # [r]
  norms = None
  if with_values:
    norms = _certify.value_norms(values).reshape(-1, n)
    norms = jnp.pad(norms, ((0, 0), (0, pad)))
  if policy.search == "exact":
    s = jnp.einsum("rd,rnd->rn", q, k) * scale  # [r, n + pad]
    slack = 2 * _certify.logit_rounding(abs_dot, d + 1, dt)
    sel = _select.select_with_slack(
      s, policy, valid=v_ok, norms=norms, log_extra_slack=slack
    )
    keep, cert = sel.keep, sel.certificate
  elif policy.bound == "lowrank":
    rank = min(policy.rank, d)
    if projection is None:
      proj = _lowrank.key_projection(k, v_ok, rank=rank)  # [r, d, rank]
    else:
      proj = projection.astype(dt).reshape(-1, d, projection.shape[-1])
      rank = projection.shape[-1]
    u_key = _lowrank.lowrank_upper_bound(q, k, proj, scale=scale)  # [r, n]
    fn = functools.partial(
      _lowrank.lowrank_search_row,
      eps=policy.eps,
      block_size=bs,
      scale=scale,
      rank=rank,
    )
    s, keep, scored, log_tv, n_sc = jax.vmap(fn)(q, k, v_ok, u_key, abs_dot)
  else:
    rngs = jax.random.split(rng, q.shape[0])
    fn = functools.partial(
      _search.search_row,
      search=policy.search,
      eps=policy.eps,
      block_size=bs,
      scale=scale,
      num_samples=policy.num_samples,
      delta=policy.delta,
    )
    s, keep, scored, log_tv, n_sc = jax.vmap(fn)(
      q, k, v_ok, u, cnt, abs_dot, rngs
    )
  if policy.search != "exact":
    finite = jnp.all(jnp.where(scored, jnp.isfinite(s), True), -1)
    ok = jnp.any(v_ok, -1) & finite & jnp.all(jnp.isfinite(q), -1)
    keep = keep & ok[:, None]
    cert = _certify.finish_certificate(
      log_tv,
      ok,
      k_kept=jnp.sum(keep, -1, dtype=jnp.int32),
      keys_scored=n_sc,
      head_max_norm=None if norms is None else _certify.max_norm(norms, keep),
      tail_max_norm=None
      if norms is None
      else _certify.max_norm(norms, v_ok & ~keep),
      failure_prob=policy.delta if policy.search == "mc" else 0.0,
    )
  keep = keep[:, :n].reshape(*lead, n)
  cert = jax.tree.map(lambda x: x.reshape(lead), cert)
  return _select.Selection(keep=keep, k_kept=cert.k_kept, certificate=cert)


def certified_search(
  query,
  keys,
  *,
  policy: _policies.Certified,
  mask=None,
  values=None,
  scale: float | None = None,
  key=None,
  use_ball: bool = True,
  projection=None,
) -> _select.Selection:
  """Certified selection that scores only the key blocks it needs.

  THEORY 6.2 (Delta-Search), 6.3 (MC-Search), 6.1 ('exact'). Keys are cut
  into contiguous blocks of ``policy.block_size``; each block's logits are
  bounded from its box and ball summaries (THEORY 3.3); blocks are scored in
  decreasing order of their mass bound until the blockwise bound with every
  scored key kept is <= eps; then the fewest scored keys meeting eps are
  kept. ``certificate.keys_scored`` counts the q.k products computed
  (for 'mc' including the sampled keys); summaries are not counted.

  With ``policy.bound='lowrank'`` (search 'delta') the blocks are instead
  bounded per key from a rank-r projection of the keys (``_lowrank``:
  q.k <= q_P.k_P + ||q_perp|| ||k_perp|| plus rounding slack), keys are
  scored in decreasing order of that bound, and ``keys_scored`` also counts
  the projected products as ceil(n_real r / head_dim) key-equivalents.

  Args:
    query: ``[..., head_dim]`` one query per row.
    keys: ``[..., n_keys, head_dim]`` with the same leading axes.
    policy: a ``Certified`` policy ('exact', 'delta' or 'mc').
    mask: optional bool broadcastable to ``[..., n_keys]``, True = real key.
    values: optional ``[..., n_keys, d_v]`` for the output-error bound.
    scale: logit scale, default 1/sqrt(head_dim); > 0.
    key: PRNG key, required for search='mc'.
    use_ball: also use the ball bound (tighter, one more summary).
    projection: optional ``[..., head_dim, r]`` projection P for
      ``bound='lowrank'`` (broadcast over the leading axes; any P gives
      sound bounds, orthonormal columns spanning the keys give tight ones);
      default the top ``policy.rank`` eigenvectors of each row's K^T K.

  Returns:
    A Selection with ``keep`` ``[..., n_keys]`` and a Certificate ``[...]``;
    tv_bound <= eps on every valid row (for 'mc' with probability at least
    ``1 - policy.delta``, recorded in ``failure_prob``).

  Raises:
    TypeError: if ``policy`` is not ``Certified``.
    ValueError: on mismatched shapes, bad scale, or 'mc' without ``key``.
  """
  if not isinstance(policy, _policies.Certified):
    raise TypeError(f"certified_search needs a Certified policy; got {policy=}")
  query, keys = jnp.asarray(query), jnp.asarray(keys)
  if keys.ndim < 2 or query.shape != keys.shape[:-2] + keys.shape[-1:]:
    raise ValueError(
      f"query must be [..., head_dim] and keys [..., n_keys, head_dim] with"
      f" the same leading axes; got {query.shape=}, {keys.shape=}"
    )
  n, d = keys.shape[-2:]
  scale = 1.0 / d**0.5 if scale is None else float(scale)
  if not scale > 0:
    raise ValueError(f"{scale=} must be > 0")
  lead_n = keys.shape[:-1]
  valid = jnp.ones(lead_n, bool)
  if mask is not None:
    try:
      valid = jnp.broadcast_to(jnp.asarray(mask, bool), lead_n)
    except ValueError:
      raise ValueError(
        f"mask shape {jnp.shape(mask)} does not broadcast to {lead_n}"
      ) from None
  if values is not None:
    values = jnp.asarray(values)
    if values.shape[:-1] != lead_n:
      raise ValueError(f"values must be [..., n_keys, d_v]; {values.shape=}")
  if policy.search == "mc" and key is None:
    raise ValueError("search='mc' needs a PRNG key: pass key=")
  if projection is not None:
    if policy.bound != "lowrank":
      raise ValueError(f"projection= needs bound='lowrank'; got {policy=}")
    projection = jnp.asarray(projection)
    if projection.ndim < 2 or projection.shape[-2] != d:
      raise ValueError(
        f"projection must be [..., head_dim={d}, rank]; {projection.shape=}"
      )
    try:
      projection = jnp.broadcast_to(
        projection, keys.shape[:-2] + projection.shape[-2:]
      )
    except ValueError:
      raise ValueError(
        f"projection shape {projection.shape} does not broadcast to the"
        f" leading axes {keys.shape[:-2]}"
      ) from None
  rng = jax.random.key(0) if key is None else key
  return _certified_search(
    query,
    keys,
    valid,
    values,
    rng,
    projection,
    policy=policy,
    scale=scale,
    use_ball=use_ball,
    with_values=values is not None,
  )
