"""A BERT encoder in Flax NNX with a pluggable attention function.

The architecture of Hugging Face's ``BertModel`` (post-LayerNorm, learned
absolute positions, token types, exact-erf GELU), written thin: projections
and parameters live here, the attention math is injected as ``attention_fn``
with the signature of ``flax.nnx.dot_product_attention``, so certified Top-k
attention can replace the dense softmax without touching the model.

With ``return_logits=True`` the encoder also returns, for every layer, the
pre-softmax scaled logits (THEORY.md section 1: ``s_i = q.k_i * scale``) with
the padding mask kept apart as a boolean, plus the queries, keys, values and
attention outputs, head-major (DESIGN.md: ``[batch, heads, seq, head_dim]``).
The real all-MiniLM-L6-v2 weights are loaded by ``jaxtopk.models.load_minilm``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array
from jaxtyping import Bool
from jaxtyping import Float
from jaxtyping import Int

from jaxtopk.models._bert_config import ACTIVATIONS
from jaxtopk.models._bert_config import BertConfig


class AttentionTrace(NamedTuple):
  """What every attention layer saw, returned with ``return_logits=True``.

  Each per-layer field is a tuple of ``num_layers`` arrays. Logits are the
  scaled pre-softmax scores of THEORY.md section 1, computed in float32 from
  the same queries and keys the attention function received, with NO mask
  written into them: padded keys are marked by ``key_mask`` instead, so a row
  can be analysed over its real keys only.

  Attributes:
    logits: ``[batch, heads, seq, seq]`` float32, ``q.k * head_dim**-0.5``.
    key_mask: ``[batch, seq]`` bool, True for a real (non-padding) token.
    queries: ``[batch, heads, seq, head_dim]`` in the compute dtype.
    keys: ``[batch, heads, seq, head_dim]``.
    values: ``[batch, heads, seq, head_dim]``.
    outputs: ``[batch, heads, seq, head_dim]``, what ``attention_fn``
      returned (before the output projection).
    inputs: ``[batch, seq, hidden]``, the hidden states entering each layer.
  """

  logits: tuple[Array, ...]
  key_mask: Array
  queries: tuple[Array, ...]
  keys: tuple[Array, ...]
  values: tuple[Array, ...]
  outputs: tuple[Array, ...]
  inputs: tuple[Array, ...]


def _check_range(name: str, ids, size: int) -> None:
  """Raises if concrete ``ids`` fall outside ``[0, size)`` (skipped in jit).

  Out-of-range ids would otherwise be filled silently by the embedding
  lookup; under jit the values are unknown and nothing is checked.
  """
  if isinstance(ids, jax.core.Tracer):
    return
  lo, hi = int(jnp.min(ids)), int(jnp.max(ids))
  if lo < 0 or hi >= size:
    raise ValueError(f"{name} must lie in [0, {size}), got min {lo} max {hi}")


def _layer_norm(config, dtype, param_dtype, rngs):
  # Two-pass variance (use_fast_variance=False) as PyTorch computes it.
  return nnx.LayerNorm(
    config.hidden_size,
    epsilon=config.layer_norm_eps,
    dtype=dtype,
    param_dtype=param_dtype,
    use_fast_variance=False,
    rngs=rngs,
  )


class BertEmbeddings(nnx.Module):
  """Word + position + token-type embeddings, then LayerNorm."""

  def __init__(self, config: BertConfig, *, dtype, param_dtype, rngs):
    embed = lambda n: nnx.Embed(
      n, config.hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs
    )
    self.word = embed(config.vocab_size)
    self.position = embed(config.max_position_embeddings)
    self.token_type = embed(config.type_vocab_size)
    self.norm = _layer_norm(config, dtype, param_dtype, rngs)

  def __call__(self, input_ids, token_type_ids):
    positions = jnp.arange(input_ids.shape[-1])  # [s]
    x = (
      self.word(input_ids)
      + self.position(positions)[None]
      + self.token_type(token_type_ids)
    )  # [b, s, hidden]
    return self.norm(x)


class BertSelfAttention(nnx.Module):
  """Multi-head self-attention with the attention math injected.

  ``attention_fn`` is called exactly as ``nnx.MultiHeadAttention`` calls it:
  ``attention_fn(q, k, v, mask=..., dropout_rng=None, dropout_rate=0.0,
  broadcast_dropout=True, deterministic=True, dtype=..., precision=...,
  module=self if sow_weights else None, is_causal=False)`` with ``q, k, v``
  of shape ``[batch, seq, heads, head_dim]`` and a boolean mask
  ``[batch, 1, 1, seq]`` (True = attend); it returns
  ``[batch, seq, heads, head_dim]``. With ``sow_weights`` the function may
  sow into this module (dense: ``attention_weights``; jaxtopk's
  ``topk_attention_fn``: its ``certificate``).
  """

  def __init__(
    self,
    config: BertConfig,
    *,
    dtype,
    param_dtype,
    precision,
    attention_fn: Callable[..., Array],
    rngs,
  ):
    linear = lambda: nnx.Linear(
      config.hidden_size,
      config.hidden_size,
      dtype=dtype,
      param_dtype=param_dtype,
      precision=precision,
      rngs=rngs,
    )
    self.query = linear()
    self.key = linear()
    self.value = linear()
    self.out = linear()
    self.num_heads = config.num_heads
    self.head_dim = config.head_dim
    self.dtype = dtype
    self.precision = precision
    self.attention_fn = attention_fn

  def __call__(self, x, key_mask, *, trace=False, sow_weights=False):
    b, s, _ = x.shape
    split = lambda t: t.reshape(b, s, self.num_heads, self.head_dim)
    q = split(self.query(x))  # [b, s, h, dh]
    k = split(self.key(x))  # [b, s, h, dh]
    v = split(self.value(x))  # [b, s, h, dh]
    mask = key_mask[:, None, None, :]  # [b, 1, 1, s]
    o = self.attention_fn(
      q,
      k,
      v,
      mask=mask,
      dropout_rng=None,
      dropout_rate=0.0,
      broadcast_dropout=True,
      deterministic=True,
      dtype=self.dtype,
      precision=self.precision,
      module=self if sow_weights else None,
      is_causal=False,
    )  # [b, s, h, dh]
    y = self.out(o.reshape(b, s, self.num_heads * self.head_dim))
    if not trace:
      return y, None
    head_major = lambda t: jnp.swapaxes(t, 1, 2)  # [b, h, s, dh]
    scale = 1.0 / math.sqrt(self.head_dim)
    f32 = jnp.promote_types(q.dtype, jnp.float32)
    logits = (
      jnp.einsum(
        "bqhd,bkhd->bhqk",
        q.astype(f32),
        k.astype(f32),
        precision=jax.lax.Precision.HIGHEST,
      )
      * scale
    )  # [b, h, s, s]
    record = dict(
      logits=logits,
      queries=head_major(q),
      keys=head_major(k),
      values=head_major(v),
      outputs=head_major(o),
    )
    return y, record


class BertLayer(nnx.Module):
  """One post-LayerNorm encoder layer: attention, add+norm, FFN, add+norm."""

  def __init__(
    self,
    config: BertConfig,
    *,
    dtype,
    param_dtype,
    precision,
    attention_fn,
    rngs,
  ):
    self.attention = BertSelfAttention(
      config,
      dtype=dtype,
      param_dtype=param_dtype,
      precision=precision,
      attention_fn=attention_fn,
      rngs=rngs,
    )
    self.attention_norm = _layer_norm(config, dtype, param_dtype, rngs)
    self.intermediate = nnx.Linear(
      config.hidden_size,
      config.intermediate_size,
      dtype=dtype,
      param_dtype=param_dtype,
      precision=precision,
      rngs=rngs,
    )
    self.output = nnx.Linear(
      config.intermediate_size,
      config.hidden_size,
      dtype=dtype,
      param_dtype=param_dtype,
      precision=precision,
      rngs=rngs,
    )
    self.output_norm = _layer_norm(config, dtype, param_dtype, rngs)
    self.activation = ACTIVATIONS[config.hidden_act]

  def __call__(self, x, key_mask, *, trace=False, sow_weights=False):
    a, record = self.attention(
      x, key_mask, trace=trace, sow_weights=sow_weights
    )
    x = self.attention_norm(x + a)  # [b, s, hidden]
    h = self.output(self.activation(self.intermediate(x)))
    return self.output_norm(x + h), record


class MiniLM(nnx.Module):
  """BERT encoder (the all-MiniLM-L6-v2 architecture by default) in Flax NNX.

  Returns the last hidden state; the sentence-transformers pooler is
  ``jaxtopk.models.sentence_embedding``. Inference only: dropout is not applied.
  ``config`` None means all-MiniLM-L6-v2's ``BertConfig()``; ``dtype`` is the
  compute dtype (None: from inputs and params) and ``param_dtype`` the
  storage dtype of the parameters.

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> cfg = BertConfig(vocab_size=11, hidden_size=6, num_layers=2,
    ...                  num_heads=3, intermediate_size=7,
    ...                  max_position_embeddings=13)
    >>> model = MiniLM(cfg, rngs=nnx.Rngs(0))
    >>> ids = jnp.array([[1, 2, 3, 0, 0]])
    >>> hidden = model(ids, ids != 0)
    >>> hidden.shape
    (1, 5, 6)
  """

  def __init__(
    self,
    config: BertConfig | None = None,
    *,
    dtype=None,
    param_dtype=jnp.float32,
    precision=None,
    attention_fn: Callable[..., Array] = nnx.dot_product_attention,
    rngs: nnx.Rngs,
  ):
    if config is None:
      config = BertConfig()
    self.config = config
    self.dtype = dtype
    self.embeddings = BertEmbeddings(
      config, dtype=dtype, param_dtype=param_dtype, rngs=rngs
    )
    self.layers = nnx.List(
      [
        BertLayer(
          config,
          dtype=dtype,
          param_dtype=param_dtype,
          precision=precision,
          attention_fn=attention_fn,
          rngs=rngs,
        )
        for _ in range(config.num_layers)
      ]
    )

  def __call__(
    self,
    input_ids: Int[Array, "b s"],
    attention_mask: Int[Array, "b s"] | Bool[Array, "b s"] | None = None,
    token_type_ids: Int[Array, "b s"] | None = None,
    *,
    return_logits: bool = False,
    sow_weights: bool = False,
  ) -> Float[Array, "b s hidden"] | tuple[Float[Array, "b s hidden"], Any]:
    """Encodes a batch of token ids.

    Args:
      input_ids: ``[batch, seq]`` integer token ids.
      attention_mask: ``[batch, seq]``, nonzero/True for a real token, 0 for
        padding (Hugging Face convention); None means no padding.
      token_type_ids: ``[batch, seq]`` segment ids; None means all zeros.
      return_logits: also return an ``AttentionTrace`` (every layer's scaled
        logits, the key mask, queries, keys, values, attention outputs).
      sow_weights: pass each attention layer as ``module`` to
        ``attention_fn`` so it can sow into it (as ``nnx.MultiHeadAttention``
        does); run under ``nnx.capture(fn, nnx.Intermediate)`` to read them.

    Returns:
      The last hidden state ``[batch, seq, hidden]`` (compute dtype), or
      ``(hidden, AttentionTrace)`` when ``return_logits`` is True.

    Raises:
      ValueError: on shapes that are not ``[batch, seq]``, mismatched shapes,
        non-integer ids, ``seq`` longer than the position table, or (outside
        jit only) ids outside the vocabulary or token-type table.
    """
    input_ids = jnp.asarray(input_ids)
    if input_ids.ndim != 2:
      raise ValueError(f"{input_ids.shape=} must be [batch, seq]")
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
      raise ValueError(f"{input_ids.dtype=} must be an integer dtype")
    seq = input_ids.shape[1]
    if not 1 <= seq <= self.config.max_position_embeddings:
      raise ValueError(
        f"sequence length {seq} must be in [1, max_position_embeddings="
        f"{self.config.max_position_embeddings}]"
      )
    _check_range("input_ids", input_ids, self.config.vocab_size)
    if attention_mask is None:
      key_mask = jnp.ones(input_ids.shape, bool)
    else:
      attention_mask = jnp.asarray(attention_mask)
      if attention_mask.shape != input_ids.shape:
        raise ValueError(
          f"{attention_mask.shape=} must equal {input_ids.shape=}"
        )
      key_mask = attention_mask != 0  # [b, s]
    if token_type_ids is None:
      token_type_ids = jnp.zeros_like(input_ids)
    else:
      token_type_ids = jnp.asarray(token_type_ids)
      if token_type_ids.shape != input_ids.shape:
        raise ValueError(
          f"{token_type_ids.shape=} must equal {input_ids.shape=}"
        )
      if not jnp.issubdtype(token_type_ids.dtype, jnp.integer):
        raise ValueError(f"{token_type_ids.dtype=} must be an integer dtype")
      _check_range(
        "token_type_ids", token_type_ids, self.config.type_vocab_size
      )

    x = self.embeddings(input_ids, token_type_ids)  # [b, s, hidden]
    records, inputs = [], []
    for layer in self.layers:
      inputs.append(x)
      x, record = layer(
        x, key_mask, trace=return_logits, sow_weights=sow_weights
      )
      records.append(record)
    if not return_logits:
      return x
    field = lambda name: tuple(r[name] for r in records)
    trace = AttentionTrace(
      logits=field("logits"),
      key_mask=key_mask,
      queries=field("queries"),
      keys=field("keys"),
      values=field("values"),
      outputs=field("outputs"),
      inputs=tuple(inputs),
    )
    return x, trace


BertEncoder = MiniLM
