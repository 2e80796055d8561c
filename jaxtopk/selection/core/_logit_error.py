"""How far computed logits can be from exact ones, and what that costs a
search and an output (``jaxtopk.selection.core``).
"""

import jax
import jax.numpy as jnp

from jaxtopk.selection.core._numerics import PRECISION
from jaxtopk.selection.core._numerics import _eps
from jaxtopk.selection.core._numerics import _leaf_err
from jaxtopk.selection.core._numerics import _opaque
from jaxtopk.selection.core._numerics import _tiny
from jaxtopk.selection.core._numerics import compute_dtype
from jaxtopk.selection.core._numerics import flushed
from jaxtopk.selection.core._numerics import log_slack
from jaxtopk.selection.core._numerics import norms_up
from jaxtopk.theory import internal as _theory


def abs_dot_box(query, k_absmax) -> jax.Array:
  """sum_c |q_c| a_c rounded up: a bound on sum_c |q_c k_c| for |k_c| <= a_c.

  Args:
    query: ``[..., g, d]`` queries (g sharing the keys, e.g. a GQA group).
    k_absmax: ``[..., nb, d]`` per-dimension max |k_c| over each block's
      keys (nonnegative).

  Returns:
    ``[..., g, nb]`` in the compute dtype. Products of normal numbers that
    flush to 0 lose < tiny each; ``logit_error_bound`` adds those tinies.
  """
  dt = compute_dtype(jnp.result_type(query, k_absmax))
  q = jnp.abs(jnp.asarray(query).astype(dt))
  a = jnp.asarray(k_absmax).astype(dt)
  # An einsum, not a broadcast-multiply-reduce: XLA:CPU runs the latter
  # ~50x slower for decode-sized caches.
  per = jnp.einsum("...gd,...nd->...gn", q, a, precision=PRECISION)
  d = q.shape[-1]
  return per * (1 + (d + 4) * _eps(dt))  # [..., g, nb]


