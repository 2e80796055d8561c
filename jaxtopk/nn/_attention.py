"""CertifiedTopKAttention: nnx.MultiHeadAttention running certified Top-k.

The layer IS an ``nnx.MultiHeadAttention`` (a subclass): the same constructor
arguments, the same submodules (``query``, ``key``, ``value``, ``out``,
``query_ln``, ``key_ln``) and parameter shapes, so weights move between the
two with ``nnx.update(layer, nnx.state(other, nnx.Param))`` unchanged. What it
adds:

- ``policy``: which keys each query keeps (THEORY 8.1; jaxtopk policies);
- ``implementation``: ``'xla'``, ``'pallas'`` or None, passed to
  ``jaxtopk.topk_attention``;
- the Certificate of the last call (THEORY 6.5), kept on the module in a
  ``CertificateVariable`` named ``last_certificate`` and, under
  ``nnx.capture(model, nnx.Intermediate)``, also sown as ``'certificate'``.
  ``jaxtopk.nn.collect_certificates(model)`` reads them per layer.

Decode mode (``decode=True`` after ``init_cache``) feeds one token at a time,
as nnx.MultiHeadAttention does; the cached keys are masked to the positions
written so far.
"""

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import rnglib
from flax.nnx.module import first_from

from jaxtopk.nn._attention_fn import certified_attention
from jaxtopk.nn._attention_fn import check_implementation
from jaxtopk.nn._attention_fn import check_policy
from jaxtopk.nn._attention_fn import topk_attention_fn
from jaxtopk.selection import Certificate
from jaxtopk.selection import Policy

CERTIFICATE_NAME = "certificate"
CERTIFICATES_COLLECTION = "certificates"


@nnx.register_variable_name(CERTIFICATES_COLLECTION)
class CertificateVariable(nnx.Intermediate):
  """Holds the Certificate of a layer's last call (or None before the first).

  A subclass of ``nnx.Intermediate``, so ``nnx.state(model, nnx.Intermediate)``
  and ``nnx.pop`` see it, and filters can single it out. Its Linen collection
  (through ``nnx.bridge``) is ``'certificates'``.
  """


