"""Key codes: 8-bit per-key codes and the sound logit bounds they give.

THEORY 3.5. Each key k (as stored) is kept next to its code: an exponent e
and integers c_c in [-127, 127] with

    k_hat = 2^e c,   |k_c - k_hat_c| <= 2^(e - 1) for every component c,

(round to nearest with a power-of-two step 2^e chosen from max_c |k_c|, so
k_hat is exact in floats and the division by the step is exact). For any
query q, exactly,

    q.k = 2^e (q.c) + q.(k - k_hat),   |q.(k - k_hat)| <= 2^(e-1) ||q||_1,

so u = scale 2^e (q.c + ||q||_1 / 2) bounds the logit from above and
l = scale 2^e (q.c - ||q||_1 / 2) from below, per key, with no assumption
on the keys (a deterministic bound must cover every key's worst case; on
keys of real attention heads the slack is a fraction of a logit, where ball
and box summaries of 16 to 64 keys sit several logits above them; see
experiments/bound_study.py). The code of a key costs ``code_share`` of a
full-precision q.k (the share of the key's bytes it reads: (d + 1) bytes of
d * itemsize), and that is what ``keys_scored`` counts for it.

Rounding (the core's rules, ``core.round_up``): the computed t = fl(q.c)
(any summation order, FMA or not) is off by at most (d + 2) eps sum_c |q_c
c_c| <= (d + 2) eps 127 ||q||_1, and sums of normal numbers that cancel to
a subnormal lose less than tiny each (d of them); a subnormal q_c, read as
0 by a CPU, loses |q_c| (|c_c| + 1/2) 2^e <= 128 tiny 2^e. So with
h = 1/2 + 127 (d + 2) eps and C = d tiny (1 + 128 [q has subnormals]),

    u = scale 2^e (t + h ||q||_1 + C),  l = scale 2^e (t - h ||q||_1 - C),

each operation rounded outward (``core.round_up`` / ``round_down``), the
product by 2^e exact unless it underflows (less than tiny lost, covered)
or overflows (u = +inf: the key must be scored; a bound is never -inf for
a real key). ||q||_1 is rounded up by (d + 2) eps. The scale multiply and
the rounding of ``scale`` itself are one more outward rounding.

Encoding (``encode_keys``, once per key when it is appended): with a =
max_c |k_c| (a CPU reads subnormal components as 0) and a = f 2^E, f in
[0.5, 1), e = E - 7 (E - 6 when 128 f rounds to 128), so |k_c| / 2^e <=
127.5 and every code fits in int8; e >= E_MIN with 2^(E_MIN - 1) the
smallest normal, so a subnormal component (read as 0, coded 0) is within
half a step. A key with a non-finite component gets the exponent
``NONFINITE``: its upper bound is +inf (it is always scored, and its
non-finite logit then invalidates the row as the core's rule says).
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxtopk.selection import core

CODE_BITS = 8
QMAX = 127
_HIGHEST = core.PRECISION  # the one precision of certificate products


def _params(dtype):
  """(exponent dtype, E_MIN, E_MAX, NONFINITE) for a compute dtype."""
  fi = jnp.finfo(dtype)
  emin = fi.minexp + 1  # 2^(emin - 1) = tiny: half a step >= any subnormal
  emax = fi.maxexp - 6  # a <= max float: E <= maxexp, e <= E - 6
  if fi.bits <= 32:
    return jnp.int8, emin, emax, 127
  return jnp.int16, emin, emax, 1 << 14


def exponent_dtype(key_dtype):
  """The storage dtype of the exponents of keys of ``key_dtype``."""
  return _params(core.compute_dtype(key_dtype))[0]


def nonfinite_exponent(key_dtype) -> int:
  """The exponent marking a key with a non-finite component."""
  return _params(core.compute_dtype(key_dtype))[3]


def code_share(head_dim: int, key_dtype) -> float:
  """Cost of one code product in units of one full-precision q.k.

  The share of the key's bytes it reads: ``head_dim`` one-byte codes plus
  the exponent, over ``head_dim`` keys components of the cache dtype.
  """
  e_bytes = jnp.dtype(exponent_dtype(key_dtype)).itemsize
  return (head_dim + e_bytes) / (head_dim * jnp.dtype(key_dtype).itemsize)


def code_cost(n_keys, head_dim: int, key_dtype) -> jax.Array:
  """int32 ceil(n_keys * ``code_share``): key-equivalents of n code products.

  Exact integer arithmetic: (n (d + e_bytes) + d itemsize - 1) // (d
  itemsize).
  """
  e_bytes = jnp.dtype(exponent_dtype(key_dtype)).itemsize
  num = head_dim + e_bytes
  den = head_dim * jnp.dtype(key_dtype).itemsize
  n = jnp.asarray(n_keys, jnp.int32)
  g = math.gcd(num, den)
  num, den = num // g, den // g
  # n num may exceed int32 for caches past 2^31 / num keys: split n.
  hi, lo = n // den, n % den
  return hi * num + (lo * num + den - 1) // den


def encode_keys(keys) -> tuple[jax.Array, jax.Array]:
  """Codes and exponents of keys, as stored (module docstring).

  Args:
    keys: ``[..., d]`` keys (any float dtype; the codes bound the values as
      given).

  Returns:
    ``(codes, exponents)``: ``[..., d]`` int8 and ``[...]`` int8 (int16
    for float64 keys), with |k_c - 2^e c_c| <= 2^(e - 1) for every finite
    key; ``exponents == nonfinite_exponent`` for a key with a non-finite
    component (its codes are 0).
  """
  keys = jnp.asarray(keys)
  dt = core.compute_dtype(keys.dtype)
  edt, emin, emax, bad = _params(dt)
  k = keys.astype(dt)  # exact widening
  # Finiteness from every component (XLA:CPU's max drops NaN: core.max_nan).
  finite = jnp.all(jnp.isfinite(k), axis=-1)
  a = jnp.max(jnp.abs(k), axis=-1, initial=0.0)
  pos = finite & (a > 0)
  f, big_e = jnp.frexp(jnp.where(pos, a, 1.0))  # a = f 2^E, f in [0.5, 1)
  e = big_e - 7
  e = e + (jnp.round(f * 128) > QMAX).astype(e.dtype)
  e = jnp.clip(jnp.where(pos, e, emin), emin, emax)
  inv = core.pow2(-e, dt)  # exact: -e in [-emax, -emin], normal
  c = jnp.round(k * inv[..., None])  # exact scaling; ties to even
  c = jnp.where(finite[..., None], jnp.clip(c, -QMAX, QMAX), 0.0)
  e = jnp.where(finite, e, bad)
  return c.astype(jnp.int8), e.astype(edt)


def decode_keys(codes, exponents, dtype=jnp.float32) -> jax.Array:
  """k_hat = 2^e c, ``[..., d]`` (0 for a non-finite key's code)."""
  dt = core.compute_dtype(dtype)
  _, emin, emax, bad = _params(dt)
  e = jnp.asarray(exponents).astype(jnp.int32)
  e = jnp.clip(jnp.where(e == bad, 0, e), emin, emax)
  return codes.astype(dt) * core.pow2(e, dt)[..., None]


def code_dot(query, codes_t, *, loop: bool | None = None) -> jax.Array:
  """t = q.c for every key: ``[..., g, d]`` x ``[..., d, n]`` -> ``[..., g,
  n]``.

  Codes are stored d-major (``[..., d, n]``). On CPU a loop over the d
  components accumulates g x n products per step, reading each row of codes
  once (XLA:CPU runs an int8 einsum ~5-10x slower than the float32 one it
  replaces; this loop ~0.3x of it); elsewhere one einsum at HIGHEST
  precision (float32 products: the codes are small integers, exact in any
  float format). Any order of the d-term sum: the rounding bound of the
  module docstring covers it. ``loop``: force the loop (True) or the einsum
  (False); None picks by backend.
  """
  q = jnp.asarray(query)
  dt = q.dtype
  d = codes_t.shape[-2]
  if loop is None:
    loop = jax.default_backend() == "cpu"
  if not loop:
    return jnp.einsum(
      "...gd,...dn->...gn", q, codes_t.astype(dt), precision=_HIGHEST
    )
  shape = jnp.broadcast_shapes(q.shape[:-2], codes_t.shape[:-2])
  acc = jnp.zeros((*shape, q.shape[-2], codes_t.shape[-1]), dt)

  def body(c, acc):
    row = lax.dynamic_index_in_dim(codes_t, c, -2, keepdims=True)  # [..,1,n]
    qc = lax.dynamic_index_in_dim(q, c, -1, keepdims=True)  # [..., g, 1]
    return acc + qc * row.astype(dt)

  return lax.fori_loop(0, d, body, acc, unroll=min(d, 4))


def query_terms(query) -> tuple[jax.Array, jax.Array]:
  """(q in the compute dtype, h ||q||_1 + C) for ``code_bounds``.

  Args:
    query: ``[..., g, d]`` queries as given (subnormal flags read from
      their own dtype).

  Returns:
    ``(q, w)``: ``q`` ``[..., g, d]`` in the compute dtype and ``w``
    ``[..., g]``, the half-width of the code interval before the step 2^e
    (module docstring: h ||q||_1 + C, rounded up; +inf or NaN for a
    non-finite query).
  """
  q_in = jnp.asarray(query)
  dt = core.compute_dtype(q_in.dtype)
  d = q_in.shape[-1]
  eps, tiny = jnp.finfo(dt).eps, jnp.finfo(dt).tiny
  q = q_in.astype(dt)
  qf = core.flushed(q_in)  # [..., g]
  l1 = jnp.sum(jnp.abs(q), axis=-1)  # [..., g]; overflow: inf (honest)
  l1 = l1 * (1 + (d + 2) * eps)  # the sum's rounding
  h = 0.5 + QMAX * (d + 2) * eps + 4 * eps
  w = core.round_up(l1 * h)
  flush = d * tiny * (1.0 + 128.0 * qf.astype(dt))
  return q, core.round_up(w + flush)


def code_bounds(
  query, codes_t, exponents, *, scale, upper_only=False, loop=None
):
  """Sound per-key bounds l <= scale q.k <= u from the key codes.

  THEORY 3.5 (module docstring), for the EXACT logits of the keys as
  stored, at whatever precision the dot products run (the rounding is
  bounded for any order).

  Args:
    query: ``[..., g, d]`` queries (g sharing the keys, e.g. a GQA group).
    codes_t: ``[..., d, n]`` int8 codes, d-major (``encode_keys``,
      transposed).
    exponents: ``[..., n]`` exponents (``encode_keys``).
    scale: positive logit scale (float or traced 0-d array).
    upper_only: return ``u`` alone.
    loop: how the code products run (``code_dot``); None: by backend.

  Returns:
    ``(u, l)``: ``[..., g, n]`` in the compute dtype; u is +inf for a key
    marked non-finite (never -inf), l is -inf there. With ``upper_only``,
    ``u`` alone.
  """
  q, w = query_terms(query)
  t = code_dot(q, codes_t, loop=loop)  # [..., g, n]
  return bounds_from_products(
    t, w, exponents, scale=scale, upper_only=upper_only
  )


def bounds_from_products(t, w, exponents, *, scale, upper_only=False):
  """``code_bounds`` from the code products ``t`` = q.c ``[..., g, n]``
  (``code_dot``, or the same products computed in pieces, e.g. page by
  page: any order of each d-term sum) and ``w`` ``[..., g]``
  (``query_terms``)."""
  dt = t.dtype
  _, emin, emax, bad = _params(dt)
  e = jnp.asarray(exponents).astype(jnp.int32)[..., None, :]  # [..., 1, n]
  broken = e == bad
  step = core.pow2(jnp.clip(e, emin, emax), dt)
  scale = jnp.asarray(scale, dt)
  w = w[..., None]

  def side(x):  # x = t + w or -(t - w) = w - t, rounded up; scale 2^e x
    y = core.round_up(x * step)  # product: exact or under/overflow
    y = jnp.where(jnp.isnan(y) | (y == -jnp.inf), jnp.inf, y)
    out = core.round_up(scale * y)  # with the rounding of scale itself
    # -inf only from an overflow: the exact value is finite, not -inf.
    return jnp.where(out == -jnp.inf, jnp.inf, out)

  u = side(core.round_up(t + w))
  u = jnp.where(broken, jnp.inf, u)
  if upper_only:
    return u
  lo = -side(core.round_up(w - t))
  return u, jnp.where(broken, -jnp.inf, lo)
