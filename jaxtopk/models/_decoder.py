"""A small decoder-only transformer for native Top-k training and decoding.

THEORY 8 ([NATIVE]): the same model runs dense or with Top-k attention in the
training forward pass (8.2: the gradient flows through the softmax over the
kept keys; the selection itself is piecewise constant) and decodes from a KV
cache keeping a policy's keys (8.1). The attention runs on the library's own
certified paths, the ones users call:

- training and prefill: ``jaxtopk.topk_attention(q, k, v, policy=...,
  is_causal=True)``;
- decode: one ``jaxtopk.KVCache`` per layer (``init_kv_cache``,
  ``kv_cache_update``) and ``jaxtopk.decode_attention``.

Every call returns, per layer, the Certificate of its attention (THEORY 6.5).
Which keys are kept is chosen at call time by ``attention``: None (dense,
``jaxtopk.Dense()``), a jaxtopk policy, or any hashable object with the
:class:`DecoderAttention` methods ``prefill`` and ``decode`` (the hook through
which experiments plug in selectors that are not policies, e.g. approximate
Top-k; see experiments/_selectors.py). One set of weights can so be swept over
ratios, budgets and selectors without rebuilding the module.

Architecture: token embedding plus a learned projection of the previous
token's embedding ("token shift", as in RWKV and the smeared-key model of
Olsson et al. 2022: it gives a one-layer model the previous-token feature that
retrieval needs, so tiny CPU models learn lookup in minutes), then pre-norm
blocks (RMSNorm, causal self-attention, RMSNorm, GELU MLP), a final RMSNorm
and an untied output projection. No position embedding: causal attention with
token shift needs none for these tasks, and decoding can run past the trained
length. The attention parameters live in an ``nnx.MultiHeadAttention`` (names
``query``, ``key``, ``value``, ``out``), so they load into and from
``jaxtopk.nn.CertifiedTopKAttention`` unchanged.
"""

import dataclasses
from typing import Any
from typing import Protocol

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array
from jaxtyping import Float
from jaxtyping import Int

from jaxtopk.attention import KVCache
from jaxtopk.attention import decode_attention
from jaxtopk.attention import init_kv_cache
from jaxtopk.attention import kv_cache_update
from jaxtopk.attention import topk_attention
from jaxtopk.selection import Certified
from jaxtopk.selection import Dense
from jaxtopk.selection import Policy

DEFAULT_BLOCK_SIZE = (
  64  # cache summary block when neither policy nor caller set one
)


class DecoderAttention(Protocol):
  """The attention hook of :class:`TopKDecoder`.

  Implementations must be hashable (frozen dataclasses): they are static
  arguments of jitted calls. Arrays are in the ``jax.nn`` layout.
  """

  def prefill(
    self, query: Array, key: Array, value: Array, *, rng: Array | None
  ) -> tuple[Array, Any]:
    """Causal attention over a whole sequence.

    Args:
      query: ``[batch, seq, heads, head_dim]``.
      key: ``[batch, seq, heads, head_dim]``.
      value: ``[batch, seq, heads, head_dim]``.
      rng: PRNG key for random selectors, or None.

    Returns:
      ``[batch, seq, heads, head_dim]`` output and per-row statistics (a
      pytree, e.g. a Certificate with ``[batch, seq, heads]`` arrays).
    """
    ...

  def decode(
    self, query: Array, cache: KVCache, *, rng: Array | None
  ) -> tuple[Array, Any]:
    """One query per sequence over the cache (the step already appended).

    Args:
      query: ``[batch, 1, heads, head_dim]``.
      cache: the layer's ``jaxtopk.KVCache``.
      rng: PRNG key for random selectors, or None.

    Returns:
      ``[batch, 1, heads, head_dim]`` output and per-row statistics with
      ``[batch, 1, heads]`` leaves.
    """
    ...


@dataclasses.dataclass(frozen=True)
class PolicyAttention:
  """The library's certified attention for a jaxtopk policy.

  ``prefill`` is ``jaxtopk.topk_attention(..., is_causal=True)`` and
  ``decode`` is ``jaxtopk.decode_attention``; both return a Certificate.

  Attributes:
    policy: the selection policy (``jaxtopk.Dense()`` for dense attention).
  """

  policy: Policy

  def __post_init__(self):
    if not isinstance(self.policy, Policy):
      raise TypeError(f"policy={self.policy!r} must be a jaxtopk policy")

  def prefill(self, query, key, value, *, rng=None):
    """``jaxtopk.topk_attention`` with a causal mask; see DecoderAttention."""
    del rng  # prefill searches are exact (every logit is computed)
    return topk_attention(query, key, value, policy=self.policy, is_causal=True)

  def decode(self, query, cache, *, rng=None):
    """``jaxtopk.decode_attention`` over ``cache``; see DecoderAttention."""
    needs_key = (
      isinstance(self.policy, Certified) and self.policy.search.needs_rng
    )
    if needs_key and rng is None:
      raise ValueError(f"{self.policy} decodes with MC-Search: pass rng=")
    return decode_attention(
      query, cache, policy=self.policy, key=rng if needs_key else None
    )


