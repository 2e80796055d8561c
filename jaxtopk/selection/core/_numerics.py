"""Floats: rounding rules, norms, the matmul precision and the scale
range every certificate rests on (``jaxtopk.selection.core``).
"""

import math

import jax
import jax.numpy as jnp

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
