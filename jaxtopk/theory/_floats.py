"""Float-safe primitives every bound is built from: norms, products, flushes.

The one definition of each (``jaxtopk.selection.core`` names them for the
layers above; the theory's own ball bounds use them too). XLA on CPU reads
subnormal inputs as 0 and flushes subnormal results to 0; a bound computed
the naive way then reads 0 where its exact value is positive (a product
``scale * ||q||`` of 0.09 * 1.5e-38 is subnormal, so ``(scale * ||q||) * r``
is 0 for any radius r), or overflows where it is finite (squares of
coordinates above 1.8e19). Here:

- ``flushed(x, axis)`` / ``subnormal(x)``: which components a CPU reads
  as 0 (checked on the bit pattern, before any cast).
- ``norms_up(x, axis)``: ||x||_2 rounded up, scaled by an exact power of
  two so that squares neither underflow nor overflow (coordinates from
  1e-45 to 3e38); never below the smallest normal when positive.
- ``mul_up(*factors)``: a product of nonnegative factors rounded up, from
  their mantissas and exponents (``frexp``), so that no intermediate
  product under- or overflows: +inf only when the product itself exceeds
  the largest float, at least the smallest normal when it is positive.
- ``dist_up(x, c)``: ||x - c||_2 rounded up for the exact stored values
  (a ball radius).
- ``norms_and_finite(x, axis, compress=True)`` and ``mul_norm_up(t, y)``:
  norms that never overflow for finite vectors (value norms near the
  largest float: [3e38, 3e38] has norm 4.2e38 > 3.4e38). Below the knee
  2^(maxexp - 2) (8.5e37 in float32) a norm is stored as itself (rounded
  up); above it compressed, y = K + (x - K) / 2^10, which is monotone, so
  maxima and masks of stored norms work unchanged, and only a product with
  the norm needs ``mul_norm_up`` (t x, rounded up, +inf only when the
  product itself exceeds the largest float).
- ``max_nan(x, axis)``: a max reduction that is NaN wherever an input is.
  XLA:CPU's vectorised max and min reductions do not propagate NaN (they
  keep the other operand; measured with jax 0.10.2 on a [2048, 32] array:
  a NaN at position 1 is lost), so finiteness is never read from a plain
  max: every summary that must carry a NaN uses this.
"""

import jax
import jax.numpy as jnp


def _uint(dtype):
  return jnp.dtype(f"uint{jnp.finfo(dtype).bits}")


def pow2(e, dtype):
  """2.0**e exactly, for integer ``e`` in the normal exponent range."""
  fi = jnp.finfo(dtype)
  ut = _uint(dtype)
  bias = 1 - fi.minexp  # 127 for float32, 1023 for float64
  biased = (jnp.asarray(e, jnp.int32) + bias).astype(ut)
  return jax.lax.bitcast_convert_type(biased << fi.nmant, dtype)


def _compute_dtype(dtype):
  return jnp.promote_types(jnp.dtype(dtype), jnp.float32)


def subnormal(x) -> jax.Array:
  """Elementwise: a nonzero subnormal of ``x``'s dtype, read as 0 on CPU.

  float16 subnormals are normal numbers in float32 (the compute dtype), so
  they are never flushed: False for float16.
  """
  x = jnp.asarray(x)
  fi = jnp.finfo(x.dtype)
  if fi.minexp > jnp.finfo(_compute_dtype(x.dtype)).minexp:
    return jnp.zeros(x.shape, bool)  # float16: normal in the compute dtype
  ut = _uint(x.dtype)
  mag = jax.lax.bitcast_convert_type(x, ut) & jnp.asarray(
    (1 << (fi.bits - 1)) - 1, ut
  )  # |x| as bits (sign cleared)
  return (mag != 0) & (mag < jnp.asarray(1 << fi.nmant, ut))


def flushed(x, axis=-1) -> jax.Array:
  """Whether ``x`` holds nonzero subnormal components that a CPU reads as 0.

  Checked on the bit pattern of ``x`` in its own dtype (bfloat16, float32
  and float64 subnormals are read as 0 by XLA on CPU). float16 subnormals are
  normal numbers in float32, the compute dtype, so they are never flushed.

  Args:
    x: ``[..., n, ...]`` float array.
    axis: the axis reduced.

  Returns:
    ``[...]`` bool (``x``'s shape without ``axis``).
  """
  return jnp.any(subnormal(x), axis=axis)


_SHRINK = 10  # compressed norms: (x - knee) / 2^_SHRINK above the knee


def _knee(dt):
  """2^(maxexp - 2): norms above it are stored compressed."""
  return pow2(jnp.finfo(dt).maxexp - 2, dt)


def max_nan(x, axis=-1, initial=None) -> jax.Array:
  """``jnp.max(x, axis, initial=initial)``, NaN where any input is NaN."""
  x = jnp.asarray(x)
  m = jnp.max(x, axis=axis, initial=initial)
  return jnp.where(jnp.any(jnp.isnan(x), axis=axis), jnp.nan, m)