def as_attention(attention: Any) -> DecoderAttention:
  """None (dense), a jaxtopk policy, or a DecoderAttention, as the latter.

  Raises:
    TypeError: for anything else.
  """
  if attention is None:
    return PolicyAttention(Dense())
  if isinstance(attention, Policy):
    return PolicyAttention(attention)
  if callable(getattr(attention, "prefill", None)) and callable(
    getattr(attention, "decode", None)
  ):
    return attention
  raise TypeError(
    f"attention={attention!r} must be None, a jaxtopk policy or an object "
    "with prefill() and decode() (jaxtopk.models.DecoderAttention)"
  )


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Sizes of a :class:`TopKDecoder`.

  Attributes:
    vocab_size: number of token ids.
    num_layers: transformer blocks.
    num_heads: attention heads per block.
    model_dim: residual width; a multiple of ``num_heads``.
    mlp_dim: hidden width of the MLP.
    token_shift: add a projection of the previous token's embedding.
  """

  vocab_size: int
  num_layers: int = 2
  num_heads: int = 4
  model_dim: int = 64
  mlp_dim: int = 256
  token_shift: bool = True

  def __post_init__(self):
    for name in ("vocab_size", "num_layers", "num_heads", "model_dim"):
      value = getattr(self, name)
      if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"DecoderConfig.{name}={value!r} must be >= 1")
    if self.model_dim % self.num_heads:
      raise ValueError(
        f"model_dim={self.model_dim} must be a multiple of "
        f"num_heads={self.num_heads}"
      )

  @property
  def head_dim(self) -> int:
    """Width of one attention head, ``model_dim // num_heads``."""
    return self.model_dim // self.num_heads


@flax.struct.dataclass
class DecoderCache:
  """Decode state of a :class:`TopKDecoder`.

  Attributes:
    layers: one ``jaxtopk.KVCache`` per layer (head-major keys and values
      with per-block key boxes and value norms).
    last_token: int32 ``[batch]``, the last token fed (for token shift).
  """

  layers: tuple[KVCache, ...]
  last_token: jax.Array


class _Block(nnx.Module):
  """Pre-norm transformer block; attention injected per call."""

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    dim, heads = config.model_dim, config.num_heads
    self.attn_norm = nnx.RMSNorm(dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
      heads, dim, decode=False, use_bias=False, rngs=rngs
    )
    self.mlp_norm = nnx.RMSNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, config.mlp_dim, rngs=rngs)
    self.down = nnx.Linear(config.mlp_dim, dim, rngs=rngs)

  def qkv(self, x):
    """Queries, keys, values ``[b, s, heads, head_dim]`` of ``x``."""
    h = self.attn_norm(x)
    return self.attn.query(h), self.attn.key(h), self.attn.value(h)

  def _finish(self, x, out):
    x = x + self.attn.out(out)  # out [b, s, h, d] -> [b, s, dim]
    return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))

  def __call__(self, x, *, attention, rng):
    """Causal self-attention over ``x`` ``[b, s, dim]``; also returns k, v."""
    q, k, v = self.qkv(x)  # [b, s, h, d] each
    out, aux = attention.prefill(q, k, v, rng=rng)
    return self._finish(x, out), k, v, aux

  def step(self, x, cache, *, attention, rng):
    """One token ``x`` ``[b, 1, dim]``: append to ``cache``, attend over it."""
    q, k, v = self.qkv(x)  # [b, 1, h, d]
    cache = kv_cache_update(cache, k, v)
    out, aux = attention.decode(q, cache, rng=rng)
    return self._finish(x, out), cache, aux


def _block_size(attention, max_len: int, block_size: int | None) -> int:
  if block_size is not None:
    return block_size
  policy = getattr(attention, "policy", None)
  if isinstance(policy, Certified) and not policy.search.scores_all:
    return policy.block_size  # Delta-/MC-Search read the cache's blocks
  return min(DEFAULT_BLOCK_SIZE, max_len)


