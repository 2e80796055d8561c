"""One decode step over a KVCache: Top-k attention with a Certificate.

THEORY 8.1 (exact Top-k decoding), 6.1-6.3 (certified searches), 3.3 (block
bounds from the cached boxes). One new query per sequence and head attends
to the filled cache positions.

Fixed-count policies (FixedK, Ratio, PowerLaw) take the fast path, built to
stay close to the cost of computing the logits (the floor; DESIGN: a full
sort, or lax.top_k then gather, costs 1.65x the floor on CPU):

1. logits s = scale q.K over the head-major cache;                 [b,h,n]
2. maxima of sub-blocks of 16 positions;                           [b,h,n/16]
3. radix select (32 count passes) of the topk-th largest sub-block max,
   and the indices of the ``topk`` sub-blocks with the largest maxima: they
   hold a valid Top-k set (each has an element >= the threshold);
4. radix select of the exact Top-k among those 16 * topk candidates and
   their indices (``jnp.nonzero`` with a static size);
5. gather of the kept values only (never a pass over all values), softmax
   over the kept logits;
6. the certificate's tail mass in one fused pass (sum of e^s below the
   threshold, plus the tied keys that were not kept).

Certified(search='exact') runs the threshold search over all logits and a
masked softmax over the values; Certified(search='delta'|'mc') scores cache
blocks in the order of their box bounds and stops by the THEORY 6.2 rule
(``keys_scored`` reports the products needed).
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxtopk.attention._cache import KVCache
from jaxtopk.selection import _certify
from jaxtopk.selection import _policies
from jaxtopk.selection import _search
from jaxtopk.selection import _select
from jaxtopk.selection import _threshold
from jaxtopk.selection._certificate import Certificate
from jaxtopk.theory import _tail

SUB_BLOCK = 16  # positions per sub-block in the fast Top-k path

DECODE_IMPLEMENTATIONS: dict[str | None, Callable] = {}


def register_decode_implementation(name: str, fn: Callable) -> None:
  """Plugs a backend into ``decode_attention`` (same signature as
  ``xla_decode_attention``)."""
  DECODE_IMPLEMENTATIONS[name] = fn


def _nonzero_rows(m, size):
  """Indices of the first ``size`` True entries of every row of ``m``."""
  lead = m.shape[:-1]
  flat = m.reshape(-1, m.shape[-1])
  idx = jax.vmap(lambda r: jnp.nonzero(r, size=size, fill_value=0)[0])(flat)
  return idx.reshape(*lead, size).astype(jnp.int32)


def topk_indices(s, topk, valid, max_topk):
  """Indices of a Top-k set of each row without sorting the row.

  Args:
    s: ``[..., n]`` float32/64 logits.
    topk: ``[...]`` int32 kept count per row (<= max_topk, <= real keys).
    valid: ``[..., n]`` bool.
    max_topk: static upper bound on ``topk``.

  Returns:
    ``(idx, kept, thresh)``: ``[..., max_topk]`` int32 positions (entries
    past ``topk`` are padding), ``[..., max_topk]`` bool True for the
    ``topk`` real entries, and ``[...]`` the topk-th largest logit (the
    smallest kept). Ties at the threshold: some tied keys are kept, which
    ones is unspecified (sub-block order).
  """
  n = s.shape[-1]
  c = SUB_BLOCK
  lead = s.shape[:-1]
  if n % c or max_topk * c * 2 > n:
    # Short rows or large kept sets: one radix select over the row.
    keep = _threshold.topk_mask(s, topk, valid)
    idx = _nonzero_rows(keep, max_topk)
  else:
    nb = n // c
    big = jnp.finfo(s.dtype).max
    sb = jnp.where(valid, s, -big).reshape(*lead, nb, c)  # [..., nb, c]
    vbk = valid.reshape(*lead, nb, c)
    bmax = jnp.max(sb, -1)  # [..., nb]
    bvalid = jnp.any(vbk, -1)
    bkeep = _threshold.topk_mask(bmax, topk, bvalid)  # topk sub-blocks
    bidx = _nonzero_rows(bkeep, max_topk)  # [..., K]
    cand = jnp.take_along_axis(sb, bidx[..., None], axis=-2)  # [..., K, c]
    cvalid = jnp.take_along_axis(vbk, bidx[..., None], axis=-2)
    n_blk = jnp.sum(bkeep, -1, dtype=jnp.int32)  # < topk on short rows
    real = jnp.arange(max_topk) < n_blk[..., None]  # [..., K]
    cvalid = (cvalid & real[..., None]).reshape(*lead, max_topk * c)
    cand = cand.reshape(*lead, max_topk * c)
    ckeep = _threshold.topk_mask(cand, topk, cvalid)
    pos = _nonzero_rows(ckeep, max_topk)  # [..., K] in candidates
    blk = jnp.take_along_axis(bidx, pos // c, axis=-1)
    idx = blk * c + pos % c
  kept = jnp.arange(max_topk) < topk[..., None]
  ks = jnp.take_along_axis(s, idx, axis=-1)
  thresh = jnp.min(jnp.where(kept, ks, jnp.inf), -1)
  return idx, kept, thresh


def _logits(query, cache, scale):
  b, _, h, d = query.shape
  hk = cache.keys.shape[1]
  g = h // hk
  dt = _tail.compute_dtype(jnp.result_type(query.dtype, cache.keys.dtype))
  q = query.astype(dt).reshape(b, hk, g, d)  # [b, hk, g, d]
  k = cache.keys.astype(dt)
  s = jnp.einsum("bkgd,bknd->bkgn", q, k) * scale  # [b, hk, g, n]
  return q, s


def _abs_dot(q, cache, scale):
  """``[b, hk, g]`` bound on scale sum_c |q_c k_c| from the cached boxes."""
  return _search.box_abs_dot(q, cache.box(), scale)  # q: [b, hk, g, d]


def _fixed_count(policy, query, cache, scale):
  d = query.shape[3]
  n = cache.max_len
  q, s = _logits(query, cache, scale)
  dt = s.dtype
  valid = jnp.broadcast_to(cache.valid()[:, :, None], s.shape)
  n_valid = jnp.broadcast_to(cache.length[:, None, None], s.shape[:-1])
  topk = _select.count_kept(policy, n_valid, n)
  max_topk = n if isinstance(policy, _policies.Dense) else policy.num_kept(n)
  idx, kept, thresh = topk_indices(s, topk, valid, max_topk)
  ks = jnp.take_along_axis(s, idx, -1)  # [b, hk, g, K]
  vals = jax.vmap(jax.vmap(lambda v, i: v[i]))(cache.values, idx)
  # vals: [b, hk, g, K, dv] (gather of the kept rows only)
  m = jnp.max(jnp.where(kept, ks, -jnp.inf), -1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(kept, jnp.exp(ks - m), 0.0)
  denom = jnp.sum(p, -1, keepdims=True)
  out = jnp.einsum("bkgt,bkgtd->bkgd", p, vals.astype(dt))
  out = out / jnp.where(denom > 0, denom, 1.0)
  # Tail mass of the kept set in one fused pass over the logits: every real
  # key below the threshold, plus the tied keys that were not kept. The row
  # max is the largest kept logit, and Z = Z_kept + Z_tail (no subtraction).
  mx = jnp.where(jnp.isfinite(m), m, 0.0)[..., 0]  # [b, hk, g]
  t = thresh[..., None]
  below = valid & (s < t)
  z_below = jnp.sum(jnp.where(below, jnp.exp(s - mx[..., None]), 0.0), -1)
  n_tie = jnp.sum(valid & (s == t), -1) - jnp.sum(kept & (ks == t), -1)
  z_tail = z_below + n_tie.astype(dt) * jnp.exp(thresh - mx)
  z_all = z_tail + denom[..., 0]
  abs_dot = _abs_dot(q, cache, scale)
  slack = 2 * _certify.logit_rounding(abs_dot, d + 1, dt)
  slack = slack + 8 * jnp.finfo(dt).eps * abs_dot
  log_tv = jnp.log(z_tail) - jnp.log(z_all) + _tail.log_slack(n, dt) + slack
  ok = (n_valid > 0) & jnp.all(jnp.where(valid, jnp.isfinite(s), True), -1)
  vn = _certify.value_norms(vals)  # [b, hk, g, K]
  tail_norm = jnp.max(cache.vnorm, -1)[:, :, None]  # [b, hk, 1]
  cert = _certify.finish_certificate(
    jnp.minimum(log_tv, 0.0),
    ok,
    k_kept=jnp.sum(kept, -1),
    keys_scored=n_valid,
    head_max_norm=_certify.max_norm(vn, kept),
    tail_max_norm=jnp.broadcast_to(tail_norm, ok.shape),
  )
  return out, cert


def _certified_exact(policy, query, cache, scale):
  b, _, h, d = query.shape
  q, s = _logits(query, cache, scale)
  dt = s.dtype
  valid = jnp.broadcast_to(cache.valid()[:, :, None], s.shape)
  abs_dot = _abs_dot(q, cache, scale)
  slack = 2 * _certify.logit_rounding(abs_dot, d + 1, dt)
  vn = _certify.value_norms(cache.values)[:, :, None]  # [b, hk, 1, n]
  sel = _select.select_with_slack(
    s, policy, valid=valid, norms=vn, log_extra_slack=slack
  )
  return _masked_output(s, sel.keep, cache, dt), sel.certificate


def _masked_output(s, keep, cache, dt):
  m = jnp.max(jnp.where(keep, s, -jnp.inf), -1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(keep, jnp.exp(s - m), 0.0)  # [b, hk, g, n]
  denom = jnp.sum(p, -1, keepdims=True)
  out = jnp.einsum("bkgn,bknd->bkgd", p, cache.values.astype(dt))
  return out / jnp.where(denom > 0, denom, 1.0)


def _certified_search(policy, query, cache, scale, rng):
  b, _, h, d = query.shape
  hk = cache.keys.shape[1]
  g = h // hk
  bs = cache.block_size
  policy.require(
    "decode_attention (search='delta'|'mc'; use certified_search for"
    " bound='lowrank')",
    _policies.capabilities(
      "policy=Certified", "search=delta", "search=mc", "bound=box"
    ),
  )
  if policy.block_size != bs:
    raise ValueError(
      f"Certified.block_size={policy.block_size} must equal the cache's"
      f" block_size={bs} for search={policy.search!r}"
    )
  dt = _tail.compute_dtype(jnp.result_type(query.dtype, cache.keys.dtype))
  q = query.astype(dt).reshape(b, hk, g, d)
  box = cache.box()  # [b, hk, nb, d]: einsums broadcast over the groups
  u = _search.box_upper_bound_dot(q, box, scale=scale)  # [b, hk, g, nb]
  cnt = jnp.broadcast_to(box.count[:, :, None], u.shape)
  abs_dot = _search.box_abs_dot(q, box, scale)  # [b, hk, g]
  valid = cache.valid()[:, 0]  # [b, n]
  rngs = jax.random.split(rng, (b, hk, g))
  fn = functools.partial(
    _search.search_row,
    search=policy.search.name,
    eps=policy.eps,
    block_size=bs,
    scale=scale,
    num_samples=policy.num_samples,
    delta=policy.delta,
  )
  over_g = jax.vmap(fn, in_axes=(0, None, None, 0, 0, 0, 0))
  over_hk = jax.vmap(over_g, in_axes=(0, 0, None, 0, 0, 0, 0))
  over_b = jax.vmap(over_hk, in_axes=(0, 0, 0, 0, 0, 0, 0))
  s, keep, scored, log_tv, n_sc = over_b(
    q, cache.keys, valid, u, cnt, abs_dot, rngs
  )
  finite = jnp.all(jnp.where(scored, jnp.isfinite(s), True), -1)
  ok = (cache.length[:, None, None] > 0) & finite
  keep = keep & ok[..., None]
  vn = _certify.value_norms(cache.values)[:, :, None]  # [b, hk, 1, n]
  vfull = jnp.broadcast_to(valid[:, None, None], keep.shape)
  cert = _certify.finish_certificate(
    log_tv,
    ok,
    k_kept=jnp.sum(keep, -1),
    keys_scored=n_sc,
    head_max_norm=_certify.max_norm(vn, keep),
    tail_max_norm=_certify.max_norm(vn, vfull & ~keep),
    failure_prob=policy.failure_prob,
  )
  return _masked_output(s, keep, cache, dt), cert


@functools.partial(jax.jit, static_argnames=("policy", "scale"))
def xla_decode_attention(query, cache, rng, *, policy, scale):
  """The XLA implementation of ``decode_attention`` (see there)."""
  b, _, h, _ = query.shape
  if isinstance(policy, _policies.Certified):
    if policy.search.scores_all:
      out, cert = _certified_exact(policy, query, cache, scale)
    else:
      out, cert = _certified_search(policy, query, cache, scale, rng)
  else:
    out, cert = _fixed_count(policy, query, cache, scale)
  out = out.reshape(b, 1, h, -1).astype(query.dtype)  # [b, 1, h, dv]
  cert = jax.tree.map(lambda x: x.reshape(b, 1, h), cert)
  return out, cert


DECODE_IMPLEMENTATIONS[None] = xla_decode_attention
DECODE_IMPLEMENTATIONS["xla"] = xla_decode_attention


def decode_attention(
  query,
  cache: KVCache,
  *,
  policy: _policies.Policy,
  scale: float | None = None,
  implementation: str | None = None,
  key=None,
) -> tuple[jax.Array, Certificate]:
  """Top-k attention of one new query per sequence over a KVCache.

  THEORY 8.1 and 6.5. Attends to the cache's filled positions (append the
  current step with ``kv_cache_update`` first). Fixed-count policies keep
  the ``topk`` largest logits (Ratio and PowerLaw count the filled
  positions) without sorting and gather only the kept values; Certified
  'exact' keeps the fewest keys meeting eps; 'delta' and 'mc' skip blocks
  using the cache's box summaries (THEORY 6.2/6.3; ``policy.block_size``
  must equal the cache's).

  Args:
    query: ``[batch, 1, num_heads, head_dim]``; num_heads a multiple of the
      cache's kv heads.
    cache: a KVCache.
    policy: a selection policy.
    scale: logit scale, default 1/sqrt(head_dim); > 0.
    implementation: None or 'xla', or a registered backend.
    key: PRNG key for Certified(search='mc').

  Returns:
    ``(output, certificate)``: ``[batch, 1, num_heads, head_dim_v]`` in the
    query's dtype (zeros for an empty cache row) and a Certificate with
    arrays ``[batch, 1, num_heads]`` (valid = False for an empty row).

  Raises:
    ValueError: on bad shapes, heads, scale or block size.
    NotImplementedError: for an unregistered 'pallas' implementation.
  """
  query = jnp.asarray(query)
  if hasattr(cache, "decode_attention"):  # e.g. an IndexedKVCache (_index.py)
    return cache.decode_attention(
      query, policy=policy, scale=scale, implementation=implementation, key=key
    )
  if not isinstance(policy, _policies.Policy):
    raise TypeError(f"{policy=} must be a jaxtopk selection policy")
  b, hk, _, d = cache.keys.shape
  if query.ndim != 4 or query.shape[:2] != (b, 1) or query.shape[3] != d:
    raise ValueError(
      f"query must be [batch={b}, 1, num_heads, head_dim={d}]; got"
      f" {query.shape=}"
    )
  if query.shape[2] % hk:
    raise ValueError(
      f"num_heads={query.shape[2]} must be a multiple of num_kv_heads={hk}"
    )
  scale = 1.0 / d**0.5 if scale is None else float(scale)
  if not scale > 0:
    raise ValueError(f"{scale=} must be > 0")
  if implementation not in DECODE_IMPLEMENTATIONS:
    if implementation == "pallas":
      raise NotImplementedError(
        "implementation='pallas' is not registered yet; use None or 'xla'"
      )
    raise ValueError(
      f"{implementation=} must be one of"
      f" {sorted(map(str, DECODE_IMPLEMENTATIONS))}"
    )
  if (
    isinstance(policy, _policies.Certified)
    and policy.search.needs_rng
    and key is None
  ):
    raise ValueError(
      f"Certified.search={policy.search!r} needs a PRNG key: pass key="
    )
  rng = jax.random.key(0) if key is None else key
  return DECODE_IMPLEMENTATIONS[implementation](
    query, cache, rng, policy=policy, scale=scale
  )
