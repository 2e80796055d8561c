"""A drop-in ``attention_fn`` that runs certified Top-k attention.

``nnx.MultiHeadAttention(..., attention_fn=topk_attention_fn(FixedK(64)))`` and
``linen.MultiHeadDotProductAttention(..., attention_fn=...)`` switch an existing
model to Top-k attention (THEORY 8.1) without new modules or new parameters.
The math is ``jaxtopk.topk_attention``; this file only adapts Flax's calling
convention to it:

- Flax passes ``[batch..., length, heads, head_dim]`` with any number of batch
  axes (or none); ``topk_attention`` takes exactly one. Batch axes are
  flattened and restored, masks and biases broadcast to match.
- Flax masks are ``[batch..., heads|1, q_len, kv_len]``, float or bool, True
  (non-zero) = attend; they become bool masks with the same meaning.
- ``dtype`` promotes q, k, v as Flax's ``dot_product_attention`` does.
- The call's Certificate (``[batch..., q_len, heads]``) is sown into the
  calling module when Flax passes one (``sow_weights=True``), under the name
  ``'certificate'``: ``nnx.Intermediate`` for NNX, ``'intermediates'`` for
  Linen.

Attention-weight dropout is not supported: Top-k attention never forms the
weight matrix it would drop entries of. A call with ``dropout_rate > 0`` and
``deterministic=False`` raises instead of silently skipping dropout.
"""

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen
from flax import nnx
from flax.nnx.nn import dtypes

from jaxtopk.attention import registry
from jaxtopk.attention import topk_attention
from jaxtopk.selection import Certificate
from jaxtopk.selection import Policy
from jaxtopk.selection.internal import check_policy

CERTIFICATE_NAME = "certificate"


def check_implementation(implementation: Any) -> str | tuple[str, ...] | None:
  """``implementation`` (a sequence as a tuple: hashable), if every name is
  a registered implementation (``attention.registry``), else ValueError."""
  registry.names(implementation, "prefill")
  if isinstance(implementation, str) or implementation is None:
    return implementation
  return tuple(implementation)


def check_flax_shapes(query, key, value) -> None:
  """Flax's shape checks, with Flax's words, before any other.

  Raises:
    ValueError: ranks or batch axes differ, query and key head dims differ,
      key and value lengths differ, or a rank below 3.
  """
  shapes = f"{query.shape}, {key.shape}, {value.shape}"
  if not query.ndim == key.ndim == value.ndim:
    raise ValueError(
      f"q, k, v must have same rank, but got {query.ndim}, {key.ndim},"
      f" {value.ndim}."
    )
  if query.ndim < 3:
    raise ValueError(
      f"q, k, v must have rank >= 3 ([batch..., length, heads, head_dim]);"
      f" got shapes {shapes}."
    )
  if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
    raise ValueError(f"q, k, v batch dims must match, but got shapes {shapes}.")
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(
      f"q, k depths must match, but got {query.shape[-1]} and {key.shape[-1]}."
    )
  if key.shape[-3] != value.shape[-3]:
    raise ValueError(
      f"k, v lengths must match, but got {key.shape[-3]} and {value.shape[-3]}."
    )


def flatten_batch(x, batch_shape, ndim_tail):
  """Broadcasts ``x`` to ``batch_shape + tail`` and merges the batch axes."""
  if x is None:
    return None
  x = jnp.asarray(x)
  tail = x.shape[x.ndim - ndim_tail :] if x.ndim >= ndim_tail else None
  if tail is None:
    x = jnp.reshape(x, (1,) * (ndim_tail - x.ndim) + x.shape)
    tail = x.shape
  x = jnp.broadcast_to(x, batch_shape + tail)
  return jnp.reshape(x, (math.prod(batch_shape),) + tail)


def certified_attention(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  *,
  policy: Policy,
  mask: jax.Array | None = None,
  bias: jax.Array | None = None,
  is_causal: bool = False,
  dtype: Any = None,
  implementation: str | tuple[str, ...] | None = None,
  promote_dtype: Callable[..., Any] = dtypes.promote_dtype,
) -> tuple[jax.Array, Certificate]:
  """Top-k attention in Flax's layout, returning ``(output, Certificate)``.

  Args:
    query: ``[batch..., q_len, num_heads, head_dim]``.
    key: ``[batch..., kv_len, num_kv_heads, head_dim]``; ``num_kv_heads``
      divides ``num_heads`` (GQA).
    value: ``[batch..., kv_len, num_kv_heads, v_head_dim]``.
    policy: the selection policy (``jaxtopk.FixedK`` etc.).
    mask: broadcastable to ``[batch..., num_heads, q_len, kv_len]``; True or
      non-zero = attend.
    bias: additive logit bias, broadcastable like ``mask``.
    is_causal: apply a causal mask (query i sees keys j <= i).
    dtype: compute dtype for q, k, v (None: promote the inputs).
    implementation: ``'xla'``, ``'pallas'``, None (library default), or a
      sequence tried in order (``jaxtopk.topk_attention``).
    promote_dtype: Flax's dtype promotion function.

  Returns:
    ``output`` ``[batch..., q_len, num_heads, v_head_dim]`` and the call's
    Certificate with arrays ``[batch..., q_len, num_heads]``.
  """
  check_policy(policy)
  implementation = check_implementation(implementation)
  query, key, value = promote_dtype((query, key, value), dtype=dtype)
  check_flax_shapes(query, key, value)
  batch_shape = query.shape[:-3]
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
      mask = mask != 0
  q, k, v = (flatten_batch(x, batch_shape, 3) for x in (query, key, value))
  mask = flatten_batch(mask, batch_shape, 3)
  bias = flatten_batch(bias, batch_shape, 3)
  out, cert = _topk_attention(
    q,
    k,
    v,
    policy=policy,
    mask=mask,
    bias=bias,
    is_causal=is_causal,
    implementation=implementation,
  )
  out = jnp.reshape(out, batch_shape + out.shape[1:])
  cert = jax.tree.map(lambda x: jnp.reshape(x, batch_shape + x.shape[1:]), cert)
  return out, cert


