"""Top-k attention on the XLA path, returning (output, Certificate).

THEORY 1 (one row), 6.5 (every call certified), 8.1/8.2 (Top-k prefill and
training). Layout as ``jax.nn.dot_product_attention``: query
``[batch, q_len, num_heads, head_dim]``, key/value
``[batch, kv_len, num_kv_heads, head_dim]`` with ``num_heads`` a multiple of
``num_kv_heads`` (GQA). Inside, everything is head-major
``[batch, kv_heads, group, q_len, kv_len]`` (DESIGN: layout matters most).

The kept set is chosen on stop-gradient logits (it is piecewise constant);
gradients flow through the softmax over the kept keys (THEORY 8.2).

Backends are looked up in ``IMPLEMENTATIONS`` (name -> callable with the
signature of ``xla_topk_attention``); the Pallas engineer registers
'pallas' with ``register_implementation``.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxtopk.selection import _certify
from jaxtopk.selection import _policies
from jaxtopk.selection import _select
from jaxtopk.selection._certificate import Certificate
from jaxtopk.theory import _tail

IMPLEMENTATIONS: dict[str | None, Callable] = {}


def register_implementation(name: str, fn: Callable) -> None:
  """Plugs a backend (e.g. 'pallas') into ``topk_attention``.

  Args:
    name: the value users pass as ``implementation=``.
    fn: callable ``fn(query, key, value, *, policy, mask, bias, is_causal,
      scale, values_bound) -> (output, Certificate)`` with the layout and
      semantics of ``topk_attention`` (already validated arguments).
  """
  IMPLEMENTATIONS[name] = fn


def causal_mask(q_len: int, kv_len: int) -> jax.Array:
  """``[q_len, kv_len]`` bool, True where key j <= query i.

  Same alignment as ``jax.nn.dot_product_attention(is_causal=True)``
  (top-left: query i sees keys 0..i).
  """
  return jnp.tril(jnp.ones((q_len, kv_len), bool))


def _check(query, key, value, mask, bias):
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
  h_kv = key.shape[2]
  if h % h_kv:
    raise ValueError(
      f"num_heads={h} must be a multiple of num_kv_heads={h_kv} (GQA)"
    )
  s = key.shape[1]
  for name, a in (("mask", mask), ("bias", bias)):
    if a is not None:
      try:
        jnp.broadcast_shapes(jnp.shape(a), (b, h, t, s))
      except ValueError:
        raise ValueError(
          f"{name} shape {jnp.shape(a)} must broadcast to [batch, heads,"
          f" q_len, kv_len] = {(b, h, t, s)}"
        ) from None


@functools.partial(
  jax.jit, static_argnames=("policy", "is_causal", "scale", "values_bound")
)
def xla_topk_attention_with_keep(
  query,
  key,
  value,
  *,
  policy,
  mask=None,
  bias=None,
  is_causal=False,
  scale=None,
  values_bound=True,
) -> tuple[jax.Array, Certificate, jax.Array]:
  """``xla_topk_attention`` that also returns the kept set.

  Returns:
    ``(output, certificate, keep)`` with ``keep`` ``[batch, num_heads,
    q_len, kv_len]`` bool (head-major), for tests and analysis.
  """
  b, t, h, d = query.shape
  s_len, h_kv = key.shape[1], key.shape[2]
  g = h // h_kv
  dt = _tail.compute_dtype(query.dtype)
  scale = 1.0 / (d**0.5) if scale is None else float(scale)
  if not scale > 0:
    raise ValueError(f"{scale=} must be > 0")
  q = query.astype(dt).reshape(b, t, h_kv, g, d).transpose(0, 2, 3, 1, 4)
  k = key.astype(dt).transpose(0, 2, 1, 3)  # [b, hk, s, d]
  v = value.astype(dt).transpose(0, 2, 1, 3)  # [b, hk, s, dv]
  logits = jnp.einsum("bkgtd,bksd->bkgts", q, k) * scale  # [b, hk, g, t, s]
  logits = logits.reshape(b, h, t, s_len)  # [b, h, t, s]
  if bias is not None:
    logits = logits + jnp.broadcast_to(bias, (b, h, t, s_len)).astype(dt)
  valid = jnp.ones((b, h, t, s_len), bool)
  if mask is not None:
    valid = valid & jnp.broadcast_to(jnp.asarray(mask, bool), valid.shape)
  if is_causal:
    valid = valid & causal_mask(t, s_len)

  # Rounding of the computed logits (THEORY 3.4): |error| <= delta with
  # delta = (d + 3) eps scale ||q|| max ||k|| (+ 2 eps |s| for the bias add);
  # log tau then needs 2 delta of slack (tail up, head down).
  sg = jax.lax.stop_gradient
  qn = jnp.sqrt(jnp.sum(sg(q) ** 2, -1)).reshape(b, h, t)  # [b, h, t]
  kn = jnp.max(jnp.sqrt(jnp.sum(sg(k) ** 2, -1)), -1)  # [b, hk]
  kn = jnp.repeat(kn, g, axis=1)[..., None]  # [b, h, 1]
  delta = _certify.logit_rounding(scale * qn * kn, d + 1, dt)
  if bias is not None:
    amax = jnp.max(jnp.where(valid, jnp.abs(sg(logits)), 0.0), -1)
    delta = delta + 2 * jnp.finfo(dt).eps * amax
  norms = None
  if values_bound:
    norms = _certify.value_norms(sg(v))  # [b, hk, s]
    norms = jnp.repeat(norms, g, axis=1)[:, :, None, :]  # [b, h, 1, s]
  sel = _select.select_with_slack(
    logits, policy, valid=valid, norms=norms, log_extra_slack=2 * delta
  )
  keep = sel.keep  # [b, h, t, s]

  # Softmax over the kept keys; gradients flow through kept logits only.
  m = jnp.max(jnp.where(keep, sg(logits), -jnp.inf), -1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(keep, jnp.exp(jnp.where(keep, logits, 0.0) - m), 0.0)
  denom = jnp.sum(p, -1, keepdims=True)  # [b, h, t, 1]
  p = p / jnp.where(denom > 0, denom, 1.0)
  p = p.reshape(b, h_kv, g, t, s_len)
  out = jnp.einsum("bkgts,bksd->bkgtd", p, v)  # [b, hk, g, t, dv]
  out = out.reshape(b, h, t, -1).transpose(0, 2, 1, 3)  # [b, t, h, dv]
  cert = jax.tree.map(lambda x: jnp.swapaxes(x, 1, 2), sel.certificate)
  return out.astype(query.dtype), cert, keep


def xla_topk_attention(query, key, value, **kwargs):
  """The XLA implementation of ``topk_attention`` (see there)."""
  out, cert, _ = xla_topk_attention_with_keep(query, key, value, **kwargs)
  return out, cert


IMPLEMENTATIONS[None] = xla_topk_attention
IMPLEMENTATIONS["xla"] = xla_topk_attention


def topk_attention(
  query,
  key,
  value,
  *,
  policy: _policies.Policy,
  mask=None,
  bias=None,
  is_causal: bool = False,
  scale: float | None = None,
  implementation: str | None = None,
  values_bound: bool = True,
) -> tuple[jax.Array, Certificate]:
  """Attention over the kept keys of each row, with a Certificate.

  THEORY 6.5 and 8.1/8.2. For every query row and head, ``policy`` chooses
  the kept keys H from the logits s = scale q.k + bias over the real keys
  (mask and causal), and the output is softmax over H times the values
  (P_hat of THEORY 1). The certificate bounds TV(P, P_hat) = tau, rounded up
  for the float rounding of the logits themselves, and (``values_bound``)
  ||Attn - Attn_k||_2 by THEORY 4.2/4.4. With ``Dense()`` (or any policy
  that keeps every key) this equals ``jax.nn.dot_product_attention``.

  Args:
    query: ``[batch, q_len, num_heads, head_dim]``.
    key: ``[batch, kv_len, num_kv_heads, head_dim]``; num_heads must be a
      multiple of num_kv_heads (GQA).
    value: ``[batch, kv_len, num_kv_heads, head_dim_v]``.
    policy: a selection policy (``Dense``, ``FixedK``, ``Ratio``,
      ``PowerLaw``, ``Certified``); Certified searches 'delta' and 'mc' run
      the exact search here (all logits are computed anyway in prefill), so
      ``Certified.bound`` has no effect here.
    mask: optional bool broadcastable to ``[batch, num_heads, q_len,
      kv_len]``, True = attend.
    bias: optional float additive bias, same broadcasting.
    is_causal: top-left aligned causal mask (as jax.nn).
    scale: logit scale, default 1/sqrt(head_dim); must be > 0.
    implementation: None or 'xla' (this path), or a registered backend such
      as 'pallas'.
    values_bound: whether the certificate carries output_error_bound.

  Returns:
    ``(output, certificate)``: output ``[batch, q_len, num_heads,
    head_dim_v]`` in query's dtype (zeros on a row with no real key), and a
    Certificate with arrays ``[batch, q_len, num_heads]`` (valid = False on
    a row with no real key).

  Raises:
    ValueError: on bad shapes, mismatched heads or a bad scale.
    NotImplementedError: for an implementation that is not registered.

  Example:
    >>> import jax, jaxtopk
    >>> x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
    >>> out, cert = jaxtopk.topk_attention(x, x, x, policy=jaxtopk.FixedK(3))
    >>> out.shape, cert.k_kept.shape
    ((1, 5, 2, 8), (1, 5, 2))
  """
  query, key, value = map(jnp.asarray, (query, key, value))
  if not isinstance(policy, _policies.Policy):
    raise TypeError(f"{policy=} must be a jaxtopk selection policy")
  _check(query, key, value, mask, bias)
  if implementation not in IMPLEMENTATIONS:
    if implementation == "pallas":
      raise NotImplementedError(
        "implementation='pallas' is not registered yet; use None or 'xla'"
      )
    raise ValueError(
      f"{implementation=} must be one of {sorted(map(str, IMPLEMENTATIONS))}"
    )
  return IMPLEMENTATIONS[implementation](
    query,
    key,
    value,
    policy=policy,
    mask=mask,
    bias=bias,
    is_causal=is_causal,
    scale=scale,
    values_bound=values_bound,
  )
