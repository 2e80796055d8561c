"""The decoder: Llama 3.x and Qwen3 in Flax NNX, Top-k attention per call.

One architecture for every decoder of the project: the Llama/Qwen3 family
(grouped-query attention, rotary positions with Llama-3 frequency scaling,
RMSNorm, SwiGLU, Qwen3's per-head query/key RMSNorm, tied or untied
embeddings, optional attention and MLP biases) that loads Hugging Face
checkpoints (``jaxtopk.models.load_pretrained``), and in tiny configurations
the native Top-k models the experiments train (THEORY 8, [NATIVE]).

The same weights run dense or with Top-k attention, chosen per call by
``attention``: None (dense, ``jaxtopk.Dense()``), a jaxtopk policy, or any
hashable object with the :class:`DecoderAttention` methods ``prefill`` and
``decode``. Policies run on the library's own certified paths (through
``PolicyAttention``, the one adapter, see ``_decoder_attention.py``):
``jaxtopk.topk_attention`` for training and prefill (THEORY 8.2: the gradient
flows through the softmax over the kept keys) and ``jaxtopk.decode_attention``
over one ``jaxtopk.KVCache`` per layer for decoding (THEORY 8.1). Every call
returns, per layer, the attention's Certificate (THEORY 6.5).

Parameters: token embedding ``embed`` ``[vocab, model_dim]``; per block
``attn_norm``, ``attn`` (``query``/``key``/``value`` kernels ``[model_dim,
heads, head_dim]``, ``out`` ``[heads, head_dim, model_dim]``: the layout
``jaxtopk.parallel``'s rules shard over heads; ``query_norm``/``key_norm``
for Qwen3), ``mlp_norm``, ``mlp`` (``gate``, ``up``, ``down``); then
``final_norm`` and ``lm_head`` (absent when tied). Logits are float32.
"""

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array
from jaxtyping import Float
from jaxtyping import Int

from jaxtopk.attention import KVCache
from jaxtopk.models._decoder_attention import as_attention
from jaxtopk.models._decoder_attention import cache_block_size
from jaxtopk.models._decoder_config import DecoderConfig
from jaxtopk.models._rope import apply_rope
from jaxtopk.models._rope import rope_frequencies


@functools.cache
def _inv_freq(config: DecoderConfig):
  c = config
  return rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)


@flax.struct.dataclass
class DecoderCache:
  """Decode state of a :class:`TopKDecoder`.

  Attributes:
    layers: one ``jaxtopk.KVCache`` (or ``jaxtopk.PagedKVCache``) per
      layer (rotated keys and values, ``kv_heads`` heads, with per-block key
      boxes and value norms). Their ``length`` is the position of the next
      token.
  """

  layers: tuple[Any, ...]


class RMSNorm(nnx.Module):
  """RMSNorm as Llama and Qwen3 compute it: in float32, gain after the cast.

  ``y = scale * (x / sqrt(mean(x^2) + eps))``, the normalisation in float32
  and cast back to the input dtype before the gain.
  """

  def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x: Array) -> Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + self.eps)
    return (self.scale[...] * y.astype(x.dtype)).astype(x.dtype)


class _Attention(nnx.Module):
  """Projections of grouped-query attention (the math is injected)."""

  def __init__(self, c: DecoderConfig, *, dtype, param_dtype, rngs):
    dense = functools.partial(
      nnx.LinearGeneral,
      use_bias=c.attention_bias,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )
    self.query = dense(c.model_dim, (c.num_heads, c.head_dim))
    self.key = dense(c.model_dim, (c.num_kv_heads, c.head_dim))
    self.value = dense(c.model_dim, (c.num_kv_heads, c.head_dim))
    self.out = dense((c.num_heads, c.head_dim), c.model_dim, axis=(-2, -1))
    norm = functools.partial(
      RMSNorm, c.head_dim, eps=c.norm_eps, param_dtype=param_dtype
    )
    self.query_norm = norm() if c.qk_norm else None
    self.key_norm = norm() if c.qk_norm else None

  def qkv(self, h, positions, inv_freq):
    """Rotated q ``[b, s, heads, d]``, k and v ``[b, s, kv_heads, d]``."""
    q, k, v = self.query(h), self.key(h), self.value(h)
    if self.query_norm is not None:
      q, k = self.query_norm(q), self.key_norm(k)
    return (
      apply_rope(q, positions, inv_freq),
      apply_rope(k, positions, inv_freq),
      v,
    )