class CertifiedTopKAttention(nnx.MultiHeadAttention):
  """Multi-head attention over the keys a jaxtopk policy keeps, certified.

  Mirrors ``nnx.MultiHeadAttention`` argument for argument (see its docs for
  the shared ones), without ``attention_fn`` (fixed to Top-k) and with:

  Args:
    num_heads: number of query heads; divides ``qkv_features``.
    in_features: input features of the query.
    qkv_features: total query/key/value features (default ``in_features``).
    out_features: output features (default ``in_features``).
    num_kv_heads: key/value heads for GQA; divides ``num_heads``.
    in_kv_features: input features of keys/values (default ``in_features``).
    policy: the selection policy: ``jaxtopk.Dense()``, ``FixedK(topk)``,
      ``Ratio(rho)``, ``PowerLaw(alpha, c)`` or ``Certified(eps, ...)``.
    implementation: ``'xla'``, ``'pallas'`` or None (library default).
    dropout_rate: accepted for compatibility; attention-weight dropout is not
      supported by Top-k attention, so a call that would apply it raises.
    **kwargs: every other keyword of ``nnx.MultiHeadAttention`` (``dtype``,
      ``param_dtype``, ``precision``, initialisers, ``use_bias``,
      ``normalize_qk``, ``decode``, ``rngs``, ...). ``precision`` applies to
      the projections; the attention core computes logits in float32.

  Raises:
    TypeError: ``policy`` is not a jaxtopk policy.
    ValueError: heads do not divide features, unknown ``implementation``.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxtopk
    >>> from flax import nnx
    >>> layer = jaxtopk.nn.CertifiedTopKAttention(
    ...     num_heads=2, in_features=6, policy=jaxtopk.Dense(),
    ...     decode=False, rngs=nnx.Rngs(0))
    >>> y = layer(jnp.ones((3, 5, 6)))
    >>> y.shape, layer.last_certificate.get_value().tv_bound.shape
    ((3, 5, 6), (3, 5, 2))
  """

  def __init__(
    self,
    num_heads: int,
    in_features: int,
    qkv_features: int | None = None,
    out_features: int | None = None,
    num_kv_heads: int | None = None,
    in_kv_features: int | None = None,
    *,
    policy: Policy,
    implementation: str | None = None,
    rngs: rnglib.Rngs,
    **kwargs: Any,
  ):
    check_policy(policy)
    check_implementation(implementation)
    if "attention_fn" in kwargs:
      raise TypeError(
        "CertifiedTopKAttention fixes attention_fn; pass policy= instead, "
        "or use nnx.MultiHeadAttention(attention_fn=topk_attention_fn(...))"
      )
    for name, value in (
      ("num_heads", num_heads),
      ("num_kv_heads", num_kv_heads),
    ):
      if value is not None and not (isinstance(value, int) and value >= 1):
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    super().__init__(
      num_heads,
      in_features,
      qkv_features,
      out_features,
      num_kv_heads,
      in_kv_features,
      attention_fn=topk_attention_fn(policy, implementation=implementation),
      rngs=rngs,
      **kwargs,
    )
    self.policy = policy
    self.implementation = implementation
    self.last_certificate = CertificateVariable(None)

  def __call__(
    self,
    inputs_q: jax.Array,
    inputs_k: jax.Array | None = None,
    inputs_v: jax.Array | None = None,
    *,
    mask: jax.Array | None = None,
    deterministic: bool | None = None,
    rngs: rnglib.Rngs | rnglib.RngStream | None = None,
    sow_weights: bool = False,
    decode: bool | None = None,
    is_causal: bool = False,
    out_sharding=None,
    qkv_sharding=None,
  ) -> jax.Array:
    """Applies certified Top-k multi-head attention.

    Args:
      inputs_q: ``[batch..., q_len, in_features]``.
      inputs_k: ``[batch..., kv_len, in_kv_features]`` (default inputs_q).
      inputs_v: ``[batch..., kv_len, in_kv_features]`` (default inputs_k).
      mask: broadcastable to ``[batch..., num_heads, q_len, kv_len]``; True
        (non-zero) = attend.
      deterministic: as nnx.MultiHeadAttention; must be True (or dropout_rate
        0) since Top-k attention has no weight dropout.
      rngs: unused (no dropout); accepted for signature compatibility.
      sow_weights: must be False: Top-k attention never forms the dense
        weights. Certificates are always recorded instead.
      decode: use the autoregressive cache (one token per call).
      is_causal: causal mask over the sequence (ignored in decode mode, where
        the cache mask is causal by construction).
      out_sharding: sharding of the output projection.
      qkv_sharding: sharding of the q/k/v projections.

    Returns:
      ``[batch..., q_len, out_features]``. The call's Certificate (arrays
      ``[batch..., q_len, num_heads]``) is in ``self.last_certificate``.

    Raises:
      ValueError: decode without ``init_cache``, wrong input features or
        cache shape, ``sow_weights=True``.
      NotImplementedError: dropout would be applied.
    """
    del rngs
    if sow_weights:
      raise ValueError(
        "sow_weights=True: Top-k attention never forms dense attention "
        "weights; its Certificate is recorded in last_certificate instead"
      )
    if inputs_k is None:
      if inputs_v is not None:
        raise ValueError("inputs_k cannot be None if inputs_v is not None")
      inputs_k = inputs_q
    if inputs_v is None:
      inputs_v = inputs_k
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(
        f"inputs_q.shape[-1]={inputs_q.shape[-1]} must equal "
        f"in_features={self.in_features}"
      )
    query = self.query(inputs_q, out_sharding=qkv_sharding)
    key = self.key(inputs_k, out_sharding=qkv_sharding)
    value = self.value(inputs_v, out_sharding=qkv_sharding)
    if self.normalize_qk:
      query = self.query_ln(query)
      key = self.key_ln(key)

    decode = first_from(
      decode,
      self.decode,
      error_msg="No `decode` argument was given to CertifiedTopKAttention "
      "as a __call__ argument, constructor argument or nnx flag.",
    )
    if decode:
      key, value, mask = self._update_cache(key, value, mask)
      is_causal = False

    if self.dropout_rate > 0.0:
      deterministic = first_from(
        deterministic,
        self.deterministic,
        error_msg="No `deterministic` argument was given to "
        "CertifiedTopKAttention (needed since dropout_rate > 0).",
      )
      if not deterministic:
        raise NotImplementedError(
          f"dropout_rate={self.dropout_rate} with deterministic=False: "
          "attention-weight dropout is not supported by Top-k attention"
        )

    x, cert = certified_attention(
      query,
      key,
      value,
      policy=self.policy,
      mask=mask,
      is_causal=is_causal,
      dtype=self.dtype,
      implementation=self.implementation,
    )
    self._record(cert)
    return self.out(x, out_sharding=out_sharding)

  def _record(self, cert: Certificate) -> None:
    self.last_certificate.set_value(cert)
    if hasattr(self, "__captures__"):  # inside nnx.capture
      self.sow(nnx.Intermediate, CERTIFICATE_NAME, cert)

  def _update_cache(self, key, value, mask):
    """Writes one step's key/value into the cache; returns the cached ones."""
    if (
      self.cached_key is None
      or self.cached_value is None
      or self.cache_index is None
    ):
      raise ValueError(
        "decode=True but the autoregressive cache is not initialised: call "
        "init_cache(input_shape) first"
      )
    *batch_dims, max_length, num_kv_heads, head_dim = self.cached_key.shape
    expected = (*batch_dims, 1, num_kv_heads, head_dim)
    if key.shape != expected:
      raise ValueError(
        f"decode feeds one token per call: key.shape={key.shape} must be "
        f"{expected}"
      )
    index = self.cache_index[...]
    zero = jnp.zeros((), index.dtype)
    start = (zero,) * len(batch_dims) + (index, zero, zero)
    key = jax.lax.dynamic_update_slice(
      self.cached_key[...], key.astype(self.cached_key.dtype), start
    )
    value = jax.lax.dynamic_update_slice(
      self.cached_value[...], value.astype(self.cached_value.dtype), start
    )
    self.cached_key[...] = key
    self.cached_value[...] = value
    self.cache_index[...] = index + 1
    seen = jnp.broadcast_to(
      jnp.arange(max_length) <= index, (*batch_dims, 1, 1, max_length)
    )
    mask = seen if mask is None else jnp.logical_and(mask != 0, seen)
    return key, value, mask
