"""Merging two partial attention results over disjoint key sets.

``topk_attention`` and ``decode_attention`` with ``return_residual=True``
return ``(output, lse, certificate)``: the output over the kept keys, the
log-sum-exp Z_H of their (computed, scaled) logits and the Certificate of
the part. Two parts over DISJOINT key sets of the same rows (a certified
sparse search over a cache and a dense pass over a recent window; two KV
shards) merge into the result over the union, exactly up to rounding:

    lse = log(e^{lse_a} + e^{lse_b}),
    out = e^{lse_a - lse} out_a + e^{lse_b - lse} out_b.

The certificate of the union, from the parts' certificates alone:

- tv_bound. With W_i the exact total mass of part i and tau_i its exact
  dropped fraction, the union drops (tau_a W_a + tau_b W_b) / (W_a + W_b),
  a convex combination of the parts' fractions: at most max(tv_a, tv_b).
  A tighter weighting needs W_a / W_b, which the residuals give only up to
  the logits' rounding (a part's logit error is not returned): weighting
  the bounds by the computed masses could fall below the truth, so the
  merge takes the maximum. An empty part (no real key) weighs nothing.
- output_error_bound. The union's exact output is beta_a Attn_a + beta_b
  Attn_b (beta the exact mass fractions), the merged one alpha_a out_a +
  alpha_b out_b (alpha from the residuals); their distance is at most
  max(err_a, err_b) + |beta_a - alpha_a| ||out_a - out_b||, and
  |beta_a - alpha_a| <= 1: max(err_a, err_b) + ||out_a - out_b||, rounded
  up (tight when the parts agree; the rounding of the outputs themselves is
  not covered, as for every Certificate).
- k_kept and keys_scored add up; failure_prob adds up (a union bound).
- valid: both parts valid, or one valid and the other empty.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jaxtopk.selection import Certificate
from jaxtopk.selection import core

_Result = tuple[jax.Array, jax.Array, Certificate]


def _check(part, name) -> _Result:
  if not (isinstance(part, tuple) and len(part) == 3):
    raise TypeError(
      f"{name} must be an (output, lse, certificate) triple, as returned with"
      f" return_residual=True; got {type(part).__name__}"
    )
  out, lse, cert = part
  if not isinstance(cert, Certificate):
    raise TypeError(f"{name}[2] must be a Certificate; got {type(cert)}")
  out, lse = jnp.asarray(out), jnp.asarray(lse)
  if out.ndim < 1 or lse.shape != out.shape[:-1] or cert.shape != lse.shape:
    raise ValueError(
      f"{name}: output [..., d_v], lse and certificate [...] must agree;"
      f" got output {out.shape}, lse {lse.shape}, certificate {cert.shape}"
    )
  return out, lse, cert


def merge_attention(first, second) -> _Result:
  """Merges two partial attention results over disjoint key sets.

  Each part is ``(output, lse, certificate)`` as ``topk_attention`` or
  ``decode_attention`` return with ``return_residual=True``, over disjoint
  keys of the same query rows (e.g. a certified search over a cache and a
  dense pass over a recent window, or two key shards). The merged output is
  the attention over the union of the kept keys, exact up to rounding; the
  merged certificate is sound for the union (see the module docstring for
  how each field is combined). Associative up to rounding: fold any number
  of parts.

  Args:
    first: ``(output [..., d_v], lse [...], Certificate [...])``.
    second: the same shapes, over keys disjoint from ``first``'s.

  Returns:
    ``(output, lse, certificate)`` of the union: output in ``first``'s
    output dtype (zeros where not valid), lse as the parts' (log 0's finite
    stand-in where both parts are empty, NaN where a part is invalid with
    keys), the Certificate (valid where both parts are valid, or one is
    valid and the other empty).

  Raises:
    TypeError: a part that is not such a triple.
    ValueError: parts whose shapes disagree.

  Example:
    >>> import jax, jax.numpy as jnp, jaxtopk
    >>> q, k, v = (jax.random.normal(jax.random.key(i), (1, 1, 2, 8))
    ...            for i in range(3))
    >>> k = jax.random.normal(jax.random.key(1), (1, 16, 2, 8))
    >>> v = jax.random.normal(jax.random.key(2), (1, 16, 2, 8))
    >>> kw = dict(policy=jaxtopk.Dense(), return_residual=True)
    >>> a = jaxtopk.topk_attention(q, k[:, :10], v[:, :10], **kw)
    >>> b = jaxtopk.topk_attention(q, k[:, 10:], v[:, 10:], **kw)
    >>> out, lse, cert = jaxtopk.merge_attention(a, b)
    >>> whole, _ = jaxtopk.topk_attention(q, k, v, policy=jaxtopk.Dense())
    >>> bool(jnp.allclose(out, whole, atol=1e-5)), cert.k_kept.tolist()
    (True, [[[16, 16]]])
  """
  out_a, lse_a, ca = _check(first, "first")
  out_b, lse_b, cb = _check(second, "second")
  if out_a.shape != out_b.shape:
    raise ValueError(
      f"the parts' outputs must have one shape; got {out_a.shape} and"
      f" {out_b.shape}"
    )
  dt = core.compute_dtype(jnp.result_type(lse_a.dtype, lse_b.dtype))
  lse_a, lse_b = lse_a.astype(dt), lse_b.astype(dt)
  log0 = jnp.finfo(dt).min

  def empty(lse, cert):  # a part with no real key: nothing to merge
    return ~cert.valid & (lse <= log0)

  ea, eb = empty(lse_a, ca), empty(lse_b, cb)
  valid = (ca.valid | ea) & (cb.valid | eb) & (ca.valid | cb.valid)  # [...]
  la = jnp.where(ca.valid, lse_a, -jnp.inf)
  lb = jnp.where(cb.valid, lse_b, -jnp.inf)
  lse = jnp.logaddexp(la, lb)
  ref = jnp.where(jnp.isfinite(lse), lse, 0.0)
  wa = jnp.where(ca.valid, jnp.exp(la - ref), 0.0)
  wb = jnp.where(cb.valid, jnp.exp(lb - ref), 0.0)
  oa, ob = out_a.astype(dt), out_b.astype(dt)
  out = wa[..., None] * oa + wb[..., None] * ob
  out = jnp.where(valid[..., None], out, 0.0).astype(out_a.dtype)
  nan = jnp.asarray(jnp.nan, dt)
  lse = jnp.where(valid, lse, jnp.where(ea & eb, -jnp.inf, nan))

  def worst(x, y):  # the larger bound of the parts that hold keys
    x = jnp.where(ca.valid, x, -jnp.inf)
    y = jnp.where(cb.valid, y, -jnp.inf)
    return jnp.maximum(x, y)

  err = None
  if ca.output_error_bound is not None and cb.output_error_bound is not None:
    both = ca.valid & cb.valid
    gap = jnp.linalg.norm(oa - ob, axis=-1)
    eps = jnp.finfo(dt).eps
    err = worst(ca.output_error_bound, cb.output_error_bound).astype(dt)
    err = jnp.where(both, (err + gap) * (1 + 8 * eps), err)
  cert = Certificate(
    tv_bound=worst(ca.tv_bound, cb.tv_bound),
    log_tv_bound=worst(ca.log_tv_bound, cb.log_tv_bound),
    k_kept=ca.k_kept + cb.k_kept,
    keys_scored=ca.keys_scored + cb.keys_scored,
    output_error_bound=err,
    valid=valid,
    failure_prob=min(1.0, ca.failure_prob + cb.failure_prob),
  )
  cert = core.mark_invalid(dataclasses.replace(cert, valid=valid), ~valid)
  return out, core.finite_log(lse), cert