def logit_error_bound(
  *,
  q_norm=None,
  k_norm=None,
  head_dim: int,
  scale,
  abs_dot=None,
  q_flushed=False,
  k_flushed=False,
  bias_abs=None,
  q_absmax=None,
  k_absmax=None,
) -> jax.Array:
  """Bound delta on |computed logit - exact logit| for every key of a row.

  THEORY 3.4. The computed logit is fl(fl(sum_c q~_c k~_c) * scale) (+ bias)
  in the compute dtype, with q~, k~ the inputs as the CPU reads them
  (subnormals as 0); the exact one is scale q.k (+ bias) in real arithmetic.
  With A >= sum_c |q~_c k~_c| (``abs_dot``, or Cauchy-Schwarz
  ||q|| max_i ||k_i||):

    delta = scale ((d + 4) eps A + F) + (2 d + 16) tiny max(1, scale)
            [+ 2 eps (scale A + B) + tiny with a bias, |bias| <= B]

  where (d + 2) eps A is the dot product's rounding, 2 eps A the scale
  multiply and the rounding of ``scale`` itself to the compute dtype,
  F = sqrt(d) tiny (||k|| [q has subnormals] + ||q|| [k has subnormals])
  the terms lost to subnormal inputs read as 0 (q = [1e-38, 1], k = [-3e38,
  5] loses 3.5 from the logit), and the tinies the flushed products and
  partial sums. It is +inf when A, scale A or scale A + B reach a quarter of
  the largest float (a partial sum may then overflow, so a computed -inf
  logit need not be a key of zero mass): the certificate is then trivial
  but sound. Norms come from ``norms_up``, so it neither overflows (q ~
  1e-20 with k ~ 1e20 gives A ~ 1) nor underflows to 0.

  Args:
    q_norm: ``[...]`` ||q|| rounded up (``norms_up``).
    k_norm: ``[...]`` max ||k_i|| over the keys covered, rounded up;
      broadcasts with ``q_norm``. Both may be omitted when ``abs_dot`` is
      given and the inputs hold no subnormals (then F is not covered).
    head_dim: d, the static length of the dot products.
    scale: positive logit scale (Python float or traced array).
    abs_dot: optional ``[...]`` another bound on A, e.g. ``abs_dot_box``
      (the smaller of it and ``q_norm * k_norm`` is used).
    q_flushed: ``[...]`` bool, q has subnormal components (``flushed``).
    k_flushed: ``[...]`` bool, some covered key has subnormal components.
    bias_abs: optional ``[...]`` max |bias| over the row's keys whose bias
      is finite (a -inf bias is a key of zero mass, not an error).
    q_absmax, k_absmax: optional ``[...]`` max_c |q_c| and max_{i,c}
      |k_ic| (of the keys covered). Where a norm is +inf from finite
      components (||q|| past the largest float: q = [3e38, 3e38]), F's term
      sqrt(d) tiny ||x|| is formed as d tiny max_c |x_c| (>= it, finite)
      instead of +inf, so such a row keeps a certificate.

  Returns:
    ``[...]`` delta >= 0 in the compute dtype (+inf when trivial).
  """
  if q_norm is None or k_norm is None:
    if abs_dot is None or q_norm is not k_norm:
      raise ValueError(
        "logit_error_bound needs q_norm and k_norm, or abs_dot alone"
      )
    # Without norms the subnormal-input term F cannot be formed: callers
    # whose inputs may hold subnormals must pass norms and flush flags.
    dt = compute_dtype(jnp.asarray(abs_dot).dtype)
    q_norm = k_norm = jnp.asarray(jnp.inf, dt)
    q_flushed = k_flushed = False
  q_norm, k_norm = jnp.asarray(q_norm), jnp.asarray(k_norm)
  dt = compute_dtype(jnp.result_type(q_norm, k_norm))
  eps, tiny, big = _eps(dt), _tiny(dt), jnp.finfo(dt).max / 4
  q_norm, k_norm = q_norm.astype(dt), k_norm.astype(dt)
  scale = jnp.asarray(scale, dt)
  d = head_dim
  a = q_norm * k_norm * (1 + 2 * eps)  # Cauchy-Schwarz, rounded up
  if abs_dot is not None:
    a = jnp.minimum(a, jnp.asarray(abs_dot, dt))
  # Through a barrier: XLA reassociates constant factors, and scale *
  # sqrt(d) tiny folded at compile time underflows to 0 (scale 1e-20).
  c = _opaque(jnp.sqrt(jnp.asarray(d, dt)) * tiny)

  def lost(norm, absmax):  # sqrt(d) tiny ||x||, the terms a flush drops
    t = norm * c
    if absmax is None:
      return t
    # ||x|| <= sqrt(d) max|x_c|: d tiny max|x_c| >= t, and >= 1 (no
    # underflow) wherever the norm overflowed.
    alt = (jnp.asarray(absmax, dt) * tiny) * float(d)
    return jnp.where(jnp.isinf(norm), alt, t)

  flush = jnp.where(q_flushed, lost(k_norm, k_absmax), 0.0)
  flush = flush + jnp.where(k_flushed, lost(q_norm, q_absmax), 0.0)
  # Plain products are sound here (``mul_up`` is not needed): a product
  # that flushes is below tiny (x the factor left, which is a scale), and
  # the (2 d + 16) tiny max(1, scale) term covers it; one that overflows
  # sets the overflow flag (a trivial certificate).
  sa = scale * a
  delta = sa * ((d + 4) * eps) + scale * flush
  delta = delta + (2 * d + 16) * tiny * jnp.maximum(scale, 1.0)
  overflow = (a >= big) | (sa >= big)
  if bias_abs is not None:
    b = jnp.asarray(bias_abs, dt)
    delta = delta + 2 * eps * (sa + b) + tiny
    overflow = overflow | (sa + b >= big)
  delta = delta * (1 + 8 * eps) + 8 * tiny  # rounding of this formula
  delta = jnp.where(overflow | jnp.isnan(delta), jnp.inf, delta)
  return jax.lax.stop_gradient(delta)