# One compiled program per shape and policy: eager callers (a model run
# outside jit) pay one compilation instead of one per primitive; under an
# outer jit this inlines.
@functools.partial(
  jax.jit, static_argnames=("policy", "is_causal", "implementation")
)
def _topk_attention(q, k, v, *, policy, mask, bias, is_causal, implementation):
  """Calls ``jaxtopk.topk_attention`` on ``[batch, len, heads, dim]`` arrays."""
  return topk_attention(
    q,
    k,
    v,
    policy=policy,
    mask=mask,
    bias=bias,
    is_causal=is_causal,
    implementation=implementation,
  )


def sow_certificate(module: Any, cert: Certificate) -> None:
  """Sows ``cert`` into an NNX or Linen module under ``'certificate'``."""
  if isinstance(module, nnx.Module):
    module.sow(nnx.Intermediate, CERTIFICATE_NAME, cert)
  elif isinstance(module, linen.Module):
    module.sow("intermediates", CERTIFICATE_NAME, cert)
  elif module is not None:
    raise TypeError(f"module={module!r} must be a flax nnx or linen Module")


def topk_attention_fn(
  policy: Policy, *, implementation: str | tuple[str, ...] | None = None
) -> Callable[..., jax.Array]:
  """An ``attention_fn`` for Flax attention modules running Top-k attention.

  THEORY 8.1: every query keeps the keys ``policy`` selects; the call's
  Certificate (THEORY 6.5) is sown into the module when Flax passes one
  (``sow_weights=True``; NNX: ``nnx.Intermediate`` ``'certificate'``, Linen:
  ``'intermediates'`` ``'certificate'``). Read them with
  ``jaxtopk.nn.collect_certificates``.

  Args:
    policy: the selection policy; validated here.
    implementation: ``'xla'``, ``'pallas'``, None (library default), or a
      sequence tried in order (``jaxtopk.topk_attention``).

  Returns:
    ``attention_fn(query, key, value, bias=None, mask=None, ...)`` with the
    signature of ``flax.nnx.dot_product_attention`` (and the Linen one's
    extra keywords), returning ``[batch..., q_len, num_heads, v_head_dim]``.
    It differs from Flax's as ``CertifiedTopKAttention`` (its docstring
    lists the differences: dropout, what ``sow_weights`` sows, complex
    inputs, full-precision logits, rows with no key); einsum overrides
    (``einsum_dot_general``, ``qk_attn_weights_einsum``,
    ``attn_weights_value_einsum``) are refused with a ValueError naming
    them.

  Raises:
    TypeError: ``policy`` is not a jaxtopk policy.
    ValueError: unknown ``implementation``.

  Example:
    >>> import jaxtopk
    >>> from flax import nnx
    >>> layer = nnx.MultiHeadAttention(
    ...     num_heads=2, in_features=6, decode=False, rngs=nnx.Rngs(0),
    ...     attention_fn=jaxtopk.nn.topk_attention_fn(jaxtopk.Dense()))
    >>> layer(jnp.ones((3, 5, 6))).shape
    (3, 5, 6)
  """
  check_policy(policy)
  return _attention_fn(policy, check_implementation(implementation))


# One function per (policy, implementation): a module stores its
# attention_fn as a static attribute, so equal layers built apart have equal
# graphs and share their compiled programs (a new closure per call made
# every new model instance recompile each jitted function over it).
@functools.lru_cache(maxsize=256)
def _attention_fn(
  policy: Policy, implementation: str | tuple[str, ...] | None
) -> Callable[..., jax.Array]:
  def attention_fn(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    promote_dtype: Callable[..., Any] = dtypes.promote_dtype,
    is_causal: bool = False,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable[..., Any] | None = None,
    qk_attn_weights_einsum: Callable[..., Any] | None = None,
    attn_weights_value_einsum: Callable[..., Any] | None = None,
  ) -> jax.Array:
    # The softmax is always float32 (force_fp32_for_softmax holds) and the
    # logits full precision whatever ``precision`` asks.
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
    for name, fn in (
      ("einsum_dot_general", einsum_dot_general),
      ("qk_attn_weights_einsum", qk_attn_weights_einsum),
      ("attn_weights_value_einsum", attn_weights_value_einsum),
    ):
      if fn is not None:
        raise ValueError(
          f"{name}={fn!r}: Top-k attention computes its own products (full"
          " precision, certified); einsum overrides are not supported"
        )
    check_flax_shapes(*(jnp.asarray(x) for x in (query, key, value)))
    if dropout_rate > 0.0 and not deterministic:
      raise NotImplementedError(
        f"{dropout_rate=} with deterministic=False: attention-weight dropout "
        "is not supported by Top-k attention; use deterministic=True or "
        "dropout_rate=0"
      )
    out, cert = certified_attention(
      query,
      key,
      value,
      policy=policy,
      mask=mask,
      bias=bias,
      is_causal=is_causal,
      dtype=dtype,
      implementation=implementation,
      promote_dtype=promote_dtype,
    )
    sow_certificate(module, cert)
    return out

  attention_fn.policy = policy
  attention_fn.implementation = implementation
  return attention_fn
