"""``certified_search``: certified selection from queries and keys.

THEORY 6.1-6.3. Unlike ``select`` (which is handed every logit), this entry
point sees the queries and keys, so Delta- and MC-Search can bound blocks of
keys from cheap summaries (box and ball, THEORY 3.3) and score only the
blocks they need. ``Exact`` scores every key and runs the threshold search.
The certificate (``core``) accounts for the float rounding of the logits it
computed, subnormal inputs included.
"""

import functools

import jax
import jax.numpy as jnp

from jaxtopk.selection import _lowrank
from jaxtopk.selection import _policies
from jaxtopk.selection import _search
from jaxtopk.selection import _select
from jaxtopk.selection import _strategies
from jaxtopk.selection import core

# certified_search honours every policy field.
SUPPORTS = _policies.capabilities(
  "policy=Certified",
  "search=exact",
  "search=delta",
  "search=mc",
  "bound=box",
  "bound=lowrank",
  "max_topk",
)


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
  search = policy.search
  # The flush checks read the inputs' own bits (bfloat16 subnormals are
  # read as 0 once converted), so they run before the cast.
  q_in = query.reshape(-1, d)
  k_in = keys.reshape(-1, n, d)
  dt = core.compute_dtype(jnp.result_type(query.dtype, keys.dtype))
  q = q_in.astype(dt)  # [r, d]
  k = k_in.astype(dt)  # [r, n, d]
  v_ok = valid.reshape(-1, n)
  delta = core.logit_error_of(q_in, k_in, v_ok, scale=scale)  # [r]
  norms = None
  if with_values:
    norms = core.value_norms(values).reshape(-1, n)
  if search.scores_all:
    s = jnp.einsum("rd,rnd->rn", q, k, precision=core.PRECISION)
    s = s * scale  # [r, n]
    sel = _select.select_rows(
      s, policy, valid=v_ok, norms=norms, logit_error=delta
    )
    keep, cert = sel.keep, sel.certificate
  else:
    bs = search.block_size
    pad = -n % bs
    k = jnp.pad(k, ((0, 0), (0, pad), (0, 0)))
    v_ok = jnp.pad(v_ok, ((0, 0), (0, pad)))
    if norms is not None:
      norms = jnp.pad(norms, ((0, 0), (0, pad)))
    vn_rows = norms if norms is not None else jnp.zeros(v_ok.shape, dt)
    if isinstance(policy.bound, _strategies.LowRank):
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
        max_topk=policy.max_topk,
      )
      u_key = u_key + delta[:, None]  # also bounds flushed-input logits
      s, keep, _, part = jax.vmap(
        lambda *a: fn(*a[:-1], value_norms=a[-1] if with_values else None)
      )(q, k, v_ok, u_key, delta, vn_rows)
    else:
      u, cnt, _ = _search.block_bounds(
        q,
        k,
        v_ok,
        block_size=bs,
        scale=scale,
        use_ball=use_ball,
      )
      # Box and ball bounds are computed from the inputs as read (subnormals
      # as 0): the logit error bound covers what that drops.
      u = u + delta[:, None]
      rngs = jax.random.split(rng, q.shape[0])
      fn = functools.partial(
        _search.search_row_partial,
        search=search,
        eps=policy.eps,
        scale=scale,
        max_topk=policy.max_topk,
        block_summary_keys=3 if use_ball else 2,  # box (+ ball) per block
      )
      s, keep, _, part = jax.vmap(
        lambda *a: fn(*a[:-1], value_norms=a[-1] if with_values else None)
      )(q, k, v_ok, u, cnt, delta, rngs, vn_rows)
    _, cert = part.finalize(
      n_terms=k.shape[1] + k.shape[1] // bs,
      failure_prob=search.failure_prob,
    )
    keep = keep & cert.valid[:, None]
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
  rng=None,
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
  (for 'mc' including the sampled keys) and the block summaries read, in
  key-equivalents (THEORY 6.4: a box is 2 keys' bytes, a ball 1 more).

  With ``policy.bound='lowrank'`` (search 'delta') the blocks are instead
  bounded per key from a rank-r projection of the keys (``_lowrank``:
  q.k <= q_P.k_P + ||q_perp|| ||k_perp|| plus rounding slack), keys are
  scored in decreasing order of that bound, and ``keys_scored`` also counts
  the projected products and the per-key norms they read as
  ceil(n_real (r + 2) / head_dim) key-equivalents.

  Every field of the policy is honoured: the search strategy and its fields,
  ``bound``, and ``max_topk`` (a row whose certified set is larger keeps the
  ``max_topk`` largest scored logits and reports its true, larger bound).
  The certificate covers the rounding of the logits computed here,
  subnormal inputs included (``core.logit_error_bound``); block bounds are
  widened by the same amount, so they bound the exact logits.

  Args:
    query: ``[..., head_dim]`` one query per row.
    keys: ``[..., n_keys, head_dim]`` with the same leading axes.
    policy: a ``Certified`` policy ('exact', 'delta' or 'mc').
    mask: optional bool broadcastable to ``[..., n_keys]``, True = real key.
    values: optional ``[..., n_keys, d_v]`` for the output-error bound.
    scale: logit scale, default 1/sqrt(head_dim); > 0.
    rng: PRNG key, required for search='mc' (``key=`` is its deprecated
      name: warns).
    use_ball: also use the ball bound (tighter, one more summary).
    projection: optional ``[..., head_dim, r]`` projection P for
      ``bound='lowrank'`` (broadcast over the leading axes; any P gives
      sound bounds, orthonormal columns spanning the keys give tight ones);
      default the top ``policy.rank`` eigenvectors of each row's K^T K.

  Returns:
    A Selection with ``keep`` ``[..., n_keys]`` and a Certificate ``[...]``;
    tv_bound <= eps on every valid row unless ``max_topk`` caps it or the
    logit rounding is unbounded (for 'mc' with probability at least
    ``1 - policy.failure_prob``, recorded in the certificate's
    ``failure_prob``). With no keys (n_keys = 0) every row is invalid.

  Raises:
    TypeError: if ``policy`` is not ``Certified``, or an input is not real
      floating, a mask not boolean, a scale not a number.
    ValueError: on mismatched shapes, a scale not finite or below
      ``core.MIN_SCALE`` (float32's smallest normal), or 'mc' without
      ``key``.
  """
  if not isinstance(policy, _policies.Certified):
    raise TypeError(f"certified_search needs a Certified policy; got {policy=}")
  policy.require("certified_search", SUPPORTS)
  query = _select.check_logits(query, "query")
  keys = _select.check_logits(keys, "keys")
  if keys.ndim < 2 or query.shape != keys.shape[:-2] + keys.shape[-1:]:
    raise ValueError(
      f"query must be [..., head_dim] and keys [..., n_keys, head_dim] with"
      f" the same leading axes; got {query.shape=}, {keys.shape=}"
    )
  n, d = keys.shape[-2:]
  if d == 0:
    raise ValueError(f"head_dim must be >= 1; got {keys.shape=}")
  if scale is None:
    scale = 1.0 / d**0.5
  else:
    # Below float32's smallest normal a CPU reads the scale as 0.
    scale = _strategies.as_float(
      "scale", scale, low=core.MIN_SCALE, low_open=False
    )
  lead_n = keys.shape[:-1]
  valid = jnp.ones(lead_n, bool)
  if mask is not None:
    valid = _select.check_mask(mask, lead_n)
  if values is not None:
    values = _select.check_logits(values, "values")
    if values.shape[:-1] != lead_n:
      raise ValueError(f"values must be [..., n_keys, d_v]; {values.shape=}")
  rng = _select.rng_argument(rng, key, "certified_search")
  if policy.search.needs_rng and rng is None:
    raise ValueError(
      f"Certified.search={policy.search!r} needs a PRNG key: pass rng="
    )
  lowrank = isinstance(policy.bound, _strategies.LowRank)
  if projection is not None:
    if not lowrank:
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
  if n == 0:
    return _select._empty(jnp.zeros(lead_n, keys.dtype), values)
  rng = jax.random.key(0) if rng is None else rng
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