def norms_and_finite(x, axis=-1, compress=False):
  """(``norms_up``, whether every component is finite) over ``axis``.

  With ``compress``, norms above the knee are stored compressed (module
  docstring; read with ``mul_norm_up``), so a finite vector's norm is
  finite up to 3072 times the knee x the largest float.
  """
  x = jnp.asarray(x)
  dt = _compute_dtype(x.dtype)
  fi = jnp.finfo(dt)
  sub = flushed(x, axis)
  xc = jnp.moveaxis(x, axis, -1).astype(dt)  # [..., n]
  n = xc.shape[-1]
  # XLA:CPU's max reduction drops NaN (``max_nan``): finiteness is read
  # from every component.
  finite = jnp.all(jnp.isfinite(xc), axis=-1)
  m = jnp.max(jnp.abs(xc), axis=-1, initial=0.0)  # [...]
  pos = finite & (m > 0)
  _, e = jnp.frexp(jnp.where(pos, m, 1.0))  # m = f 2^e, f in [0.5, 1)
  # e clipped to [minexp + 1, -minexp]: 2^-e and 2^e are normal; max r < 4.
  # The lower clip matters where subnormals are not flushed (GPU): there a
  # subnormal m gives e < minexp + 1, and 2^-e would overflow its exponent
  # bits (NaN norms on an H200).
  e = jnp.where(pos, jnp.clip(e, fi.minexp + 1, -fi.minexp), 0)
  # x, not |x|: XLA:CPU fused |x| into both reductions ~5x slower.
  r = xc * pow2(-e, dt)[..., None]  # exact (flushed entries: < 2^-120 m)
  ss = jnp.sum(r * r, axis=-1)  # [...] <= 16 n
  # Sum of n squares, the sqrt and this product: (n + 8) eps covers them.
  base = jnp.sqrt(ss) * (1 + (n + 8) * fi.eps)  # <= 4 sqrt(n) (1 + ...)
  nrm = base * pow2(e, dt)  # inf: honest (or compressed below)
  if compress:
    knee = _knee(dt)
    low = pow2(fi.maxexp - 2 - _SHRINK, dt)  # knee / 2^_SHRINK
    # x / 2^_SHRINK, exact: e - _SHRINK stays normal where it is used.
    shrunk = base * pow2(jnp.maximum(e - _SHRINK, fi.minexp), dt)
    comp = ((knee - low) + shrunk) * (1 + 2 * fi.eps)
    nrm = jnp.where(nrm <= knee, nrm, comp)
  broken = jnp.where(jnp.any(jnp.isnan(xc), -1), jnp.nan, jnp.inf)
  nrm = jnp.where(finite, nrm, broken)  # inf or NaN components
  floor = jnp.sqrt(jnp.asarray(max(n, 1), dt)) * fi.tiny * 2
  return jnp.where(sub, nrm + floor, nrm), finite


def norms_up(x, axis=-1) -> jax.Array:
  """||x||_2 over ``axis``, rounded up, in the compute dtype.

  Scaled by an exact power of two 2^-e (e the exponent of max |x_c|, capped
  so that 2^-e stays a normal number), so squares neither underflow (|x| ~
  1e-30) nor overflow (|x_c| > 2^64), and no reciprocal is ever formed (1 /
  max|x| is subnormal for max|x| > 2^126 and reads 0 on a CPU). Subnormal
  components, which the CPU reads as 0, still give a positive norm: sqrt(n)
  tiny is added where any is present. The result is +inf only when the
  rounded-up norm exceeds the largest float (honest), or a component is
  +-inf; NaN when a component is NaN.

  Args:
    x: ``[..., n, ...]`` float array (any float dtype).
    axis: the axis reduced.

  Returns:
    ``[...]`` nonnegative, >= the exact norm of the float inputs.
  """
  nrm, _ = norms_and_finite(x, axis)
  return nrm


def _split(x, dt):
  """(m, e) with x = m 2^e, m in [1, 2), for positive normal finite ``x``
  (bit operations: a few ops, no ``frexp``)."""
  fi = jnp.finfo(dt)
  ut = _uint(dt)
  bits = jax.lax.bitcast_convert_type(x, ut)
  e = (bits >> fi.nmant).astype(jnp.int32) - (1 - fi.minexp)
  one = jnp.asarray((1 - fi.minexp) << fi.nmant, ut)  # the bits of 1.0
  mant = jnp.asarray((1 << fi.nmant) - 1, ut)
  m = jax.lax.bitcast_convert_type((bits & mant) | one, dt)
  return m, e