class _MLP(nnx.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

  def __init__(self, c: DecoderConfig, *, dtype, param_dtype, rngs):
    dense = functools.partial(
      nnx.Linear,
      use_bias=c.mlp_bias,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )
    self.gate = dense(c.model_dim, c.mlp_dim)
    self.up = dense(c.model_dim, c.mlp_dim)
    self.down = dense(c.mlp_dim, c.model_dim)

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class _Block(nnx.Module):
  """Pre-norm transformer block; attention injected per call."""

  def __init__(self, c: DecoderConfig, *, dtype, param_dtype, rngs):
    norm = functools.partial(
      RMSNorm, c.model_dim, eps=c.norm_eps, param_dtype=param_dtype
    )
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.attn_norm = norm()
    self.attn = _Attention(c, **kw)
    self.mlp_norm = norm()
    self.mlp = _MLP(c, **kw)

  def qkv(self, x, positions, inv_freq):
    """Rotated queries, keys and values of the residual stream ``x``."""
    return self.attn.qkv(self.attn_norm(x), positions, inv_freq)

  def _finish(self, x, out):
    x = x + self.attn.out(out)  # out [b, s, h, d] -> [b, s, dim]
    return x + self.mlp(self.mlp_norm(x))

  def __call__(self, x, positions, inv_freq, *, attention, rng):
    """Causal self-attention over ``x`` ``[b, s, dim]``; also returns k, v."""
    q, k, v = self.qkv(x, positions, inv_freq)
    out, aux = attention.prefill(q, k, v, rng=rng)
    return self._finish(x, out.astype(x.dtype)), k, v, aux

  def step(self, x, positions, inv_freq, cache, *, attention, rng, num_steps):
    """Tokens ``x`` ``[b, s, dim]``: append to ``cache``, attend over it.

    With ``num_steps`` (``[b]``), row b's real tokens are its LAST
    ``num_steps[b]`` (left-padded): they are appended, the padding is not.
    """
    q, k, v = self.qkv(x, positions, inv_freq)  # [b, s, h(k), d]
    if num_steps is not None:  # the append takes the real steps first
      k, v = _real_first(k, num_steps), _real_first(v, num_steps)
    # donate=False: the caller's cache stays valid.
    cache = cache.append(k, v, num_steps=num_steps, donate=False)
    out, aux = attention.decode(q, cache, rng=rng)
    return self._finish(x, out.astype(x.dtype)), cache, aux


def _real_first(x, num_steps):
  """Rolls each row of ``x`` ``[b, s, ...]`` so its last ``num_steps[b]``
  entries come first."""
  s = x.shape[1]
  shift = s - num_steps  # [b]
  idx = (jnp.arange(s)[None, :] + shift[:, None]) % s  # [b, s]
  idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, idx, axis=1)