class TopKDecoder(nnx.Module):
  """Decoder-only transformer whose attention keeps a policy's keys.

  THEORY 8.1-8.4. Train with ``model(tokens, attention=...)`` (the library's
  ``topk_attention``); decode with ``prefill`` (dense, THEORY 8.1) then
  ``decode_step`` (the library's ``KVCache`` and ``decode_attention``), or
  both at once with :func:`decode_teacher_forced`.

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

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    self.config = config
    dim = config.model_dim
    self.embed = nnx.Embed(config.vocab_size, dim, rngs=rngs)
    self.shift = (
      nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
      if config.token_shift
      else None
    )
    self.blocks = nnx.List(
      [_Block(config, rngs=rngs) for _ in range(config.num_layers)]
    )
    self.final_norm = nnx.RMSNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, config.vocab_size, rngs=rngs)

  def _embed(self, tokens, previous):
    x = self.embed(tokens)
    if self.shift is not None:
      x = x + self.shift(self.embed(previous))
    return x

  def _layer_rng(self, rng, layer):
    return None if rng is None else jax.random.fold_in(rng, layer)

  def __call__(
    self,
    tokens: Int[Array, "b s"],
    *,
    attention: Any = None,
    rng: Array | None = None,
  ) -> tuple[Float[Array, "b s v"], list[Any]]:
    """Causal forward pass (training and scoring).

    Args:
      tokens: int ``[batch, seq_len]``.
      attention: None (dense), a jaxtopk policy, or a DecoderAttention.
      rng: PRNG key for random selectors (folded in per layer).

    Returns:
      float32 logits ``[batch, seq_len, vocab_size]`` and a list (one per
      layer) of the attention's statistics: for a policy, its Certificate
      with ``[batch, seq_len, heads]`` arrays.

    Raises:
      TypeError: ``attention`` is none of the above.
    """
    logits, _, aux = self._forward(tokens, as_attention(attention), rng)
    return logits, aux

  def _forward(self, tokens, attention, rng):
    previous = jnp.pad(tokens[:, :-1], ((0, 0), (1, 0)))  # PAD first
    x = self._embed(tokens, previous)
    kvs, aux = [], []
    for layer, block in enumerate(self.blocks):
      x, k, v, layer_aux = block(
        x, attention=attention, rng=self._layer_rng(rng, layer)
      )
      kvs.append((k, v))
      aux.append(layer_aux)
    return self.head(self.final_norm(x)).astype(jnp.float32), kvs, aux

  def prefill(
    self,
    tokens: Int[Array, "b s"],
    max_len: int,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
  ) -> tuple[Float[Array, "b s v"], DecoderCache, list[Any]]:
    """Dense forward over ``tokens`` that fills one KVCache per layer.

    Args:
      tokens: int ``[batch, seq_len]``, the prompt.
      max_len: positions the caches must hold (``seq_len`` and every step to
        decode); rounded up to a multiple of ``block_size``.
      block_size: positions per key-summary block of the caches; must equal
        ``Certified.block_size`` for Delta-/MC-Search decoding.

    Returns:
      logits ``[batch, seq_len, vocab]``, a :class:`DecoderCache` holding the
      prompt, and the per-layer Certificates of the dense prefill.

    Raises:
      ValueError: ``seq_len > max_len`` or a bad ``block_size``.
    """
    b, s = tokens.shape
    if s > max_len:
      raise ValueError(f"prompt length {s=} must be <= {max_len=}")
    logits, kvs, aux = self._forward(tokens, as_attention(None), None)
    capacity = -(-max_len // block_size) * block_size
    cfg = self.config
    layers = []
    for k, v in kvs:
      empty = init_kv_cache(
        b,
        capacity,
        cfg.num_heads,
        cfg.head_dim,
        block_size=block_size,
        dtype=k.dtype,
      )
      layers.append(kv_cache_update(empty, k, v))
    cache = DecoderCache(
      layers=tuple(layers), last_token=tokens[:, -1].astype(jnp.int32)
    )
    return logits, cache, aux

  def decode_step(
    self,
    token: Int[Array, " b"],
    cache: DecoderCache,
    *,
    attention: Any = None,
    rng: Array | None = None,
  ) -> tuple[Float[Array, "b v"], DecoderCache, list[Any]]:
    """Feeds one token per row through the caches.

    Args:
      token: int ``[batch]``.
      cache: from :meth:`prefill` or a previous step; must have room (a full
        cache drops the new position: ``kv_cache_update`` saturates).
      attention: None (dense), a jaxtopk policy, or a DecoderAttention.
      rng: PRNG key for random selectors and MC-Search (folded per layer).

    Returns:
      float32 logits ``[batch, vocab]``, the updated cache, and per layer
      the statistics (a Certificate with ``[batch, 1, heads]`` arrays for a
      policy).
    """
    attention = as_attention(attention)
    x = self._embed(token[:, None], cache.last_token[:, None])  # [b, 1, dim]
    layers, aux = [], []
    for layer, block in enumerate(self.blocks):
      x, layer_cache, layer_aux = block.step(
        x,
        cache.layers[layer],
        attention=attention,
        rng=self._layer_rng(rng, layer),
      )
      layers.append(layer_cache)
      aux.append(layer_aux)
    logits = self.head(self.final_norm(x))[:, 0].astype(jnp.float32)
    cache = DecoderCache(
      layers=tuple(layers), last_token=token.astype(jnp.int32)
    )
    return logits, cache, aux


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
  bs = _block_size(attention, seq_len, block_size)
  _, cache, _ = model.prefill(tokens[:, :prompt_len], seq_len, block_size=bs)

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