def logit_error_of(q, k, real, *, scale) -> jax.Array:
  """``logit_error_bound`` of rows given their query and keys.

  The norms, the box abs-dot bound and the subnormal flags formed from the
  inputs as given (before any cast), over the real keys only.

  Args:
    q: ``[..., d]`` queries.
    k: ``[..., n, d]`` keys (leading axes broadcast with ``q``'s).
    real: ``[..., n]`` bool, the keys that count.
    scale: positive logit scale.

  Returns:
    ``[...]`` delta (``logit_error_bound``).
  """
  q, k = jnp.asarray(q), jnp.asarray(k)
  real = jnp.asarray(real, bool)
  kn = norms_up(k)  # [..., n]
  k_norm = jnp.max(jnp.where(real, kn, 0.0), -1)
  k_absmax = jnp.max(jnp.where(real[..., None], jnp.abs(k), 0.0), -2)
  abs_dot = abs_dot_box(q[..., None, :], k_absmax[..., None, :])[..., 0, 0]
  return logit_error_bound(
    q_norm=norms_up(q),
    k_norm=k_norm,
    head_dim=q.shape[-1],
    scale=scale,
    abs_dot=abs_dot,
    q_flushed=flushed(q),
    k_flushed=jnp.any(real & flushed(k), -1),
    q_absmax=jnp.max(jnp.abs(q), -1),
    k_absmax=jnp.max(k_absmax, -1),
  )


def logit_output_error(logit_error, head_norm) -> jax.Array:
  """Bound on ||Attn_k - sum_H p~_j v_j|| for logits off by <= delta.

  The computed output weighs the kept values with p~, the softmax of the
  COMPUTED kept logits; Attn_k weighs them with the exact P_hat. Each ratio
  p~_j / P_hat_j lies in [e^{-2 delta}, e^{2 delta}], so TV(P_hat, p~) <=
  1 - e^{-2 delta} and the two outputs differ by at most 2 (1 - e^{-2
  delta}) max_H ||v_j|| (<= 4 delta max_H ||v_j||). Without it a row that
  keeps every key (tv = 0) would claim 0 while a subnormal query component
  read as 0 moves its computed output by O(1). Rounded up;
  0 when delta = 0; +inf for an infinite delta.

  Args:
    logit_error: ``[...]`` delta (``logit_error_bound``).
    head_norm: ``[...]`` max ||v_j|| over the kept keys (a stored norm of
      ``value_norms``, compressed above 2^126).

  Returns:
    ``[...]`` nonnegative bound (NaN where ``head_norm`` is NaN).
  """
  h = jnp.asarray(head_norm)
  dt = h.dtype
  delta = jnp.asarray(logit_error, dt)
  eps = _eps(dt)
  frac = -jnp.expm1(-2 * jnp.maximum(delta, 0.0))  # in [0, 1]
  frac = jnp.minimum(2 * frac * (1 + 4 * eps), 2.0)
  b = _theory.mul_norm_up(frac * (1 + 4 * eps), h)  # h: a stored norm
  return jnp.where(delta > 0, b, jnp.zeros((), dt))


def search_log_margin(n_terms, logit_error, dtype) -> jax.Array:
  """How far below log eps a search aims so the certificate stays <= eps.

  The finished certificate adds ``log_slack``, a rounding of a few tens of
  eps and 2 delta to the search's own log tau; the search's sums round too.
  This margin covers both with room to spare (3 slacks, 4 delta).

  Args:
    n_terms: number of terms of the row (static int or ``[...]``).
    logit_error: ``[...]`` delta or 0.
    dtype: compute dtype.

  Returns:
    ``[...]`` nonnegative log-space margin (+inf for a trivial delta).
  """
  dt = compute_dtype(dtype)
  delta = jnp.asarray(logit_error, dt)
  fixed = 3 * log_slack(n_terms, dt) + 8 * _leaf_err(dt) * _eps(dt)
  return fixed + 4 * delta