class TopKDecoder(nnx.Module):
  """Llama 3.x / Qwen3 decoder whose attention keeps a policy's keys.

  THEORY 8.1-8.4. Score or train with ``model(input_ids, attention=...)``
  (the library's ``topk_attention``); decode with :meth:`prefill` then
  :meth:`decode_step` (the library's ``KVCache`` and ``decode_attention``),
  or use ``jaxtopk.models.generate``; teacher-forced decoding with
  :func:`decode_teacher_forced`. Hugging Face checkpoints load with
  ``jaxtopk.models.load_pretrained``.

  Args:
    config: the architecture.
    dtype: compute dtype of the projections (logits are float32).
    param_dtype: dtype of the parameters.
    rngs: initialisation keys.

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> import jaxtopk
    >>> from jaxtopk.models import DecoderConfig, TopKDecoder
    >>> model = TopKDecoder(DecoderConfig(vocab_size=11), rngs=nnx.Rngs(0))
    >>> tokens = jnp.zeros((3, 7), jnp.int32)
    >>> logits, certs = model(tokens, attention=jaxtopk.Ratio(0.5))
    >>> logits.shape, certs[0].k_kept.shape
    ((3, 7, 11), (3, 7, 4))
  """

  def __init__(
    self,
    config: DecoderConfig,
    *,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    if not isinstance(config, DecoderConfig):
      raise TypeError(f"config={config!r} must be a DecoderConfig")
    self.config = config
    self.embed = nnx.Embed(
      config.vocab_size,
      config.model_dim,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.blocks = nnx.List(
      [_Block(config, **kw) for _ in range(config.num_layers)]
    )
    self.final_norm = RMSNorm(
      config.model_dim, eps=config.norm_eps, param_dtype=param_dtype
    )
    self.lm_head = (
      None
      if config.tie_embeddings
      else nnx.Linear(config.model_dim, config.vocab_size, use_bias=False, **kw)
    )

  def _logits(self, x):
    h = self.final_norm(x)
    if self.lm_head is None:
      return self.embed.attend(h).astype(jnp.float32)
    return self.lm_head(h).astype(jnp.float32)

  def _layer_rng(self, rng, layer):
    return None if rng is None else jax.random.fold_in(rng, layer)

  def __call__(
    self,
    input_ids: Int[Array, "b s"],
    *,
    attention: Any = None,
    rng: Array | None = None,
  ) -> tuple[Float[Array, "b s v"], list[Any]]:
    """Causal forward pass (training and scoring), positions ``0..s-1``.

    Args:
      input_ids: int ``[batch, seq_len]``.
      attention: None (dense), a jaxtopk policy, or a DecoderAttention.
      rng: PRNG key for random selectors (folded in per layer).

    Returns:
      float32 logits ``[batch, seq_len, vocab_size]`` and a list (one per
      layer) of the attention's statistics: for a policy, its Certificate
      with ``[batch, seq_len, heads]`` arrays.

    Raises:
      TypeError: ``attention`` is none of the above.
    """
    x, _, aux = self._forward(input_ids, as_attention(attention), rng)
    return self._logits(x), aux

  def _forward(self, tokens, attention, rng):
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    inv_freq = _inv_freq(self.config)
    x = self.embed(tokens)
    kvs, aux = [], []
    for layer, block in enumerate(self.blocks):
      x, k, v, layer_aux = block(
        x,
        positions,
        inv_freq,
        attention=attention,
        rng=self._layer_rng(rng, layer),
      )
      kvs.append((k, v))
      aux.append(layer_aux)
    return x, kvs, aux

  def init_cache(
    self, batch: int, max_len: int, *, block_size: int = 64, dtype=None
  ) -> DecoderCache:
    """Empty caches holding ``max_len`` positions (rounded up to blocks)."""
    cfg = self.config
    capacity = -(-max_len // block_size) * block_size
    dtype = dtype or self.embed.embedding[...].dtype
    layer = KVCache.create(
      batch,
      capacity,
      cfg.num_kv_heads,
      cfg.head_dim,
      block_size=block_size,
      dtype=dtype,
    )
    return DecoderCache(layers=(layer,) * cfg.num_layers)

  def prefill(
    self,
    input_ids: Int[Array, "b s"],
    max_len: int,
    *,
    attention: Any = None,
    block_size: int | None = None,
    rng: Array | None = None,
  ) -> tuple[Float[Array, "b v"], DecoderCache, list[Any]]:
    """Forward over a prompt that fills one KVCache per layer.

    Args:
      input_ids: int ``[batch, seq_len]``, the prompt (positions from 0).
      max_len: positions the caches must hold (``seq_len`` and every step to
        decode); rounded up to a multiple of ``block_size``.
      attention: the prompt's attention: None (dense, THEORY 8.1), a policy
        or a DecoderAttention.
      block_size: positions per key-summary block of the caches; default
        :func:`cache_block_size` of ``attention`` (``Certified.block_size``
        for Delta-/MC-Search decoding, else ``min(64, max_len)``).
      rng: PRNG key for random selectors.

    Returns:
      float32 logits of the last prompt position ``[batch, vocab]``, a
      :class:`DecoderCache` holding the prompt, and the per-layer statistics
      of the prompt's attention (Certificates ``[batch, seq_len, heads]``).

    Raises:
      ValueError: ``seq_len > max_len``.
    """
    b, s = input_ids.shape
    if s > max_len:
      raise ValueError(f"prompt length {s=} must be <= {max_len=}")
    attention = as_attention(attention)
    if block_size is None:
      block_size = cache_block_size(attention, max_len)
    x, kvs, aux = self._forward(input_ids, attention, rng)
    empty = self.init_cache(
      b, max_len, block_size=block_size, dtype=kvs[0][0].dtype
    )
    layers = tuple(
      layer.append(k, v, donate=False)  # the layers share one empty cache
      for layer, (k, v) in zip(empty.layers, kvs, strict=True)
    )
    return self._logits(x[:, -1:])[:, 0], DecoderCache(layers=layers), aux

  def decode_step(
    self,
    input_ids: Int[Array, " b"],
    cache: DecoderCache,
    *,
    attention: Any = None,
    rng: Array | None = None,
  ) -> tuple[Float[Array, "b v"], DecoderCache, list[Any]]:
    """Feeds one token per row at the caches' next position.

    Args:
      input_ids: int ``[batch]``.
      cache: from :meth:`prefill` or a previous step; must have room (a full
        cache drops the new position: ``KVCache.append`` saturates).
      attention: None (dense), a jaxtopk policy, or a DecoderAttention.
      rng: PRNG key for random selectors and MC-Search (folded per layer).

    Returns:
      float32 logits ``[batch, vocab]``, the updated cache, and per layer
      the statistics (a Certificate with ``[batch, 1, heads]`` arrays for a
      policy).
    """
    return self.extend(input_ids[:, None], cache, attention=attention, rng=rng)

  def extend(
    self,
    input_ids: Int[Array, "b s"],
    cache: DecoderCache,
    *,
    num_steps: Any = None,
    attention: Any = None,
    rng: Array | None = None,
  ) -> tuple[Float[Array, "b v"], DecoderCache, list[Any]]:
    """Feeds ``s`` tokens per row at the caches' next positions.

    A chunk of a prompt (chunked prefill) or one sampled token
    (``decode_step``), attended with ``decode_attention`` over the caches
    (``q_len = s``: each token sees the positions up to its own). With
    ``num_steps``, rows are ragged: row b's first ``num_steps[b]`` tokens
    are real (right-padded), the rest neither appended nor attended to.

    Args:
      input_ids: int ``[batch, s]``.
      cache: caches with room for the new tokens (a ``KVCache`` or a
        ``jaxtopk.PagedKVCache`` per layer).
      num_steps: optional ``[batch]`` real tokens per row (0 to ``s``).
      attention: None (dense), a jaxtopk policy, or a DecoderAttention.
      rng: PRNG key for random selectors and MC-Search (folded per layer).

    Returns:
      float32 logits of each row's last real token ``[batch, vocab]``
      (meaningless for a row with ``num_steps`` 0), the updated cache, and
      per layer the statistics (Certificates ``[batch, s, heads]``; with
      ``num_steps``, row b's real tokens are its LAST ``num_steps[b]``
      entries, the others are padding rows).
    """
    attention = as_attention(attention)
    b, s = input_ids.shape
    start = cache.layers[0].length[:, None]  # [b, 1]
    steps = jnp.arange(s, dtype=jnp.int32)[None, :]
    if num_steps is None:
      positions = start + steps
    else:
      num_steps = jnp.broadcast_to(jnp.asarray(num_steps, jnp.int32), (b,))
      shift = (s - num_steps)[:, None]  # left-pad: real tokens last
      input_ids = jnp.take_along_axis(input_ids, (steps - shift) % s, axis=1)
      positions = jnp.maximum(start + steps - shift, 0)
    inv_freq = _inv_freq(self.config)
    x = self.embed(input_ids)  # [b, s, dim]
    layers, aux = [], []
    for layer, block in enumerate(self.blocks):
      x, layer_cache, layer_aux = block.step(
        x,
        positions,
        inv_freq,
        cache.layers[layer],
        attention=attention,
        rng=self._layer_rng(rng, layer),
        num_steps=num_steps,
      )
      layers.append(layer_cache)
      aux.append(layer_aux)
    return (
      self._logits(x[:, -1:])[:, 0],
      DecoderCache(layers=tuple(layers)),
      aux,
    )


def decode_teacher_forced(
  model: TopKDecoder,
  tokens: Int[Array, "b s"],
  *,
  prompt_len: int,
  attention: Any = None,
  rng: Array | None = None,
  block_size: int | None = None,
) -> tuple[Float[Array, "b t v"], list[Any]]:
  """Prefills ``tokens[:, :prompt_len]`` densely, then decodes the rest.

  THEORY 8.1: dense prefill, then one decode step per remaining position,
  feeding the true tokens (teacher forcing) and keeping ``attention``'s keys
  (``jaxtopk.decode_attention`` for a policy). The steps run in one
  ``jax.lax.scan`` (one compiled step body). Wrap in ``nnx.jit`` with
  ``prompt_len``, ``attention`` and ``block_size`` static.

  Args:
    model: the decoder.
    tokens: int ``[batch, seq_len]``.
    prompt_len: dense prefix length, in [1, seq_len).
    attention: None (dense), a jaxtopk policy, or a DecoderAttention.
    rng: PRNG key for random selectors (folded in per step).
    block_size: cache summary block; default ``Certified.block_size`` for
      Delta-/MC-Search, else ``min(64, seq_len)``.

  Returns:
    float32 logits ``[batch, seq_len - prompt_len, vocab]`` (the predictions
    after each decoded position) and, per layer, the decode steps'
    statistics with leaves ``[batch, seq_len - prompt_len, heads]`` (a
    Certificate for a policy: the layout of ``topk_attention``'s).

  Raises:
    ValueError: ``prompt_len`` out of range.
    TypeError: ``attention`` is not None, a policy or a DecoderAttention.

  Example:
    >>> import jax.numpy as jnp, jaxtopk
    >>> from flax import nnx
    >>> from jaxtopk import models
    >>> model = models.TopKDecoder(
    ...     models.DecoderConfig(vocab_size=11), rngs=nnx.Rngs(0))
    >>> tokens = jnp.zeros((2, 9), jnp.int32)
    >>> logits, certs = models.decode_teacher_forced(
    ...     model, tokens, prompt_len=6, attention=jaxtopk.FixedK(2))
    >>> logits.shape, certs[0].k_kept.shape
    ((2, 3, 11), (2, 3, 4))
  """
  seq_len = tokens.shape[1]
  if not 1 <= prompt_len < seq_len:
    raise ValueError(f"{prompt_len=} must be in [1, {seq_len=})")
  attention = as_attention(attention)
  if block_size is None:
    block_size = cache_block_size(attention, seq_len)
  _, cache, _ = model.prefill(
    tokens[:, :prompt_len], seq_len, block_size=block_size
  )

  def step(cache, t):
    step_rng = None if rng is None else jax.random.fold_in(rng, t)
    token = jax.lax.dynamic_index_in_dim(tokens, t, axis=1, keepdims=False)
    out, cache, aux = model.decode_step(
      token, cache, attention=attention, rng=step_rng
    )
    return cache, (out, aux)

  _, (logits, aux) = jax.lax.scan(step, cache, jnp.arange(prompt_len, seq_len))
  # logits [steps, b, vocab]; aux leaves [steps, b, 1, h] -> [b, steps, h]
  aux = jax.tree.map(lambda x: jnp.moveaxis(x[:, :, 0], 0, 1), aux)
  return jnp.moveaxis(logits, 0, 1), aux
