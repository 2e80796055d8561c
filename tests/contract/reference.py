"""THE float64 (80-bit) reference of attention and its certificates.

Every test that checks an attention output or a certificate against the
truth uses this module (the contract test, the kernel and parallel tests).
Written from the definitions (THEORY 1, 2.1, 4.1), independently of
jaxtopk's code:

- logits s_j = scale q.k_j + bias_j of the inputs AS STORED (bfloat16,
  float16 and subnormal values included: this is the exact value the
  certificate speaks about, not what a CPU that flushes subnormals
  computes), in extended precision (``np.longdouble``, 80-bit on x86:
  products of float32 values are exact, sums of a few terms are off by
  ~1e-19 relative);
- the real keys of a row: mask True and logit > -inf (a -inf logit is a
  key of zero mass);
- P = softmax over the real keys, tau(H) = P(real \\ H), Attn = sum P v,
  Attn_k = P renormalised on H, times v, and ||Attn - Attn_k||.

Layout: head-major, ``q [..., t, d]``, ``k [..., n, d]``, ``v [..., n, e]``
with the leading axes broadcast (repeat kv heads for GQA first, e.g. with
``repeat_kv``). Helpers convert from the jax.nn layout.
"""

import numpy as np

LD = np.longdouble


def as_ld(x) -> np.ndarray:
  """Exact extended-precision copy of a float array (any dtype)."""
  x = np.asarray(x)
  if x.dtype.kind == "V" or str(x.dtype) in ("bfloat16", "float16"):
    x = x.astype(np.float32)  # exact: both embed in float32
  return np.asarray(x.astype(np.float64), LD)


