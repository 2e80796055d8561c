"""Argument checks shared by every attention path (a documented internal API).

The XLA prefill and decode, the Pallas backends, the sharded paths and the
Flax layers call these before tracing their math, so that bad input gets the
same clear error (naming the argument and its value) everywhere, eagerly and
under ``jax.jit`` alike (every check reads only shapes, dtypes and Python
values, which are static under jit).

Defined results (not errors), the same on every path:

- ``q_len = 0``: an empty output ``[batch, 0, num_heads, head_dim_v]`` and a
  Certificate with arrays ``[batch, 0, num_heads]`` (``empty_result``).
- ``kv_len = 0`` (no key at all): zero output and an invalid certificate on
  every row (valid = False, float fields NaN, k_kept = 0): like a row whose
  keys are all masked (``empty_result``).
- A traced ``scale`` (e.g. a learned temperature under jit) is accepted:
  ``check_scale`` returns it as a 0-d array, and paths pass it to their jitted
  math as a DYNAMIC argument (never static). Its value cannot be checked at
  trace time: rows computed with a scale that is not finite and at least
  ``core.MIN_SCALE`` (float32's smallest normal) are invalid (``scale_ok``
  feeds ``core.row_valid``). A static scale below it is refused.
- Row validity (NaN / inf logits or values, -inf bias, all-masked rows) is
  the rule of ``jaxtopk.selection.core`` (``core.row_valid``): a -inf logit
  (``bias=-inf``) is a key of zero mass, as in
  ``jax.nn.dot_product_attention``; a row whose every key is masked or -inf
  is invalid; NaN / inf in the values of a real key makes its row invalid.

Names:

- ``AttentionDims``: the sizes of one attention call.
- ``check_qkv(query, key, value)``: dtypes and shapes (jax.nn layout).
- ``check_array(x, name)``: a real floating array, or TypeError.
- ``check_mask(mask, shape)``, ``check_bias(bias, shape)``.
- ``check_is_causal(is_causal)``: a Python bool.
- ``check_counts(x, name, batch, high)``: per-row counts (``num_steps`` of
  the cache appends, ``lengths`` of the index build): integers, ``[batch]``
  or a scalar, in [0, high] (checked when concrete; clipped when traced).
- ``check_seq_lengths(lengths, name, dims)``: None or int ``[batch]``.
- ``check_window(local_window_size)``: None or ``(left, right)`` ints.
- ``check_scale(scale, head_dim)``: default, static float or dynamic array.
- ``scale_ok(scale)``: bool, for the validity rule of a dynamic scale.
- ``check_policy(policy, backend, supports)``: a Policy the backend honours
  (``selection.internal.check_policy``).
- ``check_rng(policy, rng)``: a PRNG key where the search needs one.
- ``check_decode_call(query, cache, policy, scale, rng)``: a decode call
  over a KVCache (query shape, scale, PRNG key), for its ops.
- ``empty_result(...)``: the defined result for q_len = 0 or kv_len = 0.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxtopk.selection import Certificate
from jaxtopk.selection import core
from jaxtopk.selection.internal import check_policy as check_policy


@dataclasses.dataclass(frozen=True)
class AttentionDims:
  """Sizes of one attention call (jax.nn layout).

  Attributes:
    batch: b.
    q_len: t, query positions (may be 0).
    num_heads: h.
    head_dim: d, shared by queries and keys.
    kv_len: s, key positions (may be 0).
    num_kv_heads: h_kv; h is a multiple of it (GQA).
    v_dim: d_v.
  """

  batch: int
  q_len: int
  num_heads: int
  head_dim: int
  kv_len: int
  num_kv_heads: int
  v_dim: int

  @property
  def group(self) -> int:
    """Query heads per kv head."""
    return self.num_heads // self.num_kv_heads

  @property
  def logits_shape(self) -> tuple[int, int, int, int]:
    """``(batch, num_heads, q_len, kv_len)``, the shape masks broadcast to."""
    return (self.batch, self.num_heads, self.q_len, self.kv_len)

  @property
  def empty(self) -> bool:
    """Whether the call has no query row or no key (``empty_result``)."""
    return self.q_len == 0 or self.kv_len == 0


def check_array(x, name: str) -> jax.Array:
  """``x`` as a jnp array of a real floating dtype, or a clear TypeError.

  Integer and bool inputs would be truncated (silent garbage with a zero
  bound) and complex ones fail deep inside; both are refused here.
  """
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    raise TypeError(
      f"{name} must be real floating; got {name}.dtype={x.dtype} (complex"
      " attention is not supported)"
    )
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(
      f"{name} must be real floating (float32, bfloat16, float16, float64);"
      f" got {name}.dtype={x.dtype}"
    )
  return x


def check_qkv(query, key, value) -> tuple[jax.Array, ...]:
  """Checks query/key/value of the jax.nn layout; returns them and the dims.

  Args:
    query: ``[batch, q_len, num_heads, head_dim]``.
    key: ``[batch, kv_len, num_kv_heads, head_dim]``.
    value: ``[batch, kv_len, num_kv_heads, head_dim_v]``.

  Returns:
    ``(query, key, value, dims)``: the inputs as jnp arrays and an
    ``AttentionDims``.

  Raises:
    TypeError: a non-floating or complex dtype (named).
    ValueError: a wrong rank, mismatched batch / kv_len / heads / head_dim,
      num_heads not a multiple of num_kv_heads, or a zero head dimension.
  """
  query = check_array(query, "query")
  key = check_array(key, "key")
  value = check_array(value, "value")
  for name, a in (("query", query), ("key", key), ("value", value)):
    if a.ndim != 4:
      raise ValueError(
        f"{name} must be [batch, seq, heads, head_dim]; got {name}.shape="
        f"{a.shape}"
      )
  b, t, h, d = query.shape
  if key.shape[0] != b or value.shape[0] != b:
    raise ValueError(
      f"batch sizes differ: {query.shape=}, {key.shape=}, {value.shape=}"
    )
  if key.shape[:3] != value.shape[:3]:
    raise ValueError(
      f"key and value must share [batch, kv_len, kv_heads]; got {key.shape=}"
      f" and {value.shape=}"
    )
  if key.shape[3] != d:
    raise ValueError(f"head_dim differs: {query.shape=} but {key.shape=}")
  if d == 0:
    raise ValueError(f"head_dim must be >= 1; got {query.shape=}")
  h_kv = key.shape[2]
  if h_kv == 0 or h == 0 or h % h_kv:
    raise ValueError(
      f"num_heads={h} must be a multiple of num_kv_heads={h_kv} (GQA), both"
      " >= 1"
    )
  dims = AttentionDims(
    batch=b,
    q_len=t,
    num_heads=h,
    head_dim=d,
    kv_len=key.shape[1],
    num_kv_heads=h_kv,
    v_dim=value.shape[3],
  )
  return query, key, value, dims


def check_mask(mask, shape, name: str = "mask") -> jax.Array | None:
  """A boolean mask broadcastable to ``shape`` (True = attend), or None.

  Raises:
    TypeError: a mask that is not boolean (an additive float mask belongs
      in ``bias=``; an integer mask is ambiguous).
    ValueError: a shape that does not broadcast.
  """
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_:
    raise TypeError(
      f"{name} must be boolean (True = attend); got {name}.dtype="
      f"{mask.dtype}. An additive mask goes in bias=."
    )
  _check_broadcast(mask, shape, name)
  return mask


def check_bias(bias, shape) -> jax.Array | None:
  """A real floating bias broadcastable to ``shape``, or None.

  ``-inf`` entries are allowed: such a key has zero mass (not an error).
  """
  if bias is None:
    return None
  bias = check_array(bias, "bias")
  _check_broadcast(bias, shape, "bias")
  return bias


def _check_broadcast(x, shape, name):
  try:
    jnp.broadcast_shapes(jnp.shape(x), tuple(shape))
  except ValueError:
    raise ValueError(
      f"{name} shape {jnp.shape(x)} must broadcast to [batch, heads, q_len,"
      f" kv_len] = {tuple(shape)}"
    ) from None
  if len(jnp.shape(x)) > len(shape):
    raise ValueError(
      f"{name} has rank {len(jnp.shape(x))} > {len(shape)}: {jnp.shape(x)}"
    )


def check_is_causal(is_causal) -> bool:
  """``is_causal`` as a Python bool; anything else (e.g. 'no') is refused."""
  if isinstance(is_causal, bool | np.bool_):
    return bool(is_causal)
  raise TypeError(f"is_causal={is_causal!r} must be a bool (True or False)")


def check_counts(x, name: str, batch: int, high: int) -> jax.Array:
  """Per-row counts as ``[batch]`` int32: ``num_steps``, ``lengths``.

  Accepts a Python int, a numpy or JAX integer scalar (the same count for
  every row) or a ``[batch]`` integer array. The range [0, high] is checked
  on concrete values, in their own dtype (an int64 2**32 + 1 would wrap in
  int32); a traced array (under jit) cannot be checked and is clipped to
  it.

  Raises:
    TypeError: a bool, float or other non-integer count (named).
    ValueError: a shape other than ``[batch]`` or ``[]``, or a concrete
      count outside [0, high].
  """
  if isinstance(x, bool | np.bool_) or x is None:
    raise TypeError(f"{name}={x!r} must be integers (a count per row)")
  if not isinstance(x, jax.Array):
    x = np.asarray(x)
  if x.dtype == np.bool_ or not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(
      f"{name} must be integers (a count per row); got {name}.dtype={x.dtype}"
    )
  if x.shape not in ((), (batch,)):
    raise ValueError(
      f"{name} must be [batch={batch}] (or a scalar); got {name}.shape="
      f"{x.shape}"
    )
  if not isinstance(x, jax.core.Tracer):
    v = np.asarray(x)
    if np.any(v < 0) or np.any(v > high):
      raise ValueError(f"{name}={v.tolist()} must be in [0, {high}]")
    return jnp.broadcast_to(jnp.asarray(v.astype(np.int32)), (batch,))
  x = jnp.clip(x, 0, high).astype(jnp.int32)
  return jnp.broadcast_to(x, (batch,))


def check_seq_lengths(
  lengths, name: str, dims: AttentionDims, unbatched: bool = False
) -> jax.Array | None:
  """``query_seq_lengths`` / ``key_value_seq_lengths``: int ``[batch]``.

  As ``jax.nn.dot_product_attention``; any integer dtype is accepted (jax.nn
  wants int32) and an unbatched call also takes a scalar. The values are not
  checked (they may be traced): a length past the sequence changes nothing,
  a length <= 0 hides every position.

  Returns:
    None, or the lengths as int32 ``[batch]``.

  Raises:
    TypeError: a dtype that is not an integer.
    ValueError: a shape other than ``[batch]``.
  """
  if lengths is None:
    return None
  if not isinstance(lengths, jax.Array):
    v = np.asarray(lengths)
    if np.issubdtype(v.dtype, np.integer):
      # Concrete lengths are clipped in their own dtype before the int32
      # cast: an int64 2**32 + 1 would otherwise wrap to 1.
      v = np.clip(v, -1, np.iinfo(np.int32).max).astype(np.int32)
    lengths = v
  lengths = jnp.asarray(lengths)
  if not jnp.issubdtype(lengths.dtype, jnp.integer) or lengths.dtype == bool:
    raise TypeError(
      f"{name} must be integer sequence lengths; got {name}.dtype="
      f"{lengths.dtype}"
    )
  if unbatched and lengths.ndim == 0:
    lengths = lengths.reshape(1)
  if lengths.shape != (dims.batch,):
    raise ValueError(
      f"{name} must have shape [batch] = ({dims.batch},); got {name}.shape="
      f"{lengths.shape}"
    )
  return lengths.astype(jnp.int32)


def check_window(local_window_size) -> tuple[int, int] | None:
  """``local_window_size``: None, an int, or ``(left, right)`` ints >= 0.

  Query i sees keys i - left .. i + right (``jax.nn.dot_product_attention``
  semantics; one int is the symmetric window).

  Raises:
    TypeError: not an int or a pair of ints (bools refused).
    ValueError: a negative size.
  """
  if local_window_size is None:
    return None
  w = local_window_size
  is_int = lambda x: (
    isinstance(x, int | np.integer)
    and not isinstance(  # noqa: E731
      x, bool | np.bool_
    )
  )
  if is_int(w):
    w = (w, w)
  if not (isinstance(w, tuple | list) and len(w) == 2 and all(map(is_int, w))):
    raise TypeError(
      f"local_window_size={local_window_size!r} must be an int or a pair of"
      " ints (left, right)"
    )
  left, right = int(w[0]), int(w[1])
  if left < 0 or right < 0:
    raise ValueError(
      f"local_window_size={local_window_size!r}: sizes must be >= 0"
    )
  return left, right


def check_scale(scale, head_dim: int):
  """The logit scale: 1/sqrt(head_dim) by default.

  A Python or numpy real number must be finite and at least
  ``core.MIN_SCALE`` (float32's smallest normal, 1.18e-38: a subnormal scale
  reads 0 on a CPU and no certificate covers it) and is returned as a
  Python float. A JAX array (concrete or traced, e.g. a learned
  temperature) must be a real floating scalar; it is returned as a 0-d
  array and must reach the path's jitted math as a DYNAMIC argument; its
  value is checked per row at run time (``scale_ok``: rows are invalid
  where it is not finite and >= ``core.MIN_SCALE``).

  Raises:
    TypeError: a bool, complex, non-number or non-scalar array.
    ValueError: a Python / numpy scale that is not finite, or below
      ``core.MIN_SCALE`` (0 and negative scales included).
  """
  if scale is None:
    return 1.0 / math.sqrt(head_dim)
  if isinstance(scale, np.ndarray):
    if scale.ndim != 0:
      raise TypeError(f"scale must be a scalar; got {scale.shape=}")
    scale = scale[()]
  if isinstance(scale, jax.Array):
    if scale.ndim != 0:
      raise TypeError(f"scale must be a scalar; got {scale.shape=}")
    check_array(scale, "scale")
    return scale
  if isinstance(scale, bool | np.bool_) or not isinstance(
    scale, int | float | np.integer | np.floating
  ):
    raise TypeError(f"scale={scale!r} must be a real number")
  value = float(scale)
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"scale={value!r} must be finite and > 0")
  if value < core.MIN_SCALE:
    raise ValueError(
      f"scale={value!r} is below float32's smallest normal"
      f" {core.MIN_SCALE!r}: a CPU reads it as 0 and no certificate covers"
      " it"
    )
  return value


def scale_ok(scale) -> jax.Array | bool:
  """``core.scale_ok``: True for a (checked) float; for an array, whether it
  is finite and >= ``core.MIN_SCALE``."""
  return core.scale_ok(scale)


def check_decode_call(query, cache, policy, scale, rng):
  """The checks of a decode call over a KVCache, shared by its ops: the
  query ``[batch, q_len, num_heads, head_dim]`` (q_len >= 1; an op that
  attends one step refuses q_len > 1 through the registry) against the
  cache's ``[batch, num_kv_heads, max_len, head_dim]`` keys, the scale,
  the PRNG key.

  Returns:
    ``(scale, rng)``: ``check_scale``'s scale and ``check_rng``'s key.

  Raises:
    ValueError: a query shape that does not fit the cache, a bad scale,
      MC-Search without a key.
  """
  b, hk, _, d = cache.keys.shape
  if (
    query.ndim != 4
    or query.shape[0] != b
    or query.shape[1] < 1
    or query.shape[3] != d
  ):
    raise ValueError(
      f"query must be [batch={b}, q_len >= 1, num_heads, head_dim={d}];"
      f" got {query.shape=}"
    )
  if query.shape[2] == 0 or query.shape[2] % hk:
    raise ValueError(
      f"num_heads={query.shape[2]} must be a positive multiple of"
      f" num_kv_heads={hk}"
    )
  return check_scale(scale, d), check_rng(policy, rng)


def check_rng(policy, rng):
  """The PRNG key a random search needs (MC-Search), or a clear error.

  Returns:
    ``rng``, or ``jax.random.key(0)`` for a deterministic policy with no
    key (unused by it).
  """
  search = getattr(policy, "search", None)
  if search is not None and search.needs_rng and rng is None:
    raise ValueError(f"Certified.search={search!r} needs a PRNG key: pass rng=")
  return jax.random.key(0) if rng is None else rng


def empty_result(
  dims: AttentionDims, dtype, *, values_bound: bool = True
) -> tuple[jax.Array, Certificate]:
  """The defined result of a call with ``q_len = 0`` or ``kv_len = 0``.

  Returns:
    ``(output, certificate)``: zeros ``[batch, q_len, num_heads, v_dim]``
    in ``dtype``; a Certificate with arrays ``[batch, q_len, num_heads]``,
    every row invalid (valid False, tv_bound NaN, k_kept 0, keys_scored 0;
    output_error_bound NaN, or None without ``values_bound``).
  """
  shape = (dims.batch, dims.q_len, dims.num_heads)
  dt = core.compute_dtype(dtype)
  zero = jnp.zeros(shape, dt)
  cert = core.finish_certificate(
    zero,
    jnp.zeros(shape, bool),
    k_kept=0,
    keys_scored=0,
    head_norm=zero if values_bound else None,
    tail_norm=zero if values_bound else None,
  )
  out = jnp.zeros((*shape, dims.v_dim), dtype)
  return out, cert
