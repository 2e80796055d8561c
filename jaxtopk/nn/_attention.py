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
  ``CertificateVariable`` named ``last_certificate`` (created by the first
  call: a layer not yet called holds exactly nnx.MultiHeadAttention's
  state) and, with ``sow_weights=True`` under ``nnx.capture(model,
  nnx.Intermediate)``, also sown as ``'certificate'`` (where Flax sows the
  dense weights, which Top-k attention never forms).
  ``jaxtopk.nn.collect_certificates(model)`` reads them per layer.

Decode mode (``decode=True`` after ``init_cache``) feeds one token at a time,
as nnx.MultiHeadAttention does, but the cache is a ``jaxtopk.KVCache``
(head-major keys and values with per-block key boxes and value norms, DESIGN
"one decode step") held in ``self.kv_cache`` (``cached_key``,
``cached_value`` and ``cache_index`` read it in Flax's layout), and each step
runs
``jaxtopk.decode_attention`` over it: Top-k without a full pass over the
values, and Delta-/MC-Search that skips cache blocks (THEORY 6.2/6.3). A step
given an extra ``mask`` runs ``jaxtopk.topk_attention`` over the cache
instead (``decode_attention`` takes no mask).

Capacity: a step past ``init_cache``'s ``max_length`` writes nothing (the
cache is never grown or wrapped silently). Called eagerly it raises a
ValueError naming ``max_length``; under ``jax.jit`` / ``nnx.jit`` the step
count is a traced cache length, not a static number, so the step cannot
raise: its key and value are not written and its rows are invalid
(``core.mark_invalid``: valid False, float fields NaN, zero output).
"""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import rnglib
from flax.nnx.module import first_from

from jaxtopk.attention import KVCache
from jaxtopk.attention import decode_attention
from jaxtopk.nn._attention_fn import certified_attention
from jaxtopk.nn._attention_fn import check_implementation
from jaxtopk.nn._attention_fn import check_policy
from jaxtopk.nn._attention_fn import flatten_batch
from jaxtopk.nn._attention_fn import topk_attention_fn
from jaxtopk.selection import Certificate
from jaxtopk.selection import Policy
from jaxtopk.selection import core

CERTIFICATE_NAME = "certificate"
CERTIFICATES_COLLECTION = "certificates"
DEFAULT_BLOCK_SIZE = 64  # cache summary block when the policy sets none


@nnx.register_variable_name(CERTIFICATES_COLLECTION, overwrite=True)
class CertificateVariable(nnx.Intermediate):
  """Holds the Certificate of a layer's last call (or None before the first).

  A subclass of ``nnx.Intermediate``, so ``nnx.state(model, nnx.Intermediate)``
  and ``nnx.pop`` see it, and filters can single it out. Its Linen collection
  (through ``nnx.bridge``) is ``'certificates'``.
  """


class CertifiedTopKAttention(nnx.MultiHeadAttention):
  """Multi-head attention over the keys a jaxtopk policy keeps, certified.

  Mirrors ``nnx.MultiHeadAttention`` argument for argument (see its docs for
  the shared ones), without ``attention_fn`` (fixed to Top-k) and with
  ``policy`` and ``implementation``. With ``Dense()`` (or any policy that
  keeps every key) it computes what nnx.MultiHeadAttention computes, from
  the same parameters (same names and shapes: ``nnx.update(layer,
  nnx.state(mha, nnx.Param))`` moves weights either way), and passes Flax's
  own NNX and Linen attention tests (``tests/upstream/``) but for the
  differences below, the complete list. Items 1, 2, 5 and 6 hold as well
  for ``jaxtopk.nn.topk_attention_fn`` in any Flax attention module.

  1. Attention-weight dropout is refused: a call with ``dropout_rate > 0``
     and ``deterministic=False`` raises NotImplementedError (Top-k attention
     never forms the weight matrix dropout acts on, and dropped weights
     would void the certificate). ``deterministic=True`` works as in Flax.
  2. ``sow_weights=True`` sows the call's Certificate as ``'certificate'``
     (``nnx.Intermediate``; Linen: ``'intermediates'``), not the dense
     ``'attention_weights'``, which Top-k attention never forms.
  3. After its first call the layer holds the last call's Certificate in
     ``last_certificate``, an ``nnx.Intermediate``: filters must then cover
     it (``nnx.split(layer, nnx.Param, ...)``, or ``nnx.pop(layer,
     nnx.Intermediate)`` first); a layer not yet called has exactly
     nnx.MultiHeadAttention's state, except that a sampling policy
     (``Certified(search='mc')``) adds its own rng stream ``search_rngs``.
     A jitted step over a fresh layer therefore compiles twice (the second
     call meets the new variable); ``jaxtopk.nn.init_certificates(model,
     x)`` creates it first, and the step compiles once.
  4. The decode cache is a ``jaxtopk.KVCache`` in ``kv_cache`` (one
     ``nnx.Cache``); ``cached_key``, ``cached_value`` and ``cache_index``
     are read-only views of it in Flax's layout.
  5. Complex inputs are refused (TypeError). The attention logits are
     computed in float32 at full precision and the softmax in float32,
     whatever ``precision`` or ``force_fp32_for_softmax`` say (they apply to
     the projections); einsum overrides (Linen's ``einsum_dot_general``,
     ``qk_attn_weights_einsum``, ``attn_weights_value_einsum``) are refused
     with a ValueError naming them.
  6. A query row with no key to attend to (all masked) gives zeros and an
     invalid certificate row, where Flax averages all the values.

  Outputs equal Flax's up to float rounding (not bitwise), and under a
  certified policy up to the certificate's ``output_error_bound``.

  Args:
    num_heads: number of query heads; divides ``qkv_features``.
    in_features: input features of the query.
    qkv_features: total query/key/value features (default ``in_features``).
    out_features: output features (default ``in_features``).
    num_kv_heads: key/value heads for GQA; divides ``num_heads``.
    in_kv_features: input features of keys/values (default ``in_features``).
    policy: the selection policy: ``jaxtopk.Dense()``, ``FixedK(topk)``,
      ``Ratio(rho)``, ``PowerLaw(alpha, c)`` or ``Certified(eps, ...)``.
    implementation: ``'xla'``, ``'pallas'``, None (library default), or a
      sequence tried in order (``jaxtopk.topk_attention``).
    dropout_rate: as nnx.MultiHeadAttention, but a call that would apply it
      raises (difference 1).
    **kwargs: every other keyword of ``nnx.MultiHeadAttention`` (``dtype``,
      ``param_dtype``, ``precision``, initialisers, ``use_bias``,
      ``normalize_qk``, ``decode``, ``keep_rngs``, ``rngs``, ...).

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

  # The last call's Certificate: None until the first call, which stores a
  # CertificateVariable on the instance (so a fresh layer's state is
  # nnx.MultiHeadAttention's).
  last_certificate: CertificateVariable | None = None

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
    implementation: str | tuple[str, ...] | None = None,
    rngs: rnglib.Rngs,
    **kwargs: Any,
  ):
    check_policy(policy)
    implementation = check_implementation(implementation)
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
    self.kv_cache: nnx.Cache[KVCache] | None = nnx.data(None)
    self._cache_length: int | None = None  # max_length given to init_cache
    self._cache_batch: tuple[int, ...] = ()  # its batch axes
    # MC-Search (THEORY 6.3) samples keys in decode: its own rng stream,
    # split off after the parameters so they match nnx.MultiHeadAttention's.
    self.search_rngs = (
      nnx.Rngs(search=rngs.params()) if policy.needs_rng else nnx.data(None)
    )

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
        MC-Search decode draws from the layer's own ``search_rngs``.
      sow_weights: sow the call's Certificate as ``'certificate'``
        (``nnx.Intermediate``; Top-k attention never forms the dense weights
        Flax sows here).
      decode: use the autoregressive cache (one token per call); ``mask``
        then broadcasts to ``[batch..., num_heads, 1, max_len]``.
      is_causal: causal mask over the sequence (ignored in decode mode, where
        the cache mask is causal by construction).
      out_sharding: sharding of the output projection.
      qkv_sharding: sharding of the q/k/v projections.

    Returns:
      ``[batch..., q_len, out_features]``. The call's Certificate (arrays
      ``[batch..., q_len, num_heads]``) is in ``self.last_certificate``.

    Raises:
      ValueError: decode without ``init_cache``, wrong input features or
        cache shape, an eager decode step past ``init_cache``'s
        ``max_length`` (under jit that step's rows are invalid instead:
        module docstring).
      NotImplementedError: dropout would be applied.
    """
    del rngs
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
      x, cert = self._decode_step(query, key, value, mask)
      self._record(cert, sow_weights)
      return self.out(x, out_sharding=out_sharding)

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
    self._record(cert, sow_weights)
    return self.out(x, out_sharding=out_sharding)

  def _record(self, cert: Certificate, sow: bool) -> None:
    if self.last_certificate is None:
      self.last_certificate = CertificateVariable(cert)
    else:
      self.last_certificate.set_value(cert)
    if sow:
      self.sow(nnx.Intermediate, CERTIFICATE_NAME, cert)

  # Flax's decode cache names, read from the KVCache (Flax's layout
  # ``[*batch, max_length, kv_heads, head_dim]``). Assigning them is refused
  # (nnx.MultiHeadAttention's constructor sets them to None: accepted).
  # They return arrays, not nnx.Cache variables (hence the type: ignore): a
  # write into a view must fail, not be lost.

  def _cache_view(self, name):
    if self.kv_cache is None:
      return None
    cache = self.kv_cache.get_value()
    x = getattr(cache, name)[:, :, : self._cache_length]  # [b, hk, L, d]
    x = jnp.swapaxes(x, 1, 2)  # [b, L, hk, d]
    return jnp.reshape(x, (*self._cache_batch, *x.shape[1:]))

  def _refuse_set(self, name, value):
    if isinstance(value, dataclasses.Field):  # nnx.data(None), unresolved
      value = value.metadata.get("nnx_value", value)
    if value is not None:
      raise AttributeError(
        f"{name} is a read-only view of kv_cache (a jaxtopk.KVCache); use "
        "init_cache and decode calls"
      )

  @property  # type: ignore[override]
  def cached_key(self) -> jax.Array | None:
    """The cached keys ``[*batch, max_length, num_kv_heads, head_dim]``."""
    return self._cache_view("keys")

  @cached_key.setter
  def cached_key(self, value):
    self._refuse_set("cached_key", value)

  @property  # type: ignore[override]
  def cached_value(self) -> jax.Array | None:
    """The cached values ``[*batch, max_length, num_kv_heads, head_dim]``."""
    return self._cache_view("values")

  @cached_value.setter
  def cached_value(self, value):
    self._refuse_set("cached_value", value)

  @property  # type: ignore[override]
  def cache_index(self) -> jax.Array | None:
    """int32 scalar: positions filled (every sequence advances together)."""
    if self.kv_cache is None:
      return None
    return self.kv_cache.get_value().length[0]

  @cache_index.setter
  def cache_index(self, value):
    self._refuse_set("cache_index", value)

  def init_cache(self, input_shape, dtype=jnp.float32, *, block_size=None):
    """Allocates an empty decode cache (a ``jaxtopk.KVCache``).

    Args:
      input_shape: ``(*batch, max_length, features)``, as for
        ``nnx.MultiHeadAttention.init_cache``; batch axes are flattened
        inside the cache.
      dtype: storage dtype of cached keys and values.
      block_size: positions per key-summary block; default the policy's
        ``block_size`` for Certified, else 64 (at most ``max_length``). The
        storage is rounded up to a multiple of it, but at most
        ``max_length`` steps are decoded (module docstring: Capacity).
    """
    *batch, max_length, _ = input_shape
    if isinstance(max_length, bool) or not isinstance(max_length, int):
      raise ValueError(f"{max_length=} must be a positive int")
    self._cache_length = max_length
    self._cache_batch = tuple(batch)
    if block_size is None:
      if self.policy.kind == "certified":
        block_size = self.policy.block_size
      else:
        block_size = min(DEFAULT_BLOCK_SIZE, max_length)
    capacity = -(-max_length // block_size) * block_size
    self.kv_cache = nnx.Cache(
      KVCache.create(
        math.prod(batch),
        capacity,
        self.num_kv_heads,
        self.head_dim,
        block_size=block_size,
        dtype=dtype,
      )
    )

  def set_view(
    self,
    deterministic=None,
    decode=None,
    batch_size=None,
    max_length=None,
  ):
    """Used by ``nnx.view``: sets modes and, for decode, allocates a cache."""
    if deterministic is not None:
      self.deterministic = deterministic
    if decode is not None:
      self.decode = decode
      if decode and self.kv_cache is None:
        if batch_size is None or max_length is None:
          raise TypeError(
            "batch_size and max_length are needed to initialise the cache; "
            f"got {batch_size=}, {max_length=}"
          )
        if isinstance(batch_size, int):
          batch_size = (batch_size,)
        self.init_cache(
          (*batch_size, max_length, self.in_features),
          dtype=self.dtype or jnp.float32,
        )

  def _decode_step(self, query, key, value, mask):
    """Appends one step to the cache and attends over it."""
    if self.kv_cache is None:
      raise ValueError(
        "decode=True but the autoregressive cache is not initialised: call "
        "init_cache(input_shape) first"
      )
    cache = self.kv_cache.get_value()
    cap = self._cache_length or cache.max_len
    full = cache.length >= cap  # [sequences]: no room for this step
    if not isinstance(full, jax.core.Tracer) and bool(np.any(full)):
      step = int(np.max(np.asarray(cache.length))) + 1
      raise ValueError(
        f"decode step {step} is past init_cache's max_length={cap}: the"
        " cache is full (nothing was written); call init_cache with a"
        " larger max_length"
      )
    batch = query.shape[:-3]
    flat = math.prod(batch)
    expected = (*batch, 1, self.num_kv_heads, self.head_dim)
    if key.shape != expected or flat != cache.keys.shape[0]:
      raise ValueError(
        f"decode feeds one token per call: key.shape={key.shape} must be "
        f"{expected} with {cache.keys.shape[0]} sequences in the cache"
      )
    query, key, value = (
      jnp.reshape(a, (flat,) + a.shape[len(batch) :])
      for a in (query, key, value)
    )  # [b, 1, heads, head_dim]
    if self.dtype is not None:
      query = query.astype(self.dtype)
    # Under jit a full sequence writes nothing and its rows are invalid.
    # Not donated: the variable's old cache may be shared, e.g. by a clone
    # of this module or a state snapshot.
    cache = cache.append(
      key,
      value,
      num_steps=jnp.where(full, 0, 1).astype(jnp.int32),
      donate=False,
    )
    self.kv_cache.set_value(cache)
    if mask is None:
      rng = None if self.search_rngs is None else self.search_rngs.search()
      x, cert = decode_attention(
        query,
        cache,
        policy=self.policy,
        implementation=self.implementation,
        rng=rng,
      )
    else:
      # decode_attention takes no mask: attend over the whole cache with
      # the user's mask and the filled positions (one transpose per step).
      mask = flatten_batch(jnp.asarray(mask) != 0, batch, 3)
      pad = cache.max_len - mask.shape[-1]  # capacity rounded up to blocks
      if pad > 0:
        mask = jnp.pad(mask, ((0, 0),) * 3 + ((0, pad),))
      filled = cache.valid()[:, :, None, :]  # [b, 1, 1, max_len]
      x, cert = certified_attention(
        query,
        jnp.swapaxes(cache.keys, 1, 2),  # [b, max_len, kv_heads, d]
        jnp.swapaxes(cache.values, 1, 2),
        policy=self.policy,
        mask=jnp.logical_and(mask, filled),
        implementation=self.implementation,
      )
    cert = core.mark_invalid(cert, full[:, None, None])
    x = jnp.where(full[:, None, None, None], jnp.zeros((), x.dtype), x)
    x = jnp.reshape(x, (*batch, *x.shape[1:]))
    cert = jax.tree.map(lambda a: jnp.reshape(a, (*batch, *a.shape[1:])), cert)
    return x, cert
