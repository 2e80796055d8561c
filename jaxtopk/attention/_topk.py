"""Top-k attention on the XLA path, returning (output, Certificate).

THEORY 1 (one row), 6.5 (every call certified), 8.1/8.2 (Top-k prefill and
training). Layout as ``jax.nn.dot_product_attention``: query
``[batch, q_len, num_heads, head_dim]``, key/value
``[batch, kv_len, num_kv_heads, head_dim]`` with ``num_heads`` a multiple of
``num_kv_heads`` (GQA). The XLA implementation is the blockwise prefill of
``_prefill`` (query tiles against key blocks; it never materialises the
``[q_len, kv_len]`` logits of the whole call and skips key blocks certified
negligible under Delta-Search).

The kept set is chosen on stop-gradient logits (it is piecewise constant);
gradients flow through the softmax over the kept keys (THEORY 8.2).

Backends are looked up in ``IMPLEMENTATIONS`` (name -> callable with the
signature of ``xla_topk_attention``); the Pallas engineer registers
'pallas' with ``register_implementation``. Every argument is checked here
(``attention.checks``) before any backend runs.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxtopk.attention import _prefill
from jaxtopk.attention import checks
from jaxtopk.selection import Certificate
from jaxtopk.selection import Policy

IMPLEMENTATIONS: dict[str | None, Callable] = {}

# The name of this path in capability errors.
BACKEND = "topk_attention(implementation='xla')"


def register_implementation(name: str, fn: Callable) -> None:
  """Plugs a backend (e.g. 'pallas') into ``topk_attention``.

  Args:
    name: the value users pass as ``implementation=``.
    fn: callable ``fn(query, key, value, *, policy, mask, bias, is_causal,
      scale, values_bound) -> (output, Certificate)`` with the layout and
      semantics of ``topk_attention`` (arguments already checked; ``scale``
      a Python float, or a 0-d array for a traced scale).
  """
  IMPLEMENTATIONS[name] = fn


def causal_mask(q_len: int, kv_len: int) -> jax.Array:
  """``[q_len, kv_len]`` bool, True where key j <= query i.

  Same alignment as ``jax.nn.dot_product_attention(is_causal=True)``
  (top-left: query i sees keys 0..i).
  """
  return jnp.tril(jnp.ones((q_len, kv_len), bool))


@functools.partial(
  jax.jit,
  static_argnames=(
    "policy",
    "is_causal",
    "static_scale",
    "values_bound",
    "block_sizes",
    "return_keep",
  ),
)
def _xla(
  query,
  key,
  value,
  mask,
  bias,
  dynamic_scale,
  *,
  policy,
  is_causal,
  static_scale,
  values_bound,
  block_sizes,
  return_keep,
):
  if static_scale is not None:
    scale, scale_ok = static_scale, True
  else:
    scale, scale_ok = dynamic_scale, checks.scale_ok(dynamic_scale)
  return _prefill.blockwise_attention(
    query,
    key,
    value,
    policy=policy,
    mask=mask,
    bias=bias,
    is_causal=is_causal,
    scale=scale,
    scale_ok=scale_ok,
    values_bound=values_bound,
    block_sizes=block_sizes,
    return_keep=return_keep,
  )


def _call_xla(query, key, value, *, scale, return_keep, block_sizes, **kw):
  static = scale if isinstance(scale, float) else None
  dynamic = None if static is not None else scale
  return _xla(
    query,
    key,
    value,
    kw.pop("mask"),
    kw.pop("bias"),
    dynamic,
    static_scale=static,
    return_keep=return_keep,
    block_sizes=block_sizes,
    **kw,
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
  block_sizes=None,
) -> tuple[jax.Array, Certificate, jax.Array]:
  """``topk_attention`` (XLA) that also returns the kept set.

  For tests and analysis at small sizes: the kept set is as large as the
  logits.

  Returns:
    ``(output, certificate, keep)`` with ``keep`` ``[batch, num_heads,
    q_len, kv_len]`` bool (head-major).
  """
  args = _checked(query, key, value, policy, mask, bias, is_causal, scale)
  query, key, value, dims, mask, bias, is_causal, scale = args
  checks.check_policy(policy, BACKEND, _prefill.SUPPORTS)
  if dims.empty:
    out, cert = checks.empty_result(
      dims, query.dtype, values_bound=values_bound
    )
    return out, cert, jnp.zeros(dims.logits_shape, bool)
  return _call_xla(
    query,
    key,
    value,
    policy=policy,
    mask=mask,
    bias=bias,
    is_causal=is_causal,
    scale=scale,
    values_bound=values_bound,
    block_sizes=block_sizes,
    return_keep=True,
  )


def xla_topk_attention(
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
  block_sizes=None,
):
  """The XLA implementation of ``topk_attention`` (checked arguments).

  ``block_sizes`` (``attention._prefill.BlockSizes``) tunes the tiling.
  """
  checks.check_policy(policy, BACKEND, _prefill.SUPPORTS)
  if scale is None:
    scale = checks.check_scale(None, query.shape[-1])
  return _call_xla(
    query,
    key,
    value,
    policy=policy,
    mask=mask,
    bias=bias,
    is_causal=is_causal,
    scale=scale,
    values_bound=values_bound,
    block_sizes=block_sizes,
    return_keep=False,
  )


IMPLEMENTATIONS[None] = xla_topk_attention
IMPLEMENTATIONS["xla"] = xla_topk_attention


def _checked(query, key, value, policy, mask, bias, is_causal, scale):
  """Every argument checked (``attention.checks``), same under jit."""
  if not isinstance(policy, Policy):
    raise TypeError(
      f"{policy=} is not a selection policy; expected Dense, FixedK, Ratio,"
      " PowerLaw or Certified"
    )
  query, key, value, dims = checks.check_qkv(query, key, value)
  mask = checks.check_mask(mask, dims.logits_shape)
  bias = checks.check_bias(bias, dims.logits_shape)
  is_causal = checks.check_is_causal(is_causal)
  scale = checks.check_scale(scale, dims.head_dim)
  return query, key, value, dims, mask, bias, is_causal, scale


def topk_attention(
  query,
  key,
  value,
  *,
  policy: Policy,
  mask=None,
  bias=None,
  is_causal: bool = False,
  scale=None,
  implementation: str | None = None,
  values_bound: bool = True,
) -> tuple[jax.Array, Certificate]:
  """Attention over the kept keys of each row, with a Certificate.

  THEORY 6.5 and 8.1/8.2. For every query row and head, ``policy`` chooses
  the kept keys H from the logits s = scale q.k + bias over the real keys
  (mask and causal; a -inf logit is a key of zero mass), and the output is
  softmax over H times the values (P_hat of THEORY 1). The certificate
  bounds TV(P, P_hat) = tau, rounded up for the float rounding of the logits
  themselves (THEORY 10), and (``values_bound``) ||Attn - Attn_k||_2 by
  THEORY 4.2/4.4. With ``Dense()`` (or any policy that keeps every key) this
  equals ``jax.nn.dot_product_attention``.

  The XLA path (``implementation=None`` or 'xla') is blockwise
  (``attention._prefill``): memory O(block_q x kv_len) per query tile, never
  the ``[q_len, kv_len]`` logits of the whole call. Which keys it keeps:

  - ``Dense``, ``FixedK``, ``Ratio``, ``PowerLaw``: every key is scored; the
    kept set is that of ``jaxtopk.select`` on the logits (the ``topk``
    largest, ties broken by increasing key index).
  - ``Certified(eps)`` (search ``Exact``): every key is scored; the fewest
    keys whose dropped mass is certified <= eps (all keys tied at the
    threshold are kept), capped at ``max_topk``.
  - ``Certified(eps, 'delta')``: Delta-Search at query-tile granularity
    (THEORY 6.2): key blocks of ``block_size`` are scored in order of their
    box bound (THEORY 3.3) until the unscored mass fits the budget; blocks
    never scored are never multiplied by q or v; the kept set is minimal
    among the scored keys with the unscored bound counted as dropped (its
    excess is stated in ``attention._prefill``). ``keys_scored`` counts the
    q.k products.
  - ``Certified(eps, 'mc')`` and ``bound='lowrank'`` are refused by name
    (no PRNG key here; use ``certified_search`` or ``decode_attention``).

  Args:
    query: ``[batch, q_len, num_heads, head_dim]`` real floating.
    key: ``[batch, kv_len, num_kv_heads, head_dim]``; num_heads must be a
      multiple of num_kv_heads (GQA).
    value: ``[batch, kv_len, num_kv_heads, head_dim_v]``.
    policy: a selection policy (``Dense``, ``FixedK``, ``Ratio``,
      ``PowerLaw``, ``Certified``); fields a backend cannot honour are
      refused by name (``UnsupportedPolicyError``).
    mask: optional bool broadcastable to ``[batch, num_heads, q_len,
      kv_len]``, True = attend.
    bias: optional float additive bias, same broadcasting (-inf allowed: a
      key of zero mass).
    is_causal: top-left aligned causal mask (as jax.nn); a Python bool.
    scale: logit scale, default 1/sqrt(head_dim); a finite number >= float32's
      smallest normal (``core.MIN_SCALE``), or a 0-d JAX array (e.g. a
      learned temperature, traced under jit: rows are then invalid where it
      is not finite and >= ``core.MIN_SCALE``).
    implementation: None or 'xla' (this path), or a registered backend such
      as 'pallas'.
    values_bound: whether the certificate carries output_error_bound.

  Returns:
    ``(output, certificate)``: output ``[batch, q_len, num_heads,
    head_dim_v]`` in query's dtype (zeros on an invalid row), and a
    Certificate with arrays ``[batch, q_len, num_heads]`` (valid = False on
    a row with no real key of positive mass, a NaN or +inf logit, or a
    non-finite value among its real keys). q_len = 0 gives empty arrays;
    kv_len = 0 gives zeros and invalid rows (``checks.empty_result``).

  Raises:
    TypeError: a policy that is not a policy, non-floating or complex
      inputs, a mask that is not boolean, a non-bool ``is_causal``, a scale
      that is not a real number.
    ValueError: bad shapes, mismatched heads, a scale not finite or below
      float32's smallest normal, an unknown implementation.
    UnsupportedPolicyError: a policy field the backend cannot honour.
    NotImplementedError: 'pallas' when it is not registered.

  Example:
    >>> import jax, jaxtopk
    >>> x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
    >>> out, cert = jaxtopk.topk_attention(x, x, x, policy=jaxtopk.FixedK(3))
    >>> out.shape, cert.k_kept.shape
    ((1, 5, 2, 8), (1, 5, 2))
  """
  args = _checked(query, key, value, policy, mask, bias, is_causal, scale)
  query, key, value, dims, mask, bias, is_causal, scale = args
  if not isinstance(values_bound, bool):
    raise TypeError(f"values_bound={values_bound!r} must be a bool")
  if implementation not in IMPLEMENTATIONS:
    if implementation == "pallas":
      raise NotImplementedError(
        "implementation='pallas' is not registered yet; use None or 'xla'"
      )
    raise ValueError(
      f"{implementation=} must be one of {sorted(map(str, IMPLEMENTATIONS))}"
    )
  if implementation in (None, "xla"):
    checks.check_policy(policy, BACKEND, _prefill.SUPPORTS)
  if dims.empty:
    return checks.empty_result(dims, query.dtype, values_bound=values_bound)
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
