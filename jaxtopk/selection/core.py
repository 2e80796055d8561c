"""The certificate core: the one place where certificate math is computed.

A documented internal API for every layer above ``jaxtopk.selection``
(attention, kernels, parallel, nn, models): ``from jaxtopk.selection import
core``. Each formula lives here once; a path that needs a rounding bound, a
norm, a tail mass, a Certificate or a merge of partial softmax statistics
calls it instead of writing its own.

Contract (every function):

- Math in ``compute_dtype`` (float32; float64 for float64 input under x64);
  jit-, vmap- and grad-safe (bounds are computed on stop-gradient values by
  the callers); shape-polymorphic over leading axes ``[...]``.
- SOUND: a bound is never below the value it bounds computed in exact
  (float64 / 80-bit) arithmetic from the float inputs, for every input from
  subnormal to near overflow. XLA on CPU reads subnormal inputs as 0 and
  flushes subnormal results to 0; every bound here accounts for both: a
  positive bound never reads 0 (it is raised to the smallest normal), a
  product of bounds never overflows to a wrong finite value nor loses a
  large value to a flushed intermediate (a product whose partial product
  may be subnormal while the next factor is large, like the ball term scale
  ||q|| r, is formed by ``mul_up``; elsewhere a flushed product is below
  tiny times a scale, which the bounds' tiny terms cover), and norms scale
  by exact powers of two (never by a reciprocal that could be subnormal).
  Every product of the inputs a certificate rests on runs at
  ``PRECISION`` (full float32 passes), on CPU, GPU and TPU alike.
- An honest bound that overflows is +inf. A +inf logit error makes the
  certificate TRIVIAL (tv_bound = 1, output_error_bound = +inf), which is
  sound; it is still ``valid``.

Row validity (``row_valid``), the rule every path uses:

- A key is REAL when its mask is True (padding and causal masks False).
- A real key whose logit is -inf (e.g. ``bias=-inf``) has zero mass: it is
  neither kept nor dropped, as in ``jax.nn.dot_product_attention``.
- A row is valid iff it keeps at least one real key of positive mass
  (finite logit), none of its real keys has a NaN or +inf logit, the values
  of its real keys are finite (when values enter), the computed output is
  finite, and the logit scale is finite and >= ``MIN_SCALE``. On an invalid
  row the certificate's float fields are NaN, ``k_kept`` is 0, and the
  output is undefined (paths return zeros).

Names (one line each):

- ``compute_dtype(dtype)``: float32, or float64 for float64.
- ``log_slack(n_terms, dtype)``: log-space round-up for a reduction of n
  nonnegative terms (THEORY 3.4; the one definition lives in theory).
- ``exp_up(log_b)``: exp of a log bound, never below it (>= tiny if > -inf).
- ``up_positive(x, positive)``: ``x`` raised to the smallest normal where
  its exact value is positive.
- ``round_up(x)`` / ``round_down(x)``: past the rounding of the one float
  operation that made ``x`` (2 eps relative plus the smallest normal, for
  a flushed result); the rule every per-key bound applies per operation.
- ``pow2(e, dtype)``: 2**e exactly (no exp2 rounding, no reciprocal).
- ``max_nan(x, axis)``: a max reduction that keeps NaN (XLA:CPU's does
  not): every summary that must carry a broken input uses it.
- ``flushed(x, axis)``: whether a vector holds subnormal components that a
  CPU reads as 0.
- ``norms_up(x, axis)``: ||x||_2 rounded up, no underflow, no spurious
  overflow.
- ``value_norms(v)``: ``norms_up`` over the last axis with NaN marking a
  non-finite value (that row is invalid); stored compressed above 2^126,
  so never +inf for a finite value (``mul_norm_up(t, y)``: t times a
  stored norm, rounded up).
- ``max_norm(norms, where)``: the largest norm over a set (0 if empty).
- ``abs_dot_box(q, k_absmax)``: sum_c |q_c| max_i |k_ic| rounded up (the
  box form of the dot-product magnitude).
- ``logit_error_bound(...)``: |computed scale q.k (+ bias) - exact| for
  every key of a row.
- ``Partial``: partial softmax statistics (normalised output, head and tail
  masses, counts, norms); ``merge``, ``Partial.reduce``, ``finalize``;
  ``Partial.from_stats`` for masses summed elsewhere (a kernel).
- ``online_step(...)``: one block of a flash loop, elementwise (the form of
  ``merge`` a Pallas kernel body runs).
- ``tail_log_bound(...)``: log tau from head and tail log masses, rounded up.
- ``output_error_bound(tv, head_norm, tail_norm)``: THEORY 4.2 + 4.4.
- ``logit_output_error(logit_error, head_norm)``: how far logits off by
  delta move the computed output from Attn_k (added by
  ``finish_certificate``).
- ``logit_error_of(q, k, real, *, scale)``: that bound from the inputs.
- ``finite_log(log_x)``: -inf (the log of 0) as the most negative finite
  float, for logs that leave the library (no inf under jax.debug_infs).
- ``finish_certificate(...)``: log tv + validity + counts -> Certificate.
- ``certificate_from_logits(...)``: the Certificate of a kept set when every
  logit of the row is known.
- ``search_log_margin(...)``: how far below log eps a search must aim so
  that the finished certificate is <= eps.
- ``row_valid(...)``, ``logits_ok(...)``: the validity rule above;
  ``scale_ok(scale)``: its scale condition; ``mark_invalid(cert, bad)``: a
  finished Certificate's rows made invalid by it.
- ``PRECISION``: the matmul precision of every product a certificate is
  computed from (full float32 passes on GPU and TPU).
- ``MIN_SCALE``: the smallest logit scale covered (float32's smallest
  normal).
- ``mul_up(*factors)``: a product of nonnegative factors rounded up, no
  intermediate flush or overflow (for products whose partial product may
  flush while the next factor is large); ``dist_up(x, c)``: ||x - c||
  rounded up (ball radii). Both, with ``flushed``, ``norms_up`` and
  ``mul_norm_up``, are defined in ``jaxtopk.theory`` (its ``_floats``),
  below both layers.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxtopk.selection._certificate import Certificate
from jaxtopk.theory import internal as _theory

compute_dtype = _theory.compute_dtype
log_slack = _theory.log_slack
exp_up = _theory.exp_up
up_positive = _theory.up_positive
flushed = _theory.flushed
norms_up = _theory.norms_up
mul_up = _theory.mul_up
mul_norm_up = _theory.mul_norm_up
dist_up = _theory.dist_up
pow2 = _theory.pow2
max_nan = _theory.max_nan

# THE matmul precision of every product a certificate is computed from (q.k
# logits, q.c of group centres, box and ball bounds, MC samples): full
# float32 passes. At DEFAULT a GPU multiplies in TF32 and a TPU in bfloat16
# passes (a logit error of 0.023 measured on an H100 for q, k ~ 4 N(0, 1),
# d = 128, 5.8x ``logit_error_of``), which ``logit_error_bound`` does not
# cover. Products that only RANK (the k-means assignment of the index build)
# may use any precision; each such use says so where it is.
PRECISION = jax.lax.Precision.HIGHEST

# The smallest logit scale the certificates cover: float32's smallest
# normal. A CPU reads a subnormal scale (e.g. 1.1e-38) as 0, so every logit
# reads 0 while the exact ones are not (scale q.k of order one for q, k ~
# 1e19). A static scale below it is refused by name; a traced one makes its
# rows invalid (``scale_ok``).
MIN_SCALE = float(jnp.finfo(jnp.float32).tiny)

# Rounding of one leaf sum term e^{s_i - m}, in units of eps: the subtraction
# is off by eps/2 |s_i - m| and terms with s_i - m below log(tiny) are 0 (or
# subnormal, < tiny), so |s_i - m| <= -log(tiny) ~ 88 (float32) matters;
# plus 2 ulps for exp. ``_leaf_err`` adds that margin per dtype.
_EXP_ULPS = 4.0


def _eps(dtype):
  return jnp.finfo(dtype).eps


def _tiny(dtype):
  return jnp.finfo(dtype).tiny


def _leaf_err(dtype) -> float:
  """eps-units rounding of a log-sum-exp leaf (see ``_EXP_ULPS``)."""
  return 0.5 * _log_tiny_inv(dtype) + _EXP_ULPS + 4.0


def _log_tiny_inv(dtype) -> float:
  """-log(smallest normal) of ``dtype`` (87.3 for float32), a Python float."""
  return -math.log(float(jnp.finfo(dtype).tiny))


def _opaque(x):
  """``x`` hidden from XLA's algebraic simplifier.

  XLA reassociates products with constant factors ((c1 * x) * c2 -> x *
  (c1 c2)) and folds c1 c2 at compile time; with c2 ~ tiny that product
  underflows to 0 and a positive bound reads 0. A barrier keeps the order.
  """
  return jax.lax.optimization_barrier(x)


def round_up(x) -> jax.Array:
  """``x`` raised past the rounding of the one float operation that made it.

  One rounded operation (a sum, a product, a division by a power of two) is
  off by at most eps/2 of its result, plus less than the smallest normal
  when the result is subnormal or flushed to 0 (CPUs flush): x + 2 eps |x|
  + tiny covers both, with room for the rounding of this formula. -inf
  stays -inf (no mass); +inf and NaN stay.
  """
  x = jnp.asarray(x)
  up = x + jnp.abs(x) * (2 * _eps(x.dtype)) + _tiny(x.dtype)
  return jnp.where(x == -jnp.inf, x, up)


def round_down(x) -> jax.Array:
  """``-round_up(-x)``: below the exact value of the operation that made
  ``x``; +inf stays +inf."""
  return -round_up(-jnp.asarray(x))


def value_norms(values) -> jax.Array:
  """``[..., n]`` ||v_j||_2 of ``[..., n, d_v]`` values, rounded up.

  ``norms_up`` over the last axis, except that a value with a non-finite
  component gets NaN: a NaN norm marks the value as broken and makes every
  row that holds it as a real key invalid (``row_valid``). Norms above
  2^126 (8.5e37) are stored COMPRESSED (``jaxtopk.theory``'s ``_floats``:
  monotone, so ``max_norm`` and masks work unchanged; ``output_error_bound``
  and ``logit_output_error`` read them): a finite value near the largest
  float ([3e38, 3e38], norm 4.2e38) has a finite stored norm, and the
  output error of a row that drops little of it stays finite (it was +inf
  whatever tv was).
  """
  nrm, finite = _theory.norms_and_finite(values, -1, compress=True)
  return jnp.where(finite, nrm, jnp.nan)


def max_norm(norms, where) -> jax.Array:
  """``[...]`` max of ``norms`` ``[..., n]`` over ``where``; 0 if empty.

  NaN propagates (a broken value among ``where``; ``max_nan``).
  """
  return max_nan(jnp.where(where, norms, 0.0), axis=-1, initial=0.0)


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


def tail_log_bound(log_head, log_tail, *, err, n_terms, logit_error, ok):
  """log of an upper bound on tau = Z_T / (Z_H + Z_T), rounded up.

  THEORY 2.4/2.5 and 3.4: ``_theory.finish_log_bound`` (the one rounded-up
  U / (Z_H + U) formula) plus 2 delta for logits off by at most delta (tail
  up by e^delta, head down by e^-delta). A +inf (or NaN) delta gives the
  trivial bound 0 (tau <= 1) even where nothing was dropped, because a key
  read as -inf may then hold mass.

  Args:
    log_head: ``[...]`` log Z_H relative to any reference (same for both).
    log_tail: ``[...]`` log of an upper bound on Z_T, same reference; -inf
      when nothing real was dropped.
    err: ``[...]`` rounding coefficient of the two logs, in units of eps.
    n_terms: number of terms reduced (static int or ``[...]``).
    logit_error: ``[...]`` delta (``logit_error_bound``) or 0.
    ok: ``[...]`` bool row validity.

  Returns:
    ``[...]`` log tv bound in [-inf, 0]; NaN where not ``ok``.
  """
  log_head = jnp.asarray(log_head)
  dt = log_head.dtype
  delta = jnp.asarray(logit_error, dt)
  b = _theory.finish_log_bound(log_tail, log_head, err, n_terms, ok)
  b = jnp.minimum(b + 2 * delta, 0.0)
  trivial = ~(delta < jnp.inf)  # +inf or NaN
  return jnp.where(ok, jnp.where(trivial, 0.0, b), jnp.nan)


def output_error_bound(tv_bound, head_norm, tail_norm) -> jax.Array:
  """THEORY 4.2 + 4.4: ||Attn - Attn_k||_2 <= tv (||mu_H|| + max_T ||v_j||).

  ||mu_H|| (the exact kept-set output, a convex combination of kept values)
  is bounded by the largest kept value norm, so the bound does not depend on
  the rounding of the computed output. Written as tv h + tv t (each rounded
  up), so it overflows only when the bound itself exceeds the largest float
  (then +inf, sound) and a positive product that underflows is raised to
  the smallest normal. tv = 0 gives 0 (nothing dropped), whatever the norms.

  Args:
    tv_bound: ``[...]`` tv bound in [0, 1].
    head_norm: ``[...]`` max ||v_j|| over kept keys (``max_norm`` of
      ``value_norms``: compressed above 2^126).
    tail_norm: ``[...]`` max ||v_j|| over dropped real keys (likewise).

  Returns:
    ``[...]`` bound, NaN where an input is NaN.
  """
  tv = jnp.asarray(tv_bound)
  dt = tv.dtype
  h = jnp.asarray(head_norm, dt)
  t = jnp.asarray(tail_norm, dt)
  eps = _eps(dt)
  # ``mul_norm_up`` reads the stored (compressed) norms; subnormal inputs
  # count as the smallest normal, a positive product is never 0.
  th = _theory.mul_norm_up(tv, h)
  tt = _theory.mul_norm_up(tv, t)
  b = (th + tt) * (1 + 8 * eps)
  b = up_positive(b, (th > 0) | (tt > 0))
  bad = jnp.isnan(tv) | jnp.isnan(h) | jnp.isnan(t)
  return jnp.where(bad, jnp.nan, jnp.where(tv == 0, 0.0, b))


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


def logits_ok(logits, real) -> jax.Array:
  """``[...]`` True where no real logit of the row is NaN or +inf.

  (-inf is allowed: a key of zero mass.)
  """
  s = jnp.asarray(logits)
  bad = jnp.isnan(s) | (s == jnp.inf)
  return ~jnp.any(real & bad, axis=-1)


def scale_ok(scale) -> jax.Array | bool:
  """Whether a logit scale is one the certificates cover: finite and at
  least ``MIN_SCALE`` (float32's smallest normal; a subnormal scale reads 0
  on a CPU). True for a Python float (checked at the boundary); for an
  array (a traced temperature), the bool that feeds ``row_valid``.
  """
  if isinstance(scale, int | float):
    return True
  scale = jnp.asarray(scale)
  return jnp.isfinite(scale) & (scale >= MIN_SCALE)


def row_valid(
  *,
  has_head,
  logits_ok=True,
  norms_ok=True,
  output_ok=True,
  scale_ok=True,
) -> jax.Array:
  """The row validity rule of the module docstring, one place.

  Args:
    has_head: ``[...]`` bool, a real key of positive mass is kept.
    logits_ok: ``[...]`` bool from ``logits_ok`` (no NaN / +inf real logit).
    norms_ok: ``[...]`` bool, the real keys' value norms are not NaN.
    output_ok: ``[...]`` bool, the computed output is finite.
    scale_ok: bool, the logit scale is finite and >= ``MIN_SCALE``
      (``scale_ok``, on traced scales; a static scale is checked at the
      boundary by ``attention.checks``).

  Returns:
    ``[...]`` bool.
  """
  return has_head & logits_ok & norms_ok & output_ok & scale_ok


def finite_log(log_x) -> jax.Array:
  """``log_x`` with -inf (the log of 0) as the most negative finite float.

  Logs that leave the library (``Certificate.log_tv_bound``, the attention
  log-sum-exp residual) hold no infinity, so that a caller running under
  ``jax.debug_infs(True)`` (which checks every jit output) does not trip on
  a row that dropped nothing or kept nothing; ``jax.nn`` uses a large finite
  negative number for the same reason. Still an upper bound of log 0. NaN
  and +inf pass through.
  """
  log_x = jnp.asarray(log_x)
  return jnp.where(log_x == -jnp.inf, jnp.finfo(log_x.dtype).min, log_x)


def log_sum_exp_residual(log_head, valid, empty) -> jax.Array:
  """The attention log-sum-exp residual of rows, as returned to users.

  log Z_H (the log-sum-exp of the computed logits of the kept keys) where
  the row is ``valid``; log 0 (``finite_log``'s stand-in) for a row with no
  real key, which weighs nothing when partial results are merged; NaN for
  a row that had real keys but could not be certified (a NaN logit, a bad
  scale), so that a merge never treats it as empty.

  Args:
    log_head: ``[...]`` log Z_H (``Partial.log_head``).
    valid: ``[...]`` bool, the certificate's ``valid``.
    empty: ``[...]`` bool, rows that hold no real key.
  """
  log_head = jnp.asarray(log_head)
  nan = jnp.asarray(jnp.nan, log_head.dtype)
  lse = jnp.where(valid, log_head, jnp.where(empty, -jnp.inf, nan))
  return finite_log(lse)


def finish_certificate(
  log_tv,
  valid,
  *,
  k_kept,
  keys_scored,
  head_norm=None,
  tail_norm=None,
  logit_error=None,
  failure_prob: float = 0.0,
) -> Certificate:
  """Packs a rounded-up log tv bound into a Certificate.

  tv_bound = ``exp_up(log_tv)`` (never 0 for a positive bound, even when it
  is below the smallest normal); output_error_bound from
  ``output_error_bound`` when norms are given, plus
  ``logit_output_error`` when ``logit_error`` is (+inf where it is +inf:
  the certificate is trivial). Float fields are NaN and ``k_kept``
  is 0 where not ``valid``.

  Args:
    log_tv: ``[...]`` log tv bound (e.g. ``tail_log_bound``), rounded up.
    valid: ``[...]`` bool (``row_valid``).
    k_kept: ``[...]`` int kept real keys.
    keys_scored: ``[...]`` int q.k products computed.
    head_norm: optional ``[...]`` max kept value norm.
    tail_norm: optional ``[...]`` max dropped value norm.
    logit_error: optional ``[...]`` delta, to flag trivial rows.
    failure_prob: static probability that the bound fails (MC-Search).

  Returns:
    A Certificate with arrays shaped ``[...]`` (``valid``'s shape).
  """
  valid = jnp.asarray(valid)
  shape = valid.shape
  log_tv = jnp.broadcast_to(jnp.asarray(log_tv), shape)
  log_tv = jnp.where(valid, jnp.minimum(log_tv, 0.0), jnp.nan)
  tv = jnp.where(valid, exp_up(log_tv), jnp.nan)
  log_tv = finite_log(log_tv)  # tv_bound 0: the most negative float
  err = None
  if head_norm is not None:
    err = output_error_bound(tv, head_norm, tail_norm)
    if logit_error is not None:
      x = logit_output_error(logit_error, head_norm)
      # the sum rounded up (two roundings of at most half an ulp each)
      err = jnp.where(x > 0, (err + x) * (1 + 4 * _eps(err.dtype)), err)
      err = jnp.where(jnp.asarray(logit_error) < jnp.inf, err, jnp.inf)
    err = jnp.where(valid, jnp.broadcast_to(err, shape), jnp.nan)
  return Certificate(
    tv_bound=tv,
    log_tv_bound=log_tv,
    k_kept=jnp.where(valid, jnp.broadcast_to(k_kept, shape), 0).astype(
      jnp.int32
    ),
    keys_scored=jnp.broadcast_to(keys_scored, shape).astype(jnp.int32),
    output_error_bound=err,
    valid=valid,
    failure_prob=failure_prob,
  )


def mark_invalid(cert: Certificate, bad) -> Certificate:
  """``cert`` with the rows ``bad`` made invalid by the rule of ``row_valid``.

  For a condition found outside the certificate's own computation (e.g. a
  decode step past the cache's capacity): valid False, float fields NaN,
  ``k_kept`` 0 where ``bad``; ``keys_scored`` unchanged.

  Args:
    cert: a Certificate ``[...]``.
    bad: bool broadcastable to ``[...]``.
  """
  bad = jnp.broadcast_to(jnp.asarray(bad, bool), cert.valid.shape)
  nan = lambda x: None if x is None else jnp.where(bad, jnp.nan, x)  # noqa: E731
  return dataclasses.replace(
    cert,
    tv_bound=nan(cert.tv_bound),
    log_tv_bound=nan(cert.log_tv_bound),
    k_kept=jnp.where(bad, 0, cert.k_kept).astype(cert.k_kept.dtype),
    output_error_bound=nan(cert.output_error_bound),
    valid=cert.valid & ~bad,
  )


def _log_sum_exp_parts(x, where):
  """(max, sum e^{x - max}) over the last axis; (-inf, 0) when empty."""
  m = jnp.max(jnp.where(where, x, -jnp.inf), axis=-1, initial=-jnp.inf)
  ms = jnp.where(m > -jnp.inf, m, 0.0)
  ms = jax.lax.stop_gradient(jnp.where(jnp.isfinite(ms), ms, 0.0))
  ms = ms[..., None]
  e = jnp.where(where, jnp.exp(jnp.where(where, x, ms) - ms), 0.0)
  return m, jnp.sum(e, axis=-1), e


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Partial:
  """Partial softmax statistics of part of a row's keys, mergeable.

  The state of a blockwise (flash) prefill, a split-K decode, a kernel's
  output or one KV shard: everything a Certificate needs, for the keys seen
  so far. Masses are kept as (max, sum relative to max) pairs, so nothing
  underflows (a tail 100 logits below the head still has its own max) and
  merges do not accumulate the magnitude of the logits into the error.

  Attributes:
    o: ``[..., d_v]`` NORMALISED output over the kept keys, sum_H p_i v_i /
      sum_H p_i (a convex combination of kept values: it overflows only if a
      value is within a few ulps of the largest float); zeros when nothing
      is kept; None when no output is carried.
    m: ``[...]`` largest kept logit; -inf when nothing is kept.
    denom: ``[...]`` sum over kept keys of e^{s_i - m}; 0 when nothing is kept.
    tail_m: ``[...]`` largest log mass term of the dropped part (a dropped
      logit, or log(|B| e^{u_B}) for an unscored block); -inf if none.
    tail_sum: ``[...]`` sum of e^{term - tail_m} over the dropped part.
    err: ``[...]`` rounding of log denom and log tail_sum, in units of eps.
    logit_error: ``[...]`` delta bounding |computed - exact| for every logit
      that entered (``logit_error_bound``); unscored bounds already bound
      exact logits.
    k_kept: ``[...]`` int32 kept real keys of positive mass.
    keys_scored: ``[...]`` int32 q.k products computed.
    head_norm: ``[...]`` max kept value norm, or None.
    tail_norm: ``[...]`` max dropped (or unscored) value norm, or None.
    logits_ok: ``[...]`` bool, no real logit seen is NaN or +inf (and, when
      norms are carried, no real value is non-finite).
  """

  o: jax.Array | None
  m: jax.Array
  denom: jax.Array
  tail_m: jax.Array
  tail_sum: jax.Array
  err: jax.Array
  logit_error: jax.Array
  k_kept: jax.Array
  keys_scored: jax.Array
  head_norm: jax.Array | None
  tail_norm: jax.Array | None
  logits_ok: jax.Array

  @property
  def log_head(self) -> jax.Array:
    """``[...]`` log Z_H (absolute; -inf when nothing is kept)."""
    return self.m + jnp.log(self.denom)

  @property
  def log_tail(self) -> jax.Array:
    """``[...]`` log of the tail bound (absolute; -inf when empty)."""
    return self.tail_m + jnp.log(self.tail_sum)

  @classmethod
  def from_logits(
    cls,
    logits,
    keep,
    real,
    *,
    logit_error=0.0,
    value_fn=None,
    value_norms=None,
    keys_scored=None,
  ) -> "Partial":
    """Statistics of one block of scored keys.

    Args:
      logits: ``[..., n]`` computed logits (stop-gradient is the caller's
        choice: gradients flow through ``o`` via ``value_fn``).
      keep: ``[..., n]`` bool kept set (masked and -inf keys are ignored).
      real: ``[..., n]`` bool real keys.
      logit_error: ``[...]`` delta of these logits (0 if exact).
      value_fn: optional ``p -> sum_i p_i v_i``, called with the normalised
        kept weights ``[..., n]`` (each <= 1, summing to 1), returning
        ``[..., d_v]``: the caller's einsum (any layout).
      value_norms: optional ``[..., n]`` (broadcastable) ``value_norms``.
      keys_scored: ``[...]`` int; default the number of real keys.

    Returns:
      A Partial with leading shape ``[...]``.
    """
    s = jnp.asarray(logits)
    dt = compute_dtype(s.dtype)
    s = s.astype(dt)
    real = jnp.broadcast_to(jnp.asarray(real, bool), s.shape)
    pos = real & (s > -jnp.inf)  # keys with (possible) mass
    ok = logits_ok(s, real)
    keep = jnp.asarray(keep, bool) & pos
    tail = pos & ~keep
    m, denom, e = _log_sum_exp_parts(s, keep)
    tm, tl, _ = _log_sum_exp_parts(jax.lax.stop_gradient(s), tail)
    o = None
    if value_fn is not None:
      p = e / jnp.where(denom > 0, denom, 1.0)[..., None]
      o = value_fn(p)
    head_norm = tail_norm = None
    if value_norms is not None:
      vn = jnp.broadcast_to(jnp.asarray(value_norms, dt), s.shape)
      head_norm = max_norm(vn, keep)
      tail_norm = max_norm(vn, tail)
      ok = ok & ~jnp.any(real & jnp.isnan(vn), axis=-1)
    lead = s.shape[:-1]
    if keys_scored is None:
      keys_scored = jnp.sum(real, axis=-1, dtype=jnp.int32)
    return cls(
      o=o,
      m=jax.lax.stop_gradient(m),
      denom=denom,
      tail_m=tm,
      tail_sum=tl,
      err=jnp.full(lead, _leaf_err(dt), dt),
      logit_error=jnp.broadcast_to(jnp.asarray(logit_error, dt), lead),
      k_kept=jnp.sum(keep, axis=-1, dtype=jnp.int32),
      keys_scored=jnp.broadcast_to(keys_scored, lead).astype(jnp.int32),
      head_norm=head_norm,
      tail_norm=tail_norm,
      logits_ok=ok,
    )

  @classmethod
  def from_dropped(
    cls,
    logits,
    where,
    *,
    logit_error=0.0,
    value_norms=None,
    d_v=None,
    group=None,
    logits_ok=None,
  ) -> "Partial":
    """Statistics of scored keys that are all dropped (nothing kept).

    ``from_logits`` with an empty kept set, in two passes over the logits
    (the tail's max, then its sum), as a path needs for the keys it never
    keeps (e.g. below a bracket). With ``group`` the row is read as strided
    columns (``[..., group, n / group]``, column j holding positions j + k n
    / group): each column's statistics come from a reduction over the major
    axis, which XLA:CPU vectorises (~2x faster than over the row), and the
    columns are merged by ``Partial.reduce`` (its rounding tracked).

    Args:
      logits: ``[..., n]`` computed logits.
      where: ``[..., n]`` bool, the dropped real keys (masked keys False; a
        -inf logit has no mass, a NaN or +inf one makes the row invalid).
      logit_error: ``[...]`` delta of these logits.
      value_norms: optional ``[..., n]`` (broadcastable) ``value_norms``.
      d_v: value dim: the Partial carries a zero output of that size
        (to merge with one that carries an output), or None.
      group: optional static column height (must divide n).
      logits_ok: optional ``[...]`` bool, the caller's own ``logits_ok`` of
        the row (e.g. from its row max: a NaN or +inf logit makes the max NaN
        or +inf); saves the check's pass.

    Returns:
      A Partial with leading shape ``[...]``, ``k_kept`` and ``keys_scored``
      0.
    """
    s = jnp.asarray(logits)
    dt = compute_dtype(s.dtype)
    s = jax.lax.stop_gradient(s.astype(dt))
    lead, n = s.shape[:-1], s.shape[-1]
    where = jnp.broadcast_to(jnp.asarray(where, bool), s.shape)
    vn = None
    if value_norms is not None:
      vn = jnp.broadcast_to(jnp.asarray(value_norms, dt), s.shape)
    ax = -1
    if group is not None:
      if n % group:
        raise ValueError(f"{group=} must divide the key axis {n=}")
      cols = lambda x: x.reshape(*lead, group, n // group)  # noqa: E731
      s, where = cols(s), cols(where)
      vn = None if vn is None else cols(vn)
      ax = -2
    if logits_ok is None:
      ok = ~jnp.any(where & (jnp.isnan(s) | (s == jnp.inf)), axis=ax)
    elif group is None:
      ok = jnp.asarray(logits_ok, bool)
    else:
      ok = jnp.asarray(logits_ok, bool)[..., None]
    pos = where & (s > -jnp.inf)
    tm = jnp.max(jnp.where(pos, s, -jnp.inf), axis=ax, initial=-jnp.inf)
    ms = jnp.where(jnp.isfinite(tm), tm, 0.0)
    e = jnp.exp(
      jnp.where(pos, s, jnp.expand_dims(ms, ax)) - jnp.expand_dims(ms, ax)
    )
    tl = jnp.sum(jnp.where(pos, e, 0.0), axis=ax)
    shape = tm.shape
    zero = jnp.zeros(shape, dt)
    head_norm = tail_norm = None
    if vn is not None:
      head_norm = zero
      tail_norm = max_norm(
        jnp.moveaxis(vn, ax, -1), jnp.moveaxis(where, ax, -1)
      )
      ok = ok & ~jnp.any(where & jnp.isnan(vn), axis=ax)
    part = cls(
      o=None if d_v is None else jnp.zeros((*shape, d_v), dt),
      m=jnp.full(shape, -jnp.inf, dt),
      denom=zero,
      tail_m=tm,
      tail_sum=tl,
      err=jnp.full(shape, _leaf_err(dt), dt),
      logit_error=jnp.broadcast_to(
        jnp.asarray(logit_error, dt)[..., None] if group else logit_error,
        shape,
      ).astype(dt),
      k_kept=jnp.zeros(shape, jnp.int32),
      keys_scored=jnp.zeros(shape, jnp.int32),
      head_norm=head_norm,
      tail_norm=tail_norm,
      logits_ok=jnp.broadcast_to(ok, shape),
    )
    return part if group is None else Partial.reduce(part, -1)

  @classmethod
  def empty(cls, shape, dtype=jnp.float32, *, d_v=None, norms=False):
    """The identity of ``merge``: nothing seen (a loop's initial carry).

    Args:
      shape: leading shape ``[...]``.
      dtype: compute dtype.
      d_v: value dim when an output is carried (``o`` zeros), else None.
      norms: whether value norms are carried.
    """
    dt = compute_dtype(dtype)
    z = jnp.zeros(shape, dt)
    ninf = jnp.full(shape, -jnp.inf, dt)
    return cls(
      o=None if d_v is None else jnp.zeros((*shape, d_v), dt),
      m=ninf,
      denom=z,
      tail_m=ninf,
      tail_sum=z,
      err=z,
      logit_error=z,
      k_kept=jnp.zeros(shape, jnp.int32),
      keys_scored=jnp.zeros(shape, jnp.int32),
      head_norm=z if norms else None,
      tail_norm=z if norms else None,
      logits_ok=jnp.ones(shape, bool),
    )

  @classmethod
  def from_stats(
    cls,
    m,
    denom,
    *,
    tail=False,
    o=None,
    err=None,
    logit_error=0.0,
    k_kept=0,
    keys_scored=0,
    head_norm=None,
    tail_norm=None,
    logits_ok=True,
  ) -> "Partial":
    """Statistics of keys summed elsewhere, e.g. by a Pallas kernel.

    For a part whose mass was computed as (max, sum of e^{s - max}) outside
    ``from_logits``: a kernel's block log-sum-exps, or the running head of
    an ``online_step`` loop. ``m`` may hold a finite mask value where
    nothing was seen (``denom`` 0): such entries become empty (-inf).

    Args:
      m: ``[...]`` max logit of the part.
      denom: ``[...]`` sum over the part of e^{s_i - m} (0 if empty).
      tail: False for kept keys (the head), True for dropped ones.
      o: ``[..., d_v]`` normalised output of the head, or None.
      err: ``[...]`` rounding of ``denom`` in units of eps (an
        ``online_step`` loop's); default one leaf (each term computed once
        relative to ``m``, as ``from_logits``).
      logit_error: ``[...]`` delta of the logits that entered.
      k_kept: ``[...]`` int kept real keys (0 for a tail part).
      keys_scored: ``[...]`` int q.k products computed.
      head_norm: ``[...]`` max kept value norm (None: no norms carried).
      tail_norm: ``[...]`` max dropped value norm (with ``head_norm``).
      logits_ok: ``[...]`` bool, no NaN / +inf real logit or broken value.

    Returns:
      A Partial with leading shape ``m.shape``.
    """
    m = jnp.asarray(m)
    dt = compute_dtype(m.dtype)
    m = m.astype(dt)
    denom = jnp.asarray(denom, dt)
    has = denom > 0
    m = jnp.where(has, m, -jnp.inf)
    denom = jnp.where(has, denom, 0.0)
    shape = m.shape
    if err is None:
      err = jnp.full(shape, _leaf_err(dt), dt)
    ninf = jnp.full(shape, -jnp.inf, dt)
    zero = jnp.zeros(shape, dt)
    if (head_norm is None) != (tail_norm is None):
      raise ValueError("from_stats: give head_norm and tail_norm, or neither")
    norms = {}
    if head_norm is not None:
      norms = dict(
        head_norm=jnp.broadcast_to(jnp.asarray(head_norm, dt), shape),
        tail_norm=jnp.broadcast_to(jnp.asarray(tail_norm, dt), shape),
      )
    if o is not None:
      o = jnp.where(has[..., None], jnp.asarray(o).astype(dt), 0.0)
    return cls(
      o=o,
      m=ninf if tail else m,
      denom=zero if tail else denom,
      tail_m=m if tail else ninf,
      tail_sum=denom if tail else zero,
      err=jnp.broadcast_to(jnp.asarray(err, dt), shape),
      logit_error=jnp.broadcast_to(jnp.asarray(logit_error, dt), shape),
      k_kept=jnp.broadcast_to(jnp.asarray(k_kept, jnp.int32), shape),
      keys_scored=jnp.broadcast_to(jnp.asarray(keys_scored, jnp.int32), shape),
      head_norm=norms.get("head_norm"),
      tail_norm=norms.get("tail_norm"),
      logits_ok=jnp.broadcast_to(jnp.asarray(logits_ok, bool), shape),
    )

  def add_tail(self, log_terms, where, *, norms=None) -> "Partial":
    """Adds upper bounds on the mass of unscored keys to the tail.

    Args:
      log_terms: ``[..., nb]`` log of a sound upper bound on each unscored
        block's mass (e.g. u_b + log|B_b|, u_b a box bound on its EXACT
        logits); NaN or +inf makes the row invalid.
      where: ``[..., nb]`` bool, the blocks that hold real keys and were not
        scored.
      norms: optional ``[..., nb]`` max value norm of each block's real keys
        (required when this Partial carries norms).

    Returns:
      A Partial with the terms merged into its tail.
    """
    dt = self.m.dtype
    x = jnp.asarray(log_terms).astype(dt)
    where = jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
    where = where & (x > -jnp.inf)
    bad = jnp.any(where & (jnp.isnan(x) | (x == jnp.inf)), axis=-1)
    tm, tl, _ = _log_sum_exp_parts(jax.lax.stop_gradient(x), where)
    tail_norm = self.tail_norm
    if tail_norm is not None:
      if norms is None:
        raise ValueError("add_tail needs norms=: this Partial carries norms")
      tail_norm = jnp.maximum(tail_norm, max_norm(norms, where))
    pm = jnp.stack([self.tail_m, tm])
    m, denom, _ = _rescale(pm, jnp.stack([self.tail_sum, tl]), 0)
    leaf = jnp.full(tm.shape, _leaf_err(dt), dt)
    step = _merge_step(pm, m, 0)
    err = jnp.maximum(self.err + step[0], leaf + step[1]) + _EXP_ULPS
    return dataclasses.replace(
      self,
      tail_m=m,
      tail_sum=denom,
      err=err,
      tail_norm=tail_norm,
      logits_ok=self.logits_ok & ~bad,
    )

  @staticmethod
  def reduce(parts: "Partial", axis: int) -> "Partial":
    """Merges the Partials stacked along ``axis`` of the leading shape.

    One level: every part is rescaled to the common maximum and summed (the
    reduction's own rounding is added to ``err``). ``axis`` indexes the
    leading shape ``[...]`` (``o`` has one more trailing axis).
    """
    nd = parts.m.ndim
    ax = axis % nd
    dt = parts.m.dtype
    red = lambda x, f: f(x, axis=ax)  # noqa: E731
    m, denom, w = _rescale(parts.m, parts.denom, ax)
    tm, tl, _ = _rescale(parts.tail_m, parts.tail_sum, ax)
    o = None
    if parts.o is not None:
      # Convex weights of the parts (they sum to 1): o stays normalised.
      frac = w / jnp.expand_dims(jnp.where(denom > 0, denom, 1.0), ax)
      o = jnp.sum(frac[..., None] * parts.o, axis=ax)
    k = parts.m.shape[ax]
    step = _merge_step(parts.m, m, ax) + _merge_step(parts.tail_m, tm, ax)
    grow = log_slack(k, dt) / _eps(dt) + _EXP_ULPS
    err = red(parts.err + step, jnp.max) + grow
    opt = lambda x, f: None if x is None else red(x, f)  # noqa: E731
    return Partial(
      o=o,
      m=m,
      denom=denom,
      tail_m=tm,
      tail_sum=tl,
      err=err,
      logit_error=red(parts.logit_error, jnp.max),
      k_kept=red(parts.k_kept, jnp.sum).astype(jnp.int32),
      keys_scored=red(parts.keys_scored, jnp.sum).astype(jnp.int32),
      head_norm=opt(parts.head_norm, jnp.max),
      tail_norm=opt(parts.tail_norm, jnp.max),
      logits_ok=red(parts.logits_ok, jnp.all),
    )

  def finalize(
    self, *, n_terms, failure_prob: float = 0.0, scale_ok=True
  ) -> tuple[jax.Array | None, Certificate]:
    """The output and Certificate of a row whose keys have all been seen.

    Args:
      n_terms: number of terms reduced into the masses (keys plus unscored
        blocks; a static int is fine), for ``log_slack``.
      failure_prob: static probability that the bound fails (MC-Search).
      scale_ok: bool (or ``[...]``), False for a traced scale that is not
        finite and > 0.

    Returns:
      ``(o, certificate)``: ``o`` ``[..., d_v]`` (zeros on invalid rows) or
      None, and the Certificate (``row_valid``; tv_bound from
      ``tail_log_bound``, output_error_bound from ``output_error_bound``).
    """
    out_ok = True
    if self.o is not None:
      out_ok = jnp.all(jnp.isfinite(self.o), axis=-1)
    norms_ok = True
    if self.head_norm is not None:
      norms_ok = ~(jnp.isnan(self.head_norm) | jnp.isnan(self.tail_norm))
    has_head = (self.denom > 0) & jnp.isfinite(self.m)
    valid = row_valid(
      has_head=has_head,
      logits_ok=self.logits_ok,
      norms_ok=norms_ok,
      output_ok=out_ok,
      scale_ok=scale_ok,
    )
    dt = self.m.dtype
    m = jnp.where(jnp.isfinite(self.m), self.m, 0.0)
    gap = self.tail_m - m  # the tail relative to the head's maximum
    log_tail = gap + jnp.log(self.tail_sum)
    log_head = jnp.log(jnp.where(self.denom > 0, self.denom, 1.0))
    # fl(tail_m - m) is off by eps/2 |gap| <= eps/2 (|x| + |log denom| +
    # |log tail_sum|): finish_log_bound's |x| term covers the first part.
    err = 2 * self.err + 2 * jnp.log1p(jnp.asarray(n_terms, dt))
    log_tv = tail_log_bound(
      log_head,
      log_tail,
      err=err,
      n_terms=n_terms,
      logit_error=self.logit_error,
      ok=valid,
    )
    cert = finish_certificate(
      log_tv,
      valid,
      k_kept=self.k_kept,
      keys_scored=self.keys_scored,
      head_norm=self.head_norm,
      tail_norm=self.tail_norm,
      logit_error=self.logit_error,
      failure_prob=failure_prob,
    )
    o = self.o
    if o is not None:
      o = jnp.where(valid[..., None], o, jnp.zeros((), dt))
    return o, cert


def _rescale(m_parts, l_parts, ax):
  """Common max, rescaled sum and per-part weights of (m, l) pairs."""
  m = jnp.max(m_parts, axis=ax)
  ms = jnp.where(jnp.isfinite(m), m, 0.0)
  ms_b = jnp.expand_dims(ms, ax)
  w = jnp.where(
    l_parts > 0, jnp.exp(jnp.where(l_parts > 0, m_parts, ms_b) - ms_b), 0.0
  )
  w = w * l_parts
  return m, jnp.sum(w, axis=ax), w


def _merge_step(m_parts, m, ax):
  """eps-units rounding added when a part is rescaled to the max ``m``."""
  dt = m_parts.dtype
  gap = jnp.abs(m_parts - jnp.expand_dims(jnp.where(jnp.isfinite(m), m, 0), ax))
  lim = _log_tiny_inv(dt) + 1.0
  gap = jnp.where(jnp.isfinite(gap), jnp.minimum(gap, lim), 0.0)
  return 0.5 * gap + _EXP_ULPS


def online_step(
  m, denom, o, err, logits, valid, value_fn, *, mask_value, axis=-1
):
  """One block of a flash (online-softmax) loop: the pairwise ``merge``.

  The running head (``m``, ``denom``, normalised ``o``, ``err``, as a
  ``Partial``'s fields) absorbs one block of logits. The form of
  ``Partial.reduce`` for two parts, written elementwise so that it runs
  inside a Pallas kernel body (no -inf, no ``isfinite``: empty entries hold
  the finite ``mask_value``): m' = max(m, max s), the old part rescaled by
  e^{m - m'}, the block's terms e^{s - m'} computed once (a leaf), and the
  output kept a convex combination, o' = (e^{m - m'} denom o + sum_j p_j
  v_j) / denom' with every weight <= 1, so values near the largest float do
  not overflow (an unnormalised accumulator would). ``err`` grows as in
  ``Partial.reduce`` (the rescale's 0.5 |m - m'| + ulps, a leaf for the
  block, the addition's slack); ``Partial.from_stats(m, denom, o=o,
  err=err)`` turns the result into a Partial.

  Args:
    m: ``[r, 1]`` running max (``mask_value`` before any real key).
    denom: ``[r, 1]`` running sum of e^{s - m} (0 before any real key).
    o: ``[r, d_v]`` running normalised output (0 before any real key).
    err: ``[r, 1]`` running rounding of ``denom`` in eps units (0 at first).
    logits: ``[r, bk]`` the block's logits (or ``[bk, r]`` with ``axis=0``).
    valid: bool, same shape: real keys.
    value_fn: ``p -> [r, d_v]``, sum_j p_j v_j of the block for weights p
      shaped like ``logits`` (each <= 1, summing to <= 1).
    mask_value: a large negative finite number (e.g. -0.7 max float).
    axis: the block's key axis of ``logits`` (-1 or 0).

  Returns:
    ``(m, denom, o, err)`` after the block.
  """
  dt = m.dtype
  s = jnp.where(valid, logits, mask_value)
  m_new = jnp.maximum(m, jnp.max(s, axis=axis, keepdims=True))
  corr = jnp.exp(m - m_new)  # <= 1
  p = jnp.where(valid, jnp.exp(s - m_new), 0.0)  # each <= 1
  d_new = corr * denom + jnp.sum(p, axis=axis, keepdims=True)
  inv = 1.0 / jnp.where(d_new > 0, d_new, 1.0)
  o_new = (corr * denom * inv) * o + value_fn(p * inv)
  lim = _log_tiny_inv(dt) + 1.0
  with jax.ensure_compile_time_eval():
    grow = float(log_slack(2, dt)) / float(_eps(dt)) + _EXP_ULPS
  step = 0.5 * jnp.minimum(m_new - m, lim) + 2 * _EXP_ULPS
  err_new = jnp.maximum(err + step, _leaf_err(dt) + _EXP_ULPS) + grow
  return m_new, d_new, o_new, err_new


def merge(a: Partial, b: Partial) -> Partial:
  """Merges two Partials of disjoint key sets of the same rows.

  Associative and commutative up to rounding (the rounding is tracked in
  ``err``); ``Partial.empty`` is its identity. The output stays normalised:
  o = (w_a o_a + w_b o_b) / (w_a + w_b), a convex combination.

  Raises:
    ValueError: if one Partial carries an output (or norms) and the other
      does not.
  """
  if (a.o is None) != (b.o is None) or (a.head_norm is None) != (
    b.head_norm is None
  ):
    raise ValueError(
      "merge: both Partials must carry an output and norms, or neither;"
      f" got o: {a.o is not None}, {b.o is not None}; norms:"
      f" {a.head_norm is not None}, {b.head_norm is not None}"
    )
  parts = jax.tree.map(lambda x, y: jnp.stack([x, y]), a, b)
  return Partial.reduce(parts, 0)


def certificate_from_logits(
  logits,
  keep,
  real,
  *,
  logit_error=0.0,
  value_norms=None,
  keys_scored=None,
  failure_prob: float = 0.0,
) -> Certificate:
  """The Certificate of a kept set when every logit of the row is known.

  THEORY 2.1/2.5 (tau of the kept set, rounded up), 3.4 (logits off by at
  most ``logit_error``), 4.2/4.4 (output error from value norms).

  Args:
    logits: ``[..., n]`` logits (any float dtype).
    keep: ``[..., n]`` bool kept set.
    real: ``[..., n]`` bool real keys.
    logit_error: ``[...]`` delta of the logits; 0 when they are exact (e.g.
      given by the user to ``select``).
    value_norms: optional ``[..., n]`` (broadcastable) ``value_norms``.
    keys_scored: optional ``[...]`` int; default the real keys.
    failure_prob: static.

  Returns:
    A Certificate ``[...]``.
  """
  s = jax.lax.stop_gradient(jnp.asarray(logits))
  p = Partial.from_logits(
    s,
    keep,
    real,
    logit_error=logit_error,
    value_norms=value_norms,
    keys_scored=keys_scored,
  )
  _, cert = p.finalize(n_terms=s.shape[-1], failure_prob=failure_prob)
  return cert


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