def repeat_kv(x, num_heads: int, axis: int = 1) -> np.ndarray:
  """Repeats kv heads ``[b, h_kv, ...]`` to ``num_heads`` query heads (GQA)."""
  x = np.asarray(x)
  return np.repeat(x, num_heads // x.shape[axis], axis=axis)


def head_major(q, k, v):
  """jax.nn layout ``[b, t, h, d]`` -> head-major ``[b, h, t, d]`` (GQA
  repeated), as extended-precision arrays."""
  q, k, v = (np.swapaxes(as_ld(x), 1, 2) for x in (q, k, v))
  h = q.shape[1]
  return q, repeat_kv(k, h), repeat_kv(v, h)


def logits(q, k, scale, bias=None) -> np.ndarray:
  """``[..., t, n]`` exact logits scale q.k (+ bias) in extended precision.

  Args:
    q: ``[..., t, d]``.
    k: ``[..., n, d]``.
    scale: the logit scale (a Python float: the exact value used).
    bias: optional, broadcastable to ``[..., t, n]`` (-inf allowed).
  """
  q, k = as_ld(q), as_ld(k)
  with np.errstate(over="ignore", invalid="ignore"):
    s = np.einsum("...td,...nd->...tn", q, k) * LD(scale)
    if bias is not None:
      s = s + as_ld(bias)
  return s


def real_keys(s, mask=None) -> np.ndarray:
  """``[..., t, n]`` bool: mask True and logit > -inf."""
  real = np.asarray(s) > -np.inf
  if mask is not None:
    real = real & np.broadcast_to(np.asarray(mask, bool), real.shape)
  return real


def probs(s, real) -> np.ndarray:
  """Softmax over the real keys of each row (0 elsewhere; 0 rows if none)."""
  s = np.asarray(s, LD)
  real = np.broadcast_to(real, s.shape)
  m = np.max(np.where(real, s, -np.inf), axis=-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0)
  with np.errstate(over="ignore", invalid="ignore"):
    w = np.where(real, np.exp(np.where(real, s - m, -np.inf)), 0)
    z = np.sum(w, axis=-1, keepdims=True)
    return np.where(z > 0, w / np.where(z > 0, z, 1), 0)


def tau(p, keep, real) -> np.ndarray:
  """``[..., t]`` dropped mass P(real \\ keep) (THEORY 2.1)."""
  return np.sum(np.where(real & ~np.asarray(keep, bool), p, 0), axis=-1)


def attend(p, v) -> np.ndarray:
  """``[..., t, e]`` sum_j p_j v_j in extended precision.

  Keys of weight 0 contribute nothing, even where their value is not finite
  (no 0 * NaN); a non-finite value of weight > 0 makes its output NaN.
  """
  p, v = np.asarray(p, LD), as_ld(v)
  fin = np.isfinite(v)
  with np.errstate(over="ignore", invalid="ignore"):
    out = np.einsum("...tn,...ne->...te", p, np.where(fin, v, 0))
    bad = np.einsum("...tn,...ne->...te", (p > 0).astype(LD), (~fin).astype(LD))
  return np.where(bad > 0, np.nan, out)


def truncated(p, keep) -> np.ndarray:
  """P renormalised on the kept set (zeros where nothing is kept)."""
  ph = np.where(keep, p, 0)
  z = np.sum(ph, axis=-1, keepdims=True)
  return np.where(z > 0, ph / np.where(z > 0, z, 1), 0)


def norm(x) -> np.ndarray:
  """``[...]`` Euclidean norm over the last axis, extended precision."""
  x = np.asarray(x, LD)
  m = np.max(np.abs(x), axis=-1, keepdims=True)
  m = np.where(m > 0, m, 1)
  with np.errstate(over="ignore", invalid="ignore"):
    return m[..., 0] * np.sqrt(np.sum((x / m) ** 2, axis=-1))


class Truth:
  """Exact quantities of one attention call (any leading shape ``[...]``).

  Attributes:
    s: ``[..., t, n]`` exact logits.
    real: ``[..., t, n]`` real keys (mask and logit > -inf).
    p: ``[..., t, n]`` exact softmax over the real keys.
    attn: ``[..., t, e]`` exact dense attention (None without values).
  """

  def __init__(self, q, k, v=None, *, scale, mask=None, bias=None):
    self.s = logits(q, k, scale, bias)
    self.real = real_keys(self.s, mask)
    self.p = probs(self.s, self.real)
    self.v = None if v is None else as_ld(v)
    self.attn = None if v is None else attend(self.p, self.v)

  @property
  def n_real(self) -> np.ndarray:
    """``[..., t]`` number of real keys of each row."""
    return np.sum(self.real, axis=-1)

  def tau(self, keep) -> np.ndarray:
    """``[..., t]`` exact dropped mass of the kept set ``keep``."""
    return tau(self.p, keep, self.real)

  def kept_attention(self, keep) -> np.ndarray:
    """``[..., t, e]`` exact Attn_k of the kept set."""
    return attend(truncated(self.p, keep & self.real), self.v)

  def output_error(self, keep) -> np.ndarray:
    """``[..., t]`` exact ||Attn - Attn_k|| of the kept set.

    By THEORY 4.1, Attn - Attn_k = tau (mu_T - mu_H) with mu_T, mu_H the
    softmax means of the dropped and kept values: exactly 0 when nothing
    real is dropped, and accurate where subtracting two outputs is not.
    """
    keep = np.asarray(keep, bool) & self.real
    tail = self.real & ~keep
    mu_t = attend(truncated(self.p, tail), self.v)
    mu_h = attend(truncated(self.p, keep), self.v)
    t = tau(self.p, keep, self.real)
    with np.errstate(over="ignore", invalid="ignore"):
      return np.where(t > 0, t * norm(mu_t - mu_h), 0)


def kept_truth(q, k, v, keep, visible, scale):
  """Exact tau, ||Attn - Attn_k|| and real-key counts of a kept set.

  Head-major with GQA: q ``[b, h, t, d]``, k / v ``[b, h_kv, n, .]``
  (repeated to h heads here), keep ``[b, h, t, n]`` and visible
  (broadcastable) bool.

  Returns:
    (tau ``[b, h, t]``, output error ``[b, h, t]``, n_real ``[b, h, t]``).
  """
  h = np.shape(q)[1]
  t = Truth(q, repeat_kv(k, h), repeat_kv(v, h), scale=scale, mask=visible)
  keep = np.asarray(keep, bool)
  return (
    np.asarray(t.tau(keep), np.float64),
    np.asarray(t.output_error(keep), np.float64),
    t.n_real,
  )


def kept_attention_grads(q, k, v, keep, ct, *, scale, mask=None):
  """float64 gradients of sum(ct * Attn_k) w.r.t. (q, k, v) for a FIXED set.

  THEORY 8.2: the kept set is piecewise constant, so the gradient of Top-k
  attention is that of softmax attention over the kept keys. Head-major
  inputs with equal heads (repeat kv heads first, then sum the key and
  value gradients over each group: ``sum_groups``).

  Returns:
    (dq, dk, dv) float64 numpy arrays shaped like q, k, v.
  """
  import jax
  import jax.numpy as jnp

  keep = np.asarray(keep, bool)
  if mask is not None:
    keep = keep & np.broadcast_to(np.asarray(mask, bool), keep.shape)

  def f(q, k, v):
    s = jnp.einsum("...td,...nd->...tn", q, k) * scale
    s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    w = jnp.where(keep, jnp.exp(s - m), 0.0)
    z = jnp.sum(w, axis=-1, keepdims=True)
    p = w / jnp.where(z > 0, z, 1.0)
    return jnp.sum(jnp.einsum("...tn,...ne->...te", p, v) * ct)

  with jax.enable_x64(True):
    args = [jnp.asarray(np.asarray(as_ld(x), np.float64)) for x in (q, k, v)]
    ct = jnp.asarray(np.asarray(as_ld(ct), np.float64))
    g = jax.grad(f, argnums=(0, 1, 2))(*args)
    return tuple(np.asarray(x, np.float64) for x in g)


def sum_groups(x, num_kv_heads: int, axis: int = 1) -> np.ndarray:
  """Sums a ``[b, h, ...]`` gradient over GQA groups: ``[b, h_kv, ...]``."""
  x = np.asarray(x)
  shape = list(x.shape)
  g = shape[axis] // num_kv_heads
  shape[axis : axis + 1] = [num_kv_heads, g]
  return np.sum(x.reshape(shape), axis=axis + 1)
