"""Low-rank key bounds for Delta-Search: per-key logit bounds from r dims.

THEORY 3.3 takes any sound upper bound u_b on a block's logits. Here the
bound is per key, from a rank-r matrix P ``[d, r]`` (by default the top-r
eigenvectors of the row's K^T K, i.e. its top right singular vectors):

    q.k = q_P.k_P + q_perp.k_perp <= q_P.k_P + ||q_perp|| ||k_perp||,

with q_P = P^T q, k_P = P^T k and q_perp = q - P q_P (Cauchy-Schwarz on the
residuals). In floats P is only nearly orthonormal and every product is
rounded, so the bound is written for the COMPUTED coordinates a_q, a_k and
any P: with the exact residuals q_perp = q - P a_q, k_perp = k - P a_k,
E = P^T P - I, d_q = P^T q - a_q and d_k = P^T k - a_k, exactly

    q.k = a_q.a_k - a_q^T E a_k + a_q.d_k + d_q.a_k + q_perp.k_perp,

and every term but the first is bounded by a multiple of ||q|| ||k|| (and
the residual norms): the bound is

    u = scale (a_q.a_k + rho_q rho_k + gamma ||q|| ||k||),

with rho the computed residual norms rounded up and gamma collecting
||E|| and the (d + r + 2) eps dot-product roundings (``_gamma``). It holds for
ANY P (a poor or even zero P only loosens it), so P may come from the caller.

Delta-Search then sorts the keys of the row by u, cuts the sorted order into
blocks of ``block_size`` and gives each block the mass bound sum_i e^{u_i}
(a log-sum-exp rounded up), so it scores keys in decreasing order of their
bound, the order of the numpy simulation in ``experiments/bench_selection``.

Cost, counted honestly (THEORY 6.4: the share of a key's bytes read): each
query reads per key its r projected coordinates, its residual norm and its
norm, so ``keys_scored`` adds ceil(n_real (r + 2) / d) key-equivalents to
the q.k products of the scored blocks. Making the summary (P, a_k = P^T k,
the residual norms, the sort) is key-side work done once per key and
shared by every query that reads those keys (a GQA group, all decode
steps, all queries of a prefill); it is not counted.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.scipy.special import logsumexp

from jaxtopk.selection import _search
from jaxtopk.selection import _strategies
from jaxtopk.selection import core

_P = core.PRECISION


def _norm_up(x, axis=-1):
  """||x||_2 over ``axis``, rounded up (``core.norms_up``: no underflow)."""
  return core.norms_up(x, axis)


def _eps(x):
  return jnp.finfo(x.dtype).eps


@functools.partial(jax.jit, static_argnames="rank")
def key_projection(keys, valid, *, rank) -> jax.Array:
  """Top-``rank`` eigenvectors of sum_i k_i k_i^T over the real keys.

  Args:
    keys: ``[..., n, d]`` keys (computed in float32, or float64).
    valid: ``[..., n]`` bool, True = real key.
    rank: static number of directions, 1 <= rank <= d.

  Returns:
    ``[..., d, rank]`` float32 (float64) P with (nearly) orthonormal
    columns, largest
    eigenvalue last; zeros where the eigensolver returned non-finite values
    (every P keeps ``lowrank_upper_bound`` sound).
  """
  keys = keys.astype(core.compute_dtype(keys.dtype))
  k = jnp.where(valid[..., None], keys, 0.0)
  # Normalise first so that K^T K cannot overflow for huge keys.
  big = jnp.max(jnp.abs(k), axis=(-2, -1), keepdims=True)
  k = k / jnp.where(big > 0, big, 1.0)
  # RANK ONLY: any P keeps ``lowrank_upper_bound`` sound (its slack is
  # computed from the P it is given), so P may come from a fast product
  # (TF32 / bf16 passes); the scope name lets the precision test tell.
  with jax.named_scope("rank_only"):
    gram = jnp.einsum("...nd,...ne->...de", k, k)  # [..., d, d]
    _, vecs = jnp.linalg.eigh(gram)  # ascending eigenvalues
  p = vecs[..., -rank:]  # [..., d, rank]
  return jnp.where(jnp.isfinite(p), p, 0.0)


def _gamma(proj):
  """Relative slack gamma of the module docstring for P ``[..., d, r]``."""
  d, r = proj.shape[-2:]
  eps = _eps(proj)
  pf = _norm_up(proj.reshape(*proj.shape[:-2], d * r))  # >= ||P||_F
  e_mat = jnp.einsum("...dj,...dk->...jk", proj, proj, precision=_P)
  e_mat = e_mat - jnp.eye(r)
  # ||E||_2 <= ||E||_F; each entry of the computed P^T P is off by at most
  # (d + 2) eps ||P_j|| ||P_k||, so the Frobenius norm by (d + 2) eps pf^2.
  e = _norm_up(e_mat.reshape(*e_mat.shape[:-2], r * r))
  e = e + (d + 2) * eps * pf * pf
  p = 1 + e  # >= ||P||_2 (||P||_2^2 = ||I + E||_2)
  a = p + (d + 2) * eps * pf  # ||a_k|| <= a ||k||
  eta = (r + 2) * eps * (1 + pf * a)  # ||k_perp - computed|| <= eta ||k||
  b = (1 + p * a + eta) * (1 + (d + 4) * eps)  # rho_k <= b ||k||
  g = e * a * a  # a_q^T E a_k
  g = g + 2 * a * pf * (d + 2) * eps  # a_q.d_k + d_q.a_k
  g = g + eta * (2 * b + eta)  # residual norms computed from rounded vectors
  g = g + (r + 2) * eps * a * a  # rounding of a_q.a_k
  g = g + 8 * eps * (a * a + b * b + 1)  # the final sum of three terms
  return 2 * g  # and a factor 2 for the roundings of gamma itself


@functools.partial(jax.jit, static_argnames="scale")
def lowrank_upper_bound(query, keys, proj, *, scale) -> jax.Array:
  """Sound per-key upper bounds on scale * q.k from a rank-r projection.

  THEORY 3.3 (a per-key u_i >= s_i without the full q.k); derivation in the
  module docstring. Sound for any ``proj``, including float rounding: never
  below the exact logit of the (float) inputs.

  Args:
    query: ``[..., d]`` queries.
    keys: ``[..., n, d]`` keys with the same leading axes.
    proj: ``[..., d, r]`` projection (e.g. ``key_projection``).
    scale: positive logit scale.

  Returns:
    ``[..., n]`` float32 upper bounds (float64 for float64 inputs).
  """
  dt = core.compute_dtype(jnp.result_type(query, keys, proj))
  query, keys, proj = query.astype(dt), keys.astype(dt), proj.astype(dt)
  eps = _eps(keys)
  # Every product at full precision: the slack gamma assumes (d + 2) eps
  # dot-product roundings, which TF32 / bf16 passes exceed.
  a_q = jnp.einsum("...d,...dr->...r", query, proj, precision=_P)  # [..., r]
  a_k = jnp.einsum("...nd,...dr->...nr", keys, proj, precision=_P)
  rq = query - jnp.einsum("...dr,...r->...d", proj, a_q, precision=_P)
  rk = keys - jnp.einsum("...dr,...nr->...nd", proj, a_k, precision=_P)
  rho_q, rho_k = _norm_up(rq), _norm_up(rk)  # [...], [..., n]
  nq, nk = _norm_up(query), _norm_up(keys)  # [...], [..., n]
  g = _gamma(proj)  # [...]
  dot = jnp.einsum("...r,...nr->...n", a_q, a_k, precision=_P)  # [..., n]
  x = dot + rho_q[..., None] * rho_k + (g * nq)[..., None] * nk
  # CPUs flush subnormal inputs and results to 0: each flushed term moves
  # the result by less than tiny times the norms it multiplies, which the
  # relative slack above cannot see (keys ~ 1e-44 gave u = 0 < s).
  d, r = proj.shape[-2], proj.shape[-1]
  pn = jnp.sqrt(jnp.sum(proj * proj, axis=(-2, -1)))  # [...]
  grow = (1 + nq) * (1 + pn) ** 2  # [...]
  flush = 4 * (d + r + 4) * jnp.finfo(dt).tiny * grow[..., None] * (1 + nk)
  u = scale * (x + flush)
  return u + jnp.abs(u) * 4 * eps


def lowrank_search_row(
  q,
  keys,
  valid,
  u_key,
  logit_error,
  *,
  eps,
  block_size,
  scale,
  rank,
  max_topk=None,
  value_norms=None,
):
  """Delta-Search for ONE row over keys sorted by their low-rank bound.

  Args:
    q: ``[d]`` query (compute dtype).
    keys: ``[n, d]`` keys (n a multiple of block_size).
    valid: ``[n]`` bool.
    u_key: ``[n]`` per-key bounds on the EXACT logits (from
      ``lowrank_upper_bound``).
    logit_error: scalar delta of the scored logits.
    eps: TV budget.
    block_size: static block size (keys per block of the sorted order).
    scale: logit scale.
    rank: static rank r of the projection (for the counted cost).
    max_topk: optional cap on the kept set.
    value_norms: optional ``[n]`` value norms.

  Returns:
    As ``_search.search_row_partial``, in the original key order; the
    PartialSoftmax's ``keys_scored`` includes ceil(n_real (r + 2) / d) for the
    projected dot products and the per-key norms they read.
  """
  n, d = keys.shape
  nb = n // block_size
  u_key = jnp.where(valid, u_key, -jnp.inf)
  order = jnp.argsort(-u_key)  # [n] keys, largest bound first
  ks, vs, us = keys[order], valid[order], u_key[order]
  ub = us.reshape(nb, block_size)  # [nb, bs]
  vb = vs.reshape(nb, block_size)
  cnt = jnp.sum(vb, -1, dtype=jnp.int32)  # [nb]
  # Per-key level u_eff with cnt e^{u_eff} >= sum_i e^{u_i}: a log-sum-exp
  # is off by at most ~eps (|max| + block_size) (terms e^{u_i - max} <= 1);
  # round up by 8x that.
  top = jnp.max(jnp.where(vb, ub, -jnp.inf), -1)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  lse = logsumexp(ub, axis=-1, where=vb)
  log_cnt = jnp.log(jnp.maximum(cnt, 1).astype(ub.dtype))
  slack = 8 * _eps(ub) * (jnp.abs(top) + jnp.abs(lse) + block_size + 4)
  u_eff = jnp.where(cnt > 0, lse - log_cnt + slack, -jnp.inf)
  vn = None if value_norms is None else value_norms[order]
  strategy = _strategies.DeltaSearch(block_size=block_size)
  s, keep, scored, part = _search.search_row_partial(
    q,
    ks,
    vs,
    u_eff,
    cnt,
    logit_error,
    None,
    search=strategy,
    eps=eps,
    scale=scale,
    max_topk=max_topk,
    value_norms=vn,
  )
  back = lambda x: jnp.zeros_like(x).at[order].set(x)  # noqa: E731
  n_real = jnp.sum(valid, dtype=jnp.int32)
  proj_cost = (n_real * (rank + 2) + d - 1) // d  # ceil(n_real (r+2) / d)
  part = dataclasses.replace(part, keys_scored=part.keys_scored + proj_cost)
  return back(s), back(keep), back(scored), part