def mul_up(*factors) -> jax.Array:
  """Product of nonnegative factors, rounded up, with no intermediate flush.

  Each factor is split into mantissa and exponent (exactly, from its
  bits); the mantissas (in [1, 2)) are multiplied, the exponents added, and
  the product is rebuilt with an exact power of two. So (scale ||q||) r is
  not 0 because scale ||q|| is subnormal, and ||q|| ||k|| scale is not +inf
  because ||q|| ||k|| overflows when the product does not. Subnormal
  factors (read as 0 by a CPU) are taken as the smallest normal (an upper
  bound).

  Args:
    *factors: nonnegative float arrays (or Python numbers) broadcasting
      together; at least one array fixes the compute dtype.

  Returns:
    The product in the compute dtype, >= the exact product of the inputs:
    0 if a factor is 0 (and none is NaN or +inf), +inf if a factor is +inf
    or the product exceeds the largest float, at least the smallest normal
    if it is positive; NaN if a factor is NaN, or for 0 x inf.
  """
  arrays = [jnp.asarray(f) for f in factors]
  dt = _compute_dtype(jnp.result_type(*arrays))
  fi = jnp.finfo(dt)
  mant = expo = None
  zero = inf = nan = False
  for x in arrays:
    if not jnp.issubdtype(x.dtype, jnp.floating):
      x = x.astype(dt)
    x = jnp.where(subnormal(x), fi.tiny, x.astype(dt))
    zero = zero | (x == 0)
    inf = inf | (x == jnp.inf)
    nan = nan | jnp.isnan(x)
    m, e = _split(jnp.where(jnp.isfinite(x) & (x > 0), x, 1.0), dt)
    mant = m if mant is None else mant * m  # < 2^k: no flush, no overflow
    expo = e if expo is None else expo + e
  m, e = _split(mant, dt)  # mant >= 1: normal
  expo = expo + e
  # k - 1 products of mantissas, each rounded by eps / 2.
  m = m * (1 + len(arrays) * fi.eps)  # in [1, 2 + small)
  big = expo > fi.maxexp - 1
  small = expo < fi.minexp
  r = m * pow2(jnp.clip(expo, fi.minexp, fi.maxexp - 1), dt)  # exact or inf
  r = jnp.where(big, jnp.inf, jnp.where(small, fi.tiny, r))
  r = jnp.where(zero, 0.0, jnp.where(inf, jnp.inf, r))
  return jnp.where(nan | (zero & inf), jnp.nan, r)


def mul_norm_up(t, y) -> jax.Array:
  """t times the norm stored as ``y`` (``norms_and_finite(compress=True)``).

  ``y`` at or below the knee K is the norm itself; above it the norm is
  K + (y - K) 2^_SHRINK, which may exceed the largest float: the product is
  formed as t K + (t (y - K)) 2^_SHRINK (t is a tv bound or a fraction,
  at most 2, so no intermediate overflows before the product itself does,
  and a factor of y - K >= one ulp of K never flushes), rounded up. Inputs
  below the smallest normal count as it; a positive product is never 0.

  Args:
    t: nonnegative factor(s) in [0, 2] (e.g. a tv bound).
    y: stored norm(s), broadcasting with ``t``.

  Returns:
    t x rounded up; +inf only when it exceeds the largest float; NaN where
    an input is NaN.
  """
  t, y = jnp.asarray(t), jnp.asarray(y)
  dt = _compute_dtype(jnp.result_type(t, y))
  fi = jnp.finfo(dt)
  t = jnp.where(subnormal(t), fi.tiny, t.astype(dt))
  y = jnp.where(subnormal(y), fi.tiny, y.astype(dt))
  knee = _knee(dt)
  small = ~(y > knee)  # NaN: the plain product (NaN)
  a = t * jnp.where(small, y, knee)
  over = jnp.where(small, 0.0, y - knee)  # exact or one rounding
  b = (t * over) * float(2**_SHRINK)  # the scaling is exact
  tot = (a + b) * (1 + 4 * fi.eps)
  return jnp.where((t > 0) & (y > 0), jnp.maximum(tot, fi.tiny), tot)


def dist_up(x, c) -> jax.Array:
  """``[...]`` an upper bound on ||x - c||_2 for the exact stored values.

  The difference is rounded (relative eps, or flushed to 0 below the
  smallest normal): ||x - c|| <= ||fl(x - c)|| (1 + eps) + sqrt(d) tiny,
  with ``norms_up`` for the norm (no squares underflow: coordinates of
  1e-20 keep their radius). XLA may also recompute c inside a fusion with
  another rounding than the stored c (a division turned into a multiply by
  a reciprocal: 1-2 ulps; seen in a test as a radius 1.5 ulps short), so
  4 eps ||c|| is added.

  Args:
    x: ``[..., d]``.
    c: ``[..., d]``, broadcasting with ``x``.

  Returns:
    ``[...]`` in the compute dtype (NaN / +inf for non-finite inputs).
  """
  x, c = jnp.asarray(x), jnp.asarray(c)
  dt = _compute_dtype(jnp.result_type(x, c))
  d = x.shape[-1]
  fin = jnp.finfo(dt)
  r = norms_up(x - c) * (1 + 2 * fin.eps) + 4 * fin.eps * norms_up(c)
  return r + 2 * (d**0.5) * fin.tiny
