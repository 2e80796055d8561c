"""A small decoder-only transformer for native Top-k training and decoding.

THEORY 8 ([NATIVE]): the same model runs dense or with Top-k attention in the
training forward pass (8.2: the gradient flows through the softmax over the
kept keys; the selection itself is piecewise constant) and decodes from a KV
cache with any selector (8.1, 8.3). Which keys each query keeps is chosen by a
*selector* passed at call time (a jaxtopk policy such as ``jaxtopk.Ratio``,
run through ``jaxtopk.select``; a custom selector such as
``jaxtopk.nn.MixedTopK``; or None for dense), so one set of weights can be
swept over ratios and precisions without rebuilding the module.

Architecture: token embedding plus a learned projection of the previous
token's embedding ("token shift", as in RWKV and the smeared-key model of
Olsson et al. 2022: it gives a one-layer model the previous-token feature that
retrieval needs, so tiny CPU models learn lookup in minutes), then pre-norm
blocks (RMSNorm, causal self-attention, RMSNorm, GELU MLP), a final RMSNorm
and an untied output projection. No position embedding: causal attention with
token shift needs none for these tasks, and decoding can run past the trained
length.

The KV cache is a pytree, head-major ``[batch, heads, max_len, head_dim]``
per layer (DESIGN: head-major inside), written in place by
``jax.lax.dynamic_update_slice``.
"""

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

import jaxtopk
from jaxtopk import theory
from jaxtopk.nn._attention import CertifiedTopKAttention
from jaxtopk.nn._selectors import exact_topk_keep
from jaxtopk.theory._rows import log_slack

# A jaxtopk policy (run by jaxtopk.select), a callable (logits, mask, rng) ->
# keep such as jaxtopk.nn.MixedTopK, or None for dense.
Selector = Any


def keep_set(selector, logits, mask, rng=None) -> jax.Array:
  """The bool kept set ``[..., n_keys]`` of ``selector`` on ``logits``.

  A ``jaxtopk.Policy`` goes through ``jaxtopk.select`` (so ``Ratio(rho)`` is
  the library's exact Top-k and ``Certified(eps)`` its certified search);
  any other callable is called as ``selector(logits, mask, rng)``; None
  keeps every real key.
  """
  if selector is None:
    return mask
  if isinstance(selector, jaxtopk.Policy):
    return jaxtopk.select(logits, selector, mask=mask).keep
  return selector(logits, mask, rng)


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
    return self.model_dim // self.num_heads


@flax.struct.dataclass
class DecodeCache:
  """KV cache of a :class:`TopKDecoder`.

  Attributes:
    keys: per layer, ``[batch, heads, max_len, head_dim]``.
    values: per layer, ``[batch, heads, max_len, head_dim]``.
    length: int32 scalar, number of filled positions.
    last_token: int32 ``[batch]``, the last token fed (for token shift).
  """

  keys: tuple
  values: tuple
  length: jax.Array
  last_token: jax.Array


def truncated_softmax(logits, keep) -> jax.Array:
  """Softmax over the kept keys, exactly 0 elsewhere (THEORY 1, P_hat).

  Written with double ``where`` so dropped keys get neither overflow nor NaN
  gradients. ``logits`` float32 ``[..., n_keys]``, ``keep`` bool.
  """
  top = jnp.max(logits, axis=-1, where=keep, initial=-jnp.inf, keepdims=True)
  top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
  e = jnp.where(keep, jnp.exp(jnp.where(keep, logits - top, 0.0)), 0.0)
  return e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)


def select_attend(q, k, v, mask, *, selector=None, rng=None, stats=False):
  """Attention of head-major ``q`` over ``k, v`` keeping ``selector``'s keys.

  Args:
    q: ``[batch, heads, q_len, head_dim]``.
    k: ``[batch, heads, kv_len, head_dim]``.
    v: ``[batch, heads, kv_len, head_dim]``.
    mask: bool broadcastable to ``[batch, heads, q_len, kv_len]``, True for
      a real (e.g. causal, filled) key.
    selector: ``(logits, mask, rng) -> keep`` or None for dense.
    rng: key for random selectors.
    stats: also return per-row ``entropy`` (dense), ``tv`` (the dropped
      mass of the float32 logits, THEORY 2.1), ``tv_bound`` (a sound upper
      bound on the dropped mass of the exact logits q.k * scale: log tau plus
      the reduction slack of ``jaxtopk.theory`` plus twice the float32 dot
      product error (d + 2) eps scale max_i sum_c |q_c k_ic|, tail up and head
      down), ``kept`` and ``precision`` (THEORY 8.3: the fraction of the kept
      keys that are among the exact top-``kept`` logits).

  Returns:
    ``[batch, heads, q_len, head_dim]`` in ``q.dtype``, and a dict of
    ``[batch, heads, q_len]`` statistics (empty unless ``stats``).
  """
  scale = q.shape[-1] ** -0.5
  logits = jnp.einsum(
    "bhqd,bhsd->bhqs", q.astype(jnp.float32), k.astype(jnp.float32)
  )  # [b, h, q, s]
  logits = logits * scale
  mask = jnp.broadcast_to(mask, logits.shape)
  keep = keep_set(selector, logits, mask, rng)
  probs = truncated_softmax(logits, keep)
  out = jnp.einsum("bhqs,bhsd->bhqd", probs, v.astype(jnp.float32))
  info = {}
  if stats:
    head_dim = q.shape[-1]
    abs_dot = jnp.einsum(
      "bhqd,bhsd->bhqs",
      jnp.abs(q.astype(jnp.float32)),
      jnp.abs(k.astype(jnp.float32)),
    )  # [b, h, q, s]
    dot_err = jnp.max(abs_dot, axis=-1, where=mask, initial=0.0)
    dot_err = dot_err * (head_dim + 2) * jnp.finfo(jnp.float32).eps * scale
    log_tv = theory.log_tail_mass(logits, keep, mask)
    slack = log_slack(logits.shape[-1], jnp.float32) + 2.0 * dot_err * 1.01
    kept = jnp.sum(keep, axis=-1)
    top = exact_topk_keep(logits, mask, kept, logits.shape[-1])
    info = dict(
      precision=jnp.sum(keep & top, axis=-1) / jnp.maximum(kept, 1),
      entropy=theory.attention_entropy(logits, mask),
      tv=jnp.exp(log_tv),
      # exp of a log bound below ~-87 underflows float32 (CPU flushes
      # subnormals); a non-empty tail then reports the smallest normal.
      tv_bound=jnp.where(
        jnp.isneginf(log_tv),
        0.0,
        jnp.clip(jnp.exp(log_tv + slack), jnp.finfo(jnp.float32).tiny, 1.0),
      ),
      kept=kept,
    )
  return out.astype(q.dtype), info


class _Block(nnx.Module):
  """Pre-norm transformer block around a CertifiedTopKAttention layer.

  The attention parameters live in ``self.attn``, a
  ``jaxtopk.nn.CertifiedTopKAttention`` (so they load into and from any
  nnx.MultiHeadAttention); the block reuses its projections with its own
  head-major KV cache and selector hook (``select_attend``), which
  ``CertifiedTopKAttention`` does not offer for custom selectors.
  ``library_attention`` runs the layer itself, for cross-checks.
  """

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    dim, heads = config.model_dim, config.num_heads
    self.attn_norm = nnx.RMSNorm(dim, rngs=rngs)
    self.attn = CertifiedTopKAttention(
      heads,
      dim,
      policy=jaxtopk.Dense(),
      decode=False,
      use_bias=False,
      rngs=rngs,
    )
    self.mlp_norm = nnx.RMSNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, config.mlp_dim, rngs=rngs)
    self.down = nnx.Linear(config.mlp_dim, dim, rngs=rngs)

  def _qkv(self, x):
    h = self.attn_norm(x)
    heads = [
      proj(h).transpose(0, 2, 1, 3)  # [b, h, s, d]
      for proj in (self.attn.query, self.attn.key, self.attn.value)
    ]
    return tuple(heads)

  def _finish(self, x, attn):
    x = x + self.attn.out(attn.transpose(0, 2, 1, 3))  # [b, s, dim]
    return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))

  def library_attention(self, x, policy):
    """The attention sublayer output through ``CertifiedTopKAttention``."""
    self.attn.policy = policy
    return self.attn(self.attn_norm(x), is_causal=True)

  def my_attention(self, x, selector=None):
    """The same sublayer output through ``select_attend``."""
    q, k, v = self._qkv(x)
    s = x.shape[1]
    causal = jnp.tril(jnp.ones((s, s), bool))[None, None]  # [1, 1, s, s]
    attn, _ = select_attend(q, k, v, causal, selector=selector)
    return self.attn.out(attn.transpose(0, 2, 1, 3))

  def __call__(self, x, *, selector, rng, stats):
    """Causal self-attention over ``x`` ``[b, s, dim]``; also returns k, v."""
    q, k, v = self._qkv(x)  # [b, h, s, d] each
    s = x.shape[1]
    causal = jnp.tril(jnp.ones((s, s), bool))[None, None]  # [1, 1, s, s]
    attn, info = select_attend(
      q, k, v, causal, selector=selector, rng=rng, stats=stats
    )
    return self._finish(x, attn), k, v, info

  def step(self, x, cache_k, cache_v, length, *, selector, rng, stats):
    """One token ``x`` ``[b, 1, dim]`` against the cache; returns new k, v."""
    q, k, v = self._qkv(x)  # [b, h, 1, d]
    cache_k = jax.lax.dynamic_update_slice(cache_k, k, (0, 0, length, 0))
    cache_v = jax.lax.dynamic_update_slice(cache_v, v, (0, 0, length, 0))
    filled = jnp.arange(cache_k.shape[2]) <= length  # [max_len]
    attn, info = select_attend(
      q,
      cache_k,
      cache_v,
      filled[None, None, None],
      selector=selector,
      rng=rng,
      stats=stats,
    )
    return self._finish(x, attn), cache_k, cache_v, info


class TopKDecoder(nnx.Module):
  """Decoder-only transformer whose attention keeps a selector's keys.

  THEORY 8.1-8.4. Train with ``model(tokens, selector=...)``; decode with
  ``prefill`` (dense, THEORY 8.1) then ``decode_step`` with any selector.

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> import jaxtopk
    >>> from jaxtopk.nn import DecoderConfig, TopKDecoder
    >>> model = TopKDecoder(DecoderConfig(vocab_size=11), rngs=nnx.Rngs(0))
    >>> tokens = jnp.zeros((3, 7), jnp.int32)
    >>> logits, _ = model(tokens, selector=jaxtopk.Ratio(0.5))
    >>> logits.shape
    (3, 7, 11)
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

  def __call__(self, tokens, *, selector=None, rng=None, stats=False):
    """Causal forward pass.

    Args:
      tokens: int ``[batch, seq_len]``.
      selector: keys kept by every query (None = dense).
      rng: key for random selectors.
      stats: return per-layer attention statistics.

    Returns:
      float32 logits ``[batch, seq_len, vocab_size]`` and a list (one per
      layer) of dicts of ``[batch, heads, seq_len]`` statistics (empty dicts
      unless ``stats``).
    """
    logits, _, info = self._forward(tokens, selector, rng, stats)
    return logits, info

  def _forward(self, tokens, selector, rng, stats):
    previous = jnp.pad(tokens[:, :-1], ((0, 0), (1, 0)))  # PAD first
    x = self._embed(tokens, previous)
    kvs, info = [], []
    for layer, block in enumerate(self.blocks):
      x, k, v, layer_info = block(
        x, selector=selector, rng=self._layer_rng(rng, layer), stats=stats
      )
      kvs.append((k, v))
      info.append(layer_info)
    return self.head(self.final_norm(x)).astype(jnp.float32), kvs, info

  def prefill(self, tokens, max_len: int, *, stats=False):
    """Dense forward over ``tokens`` ``[b, s]`` that fills a KV cache.

    Returns:
      logits ``[b, s, vocab]``, a :class:`DecodeCache` of ``max_len``
      positions holding ``s``, and per-layer statistics as ``__call__``.
    """
    b, s = tokens.shape
    if s > max_len:
      raise ValueError(f"prompt length {s=} must be <= {max_len=}")
    logits, kvs, info = self._forward(tokens, None, None, stats)
    pad = ((0, 0), (0, 0), (0, max_len - s), (0, 0))
    cache = DecodeCache(
      keys=tuple(jnp.pad(k, pad) for k, _ in kvs),
      values=tuple(jnp.pad(v, pad) for _, v in kvs),
      length=jnp.asarray(s, jnp.int32),
      last_token=tokens[:, -1].astype(jnp.int32),
    )
    return logits, cache, info

  def decode_step(
    self, token, cache: DecodeCache, *, selector=None, rng=None, stats=False
  ):
    """Feeds one token per row through the cache.

    Args:
      token: int ``[batch]``.
      cache: from :meth:`prefill` or a previous step; must have room.
      selector: keys kept by the query (None = dense).
      rng: key for random selectors.
      stats: return per-layer statistics of ``[batch, heads, 1]``.

    Returns:
      float32 logits ``[batch, vocab]``, the updated cache, statistics.
    """
    x = self._embed(token[:, None], cache.last_token[:, None])  # [b, 1, dim]
    keys, values, info = [], [], []
    for layer, block in enumerate(self.blocks):
      x, k, v, layer_info = block.step(
        x,
        cache.keys[layer],
        cache.values[layer],
        cache.length,
        selector=selector,
        rng=self._layer_rng(rng, layer),
        stats=stats,
      )
      keys.append(k)
      values.append(v)
      info.append(layer_info)
    logits = self.head(self.final_norm(x))[:, 0].astype(jnp.float32)
    cache = DecodeCache(
      keys=tuple(keys),
      values=tuple(values),
      length=cache.length + 1,
      last_token=token.astype(jnp.int32),
    )
    return logits, cache, info


def decode_teacher_forced(
  model: TopKDecoder,
  tokens,
  *,
  prompt_len: int,
  selector=None,
  rng=None,
  stats=False,
):
  """Prefills ``tokens[:, :prompt_len]`` densely, then decodes the rest.

  THEORY 8.1: dense prefill, then one decode step per remaining position,
  feeding the true tokens (teacher forcing) and keeping ``selector``'s keys.
  The steps run in one ``jax.lax.scan`` (one compiled step body). Wrap in
  ``nnx.jit`` with ``prompt_len``, ``selector`` and ``stats`` static.

  Args:
    model: the decoder.
    tokens: int ``[batch, seq_len]``.
    prompt_len: dense prefix length, in [1, seq_len).
    selector: keys kept at decode (None = dense).
    rng: key for random selectors (folded in per step).
    stats: also return statistics.

  Returns:
    float32 logits ``[batch, seq_len - prompt_len, vocab]`` (the predictions
    after each decoded position), and a list (one per layer) of dicts of
    ``[batch, heads, seq_len - prompt_len]`` statistics (empty unless
    ``stats``).
  """
  seq_len = tokens.shape[1]
  if not 1 <= prompt_len < seq_len:
    raise ValueError(f"{prompt_len=} must be in [1, {seq_len=})")
  _, cache, _ = model.prefill(tokens[:, :prompt_len], seq_len)

  def step(cache, t):
    step_rng = None if rng is None else jax.random.fold_in(rng, t)
    token = jax.lax.dynamic_index_in_dim(tokens, t, axis=1, keepdims=False)
    out, cache, info = model.decode_step(
      token, cache, selector=selector, rng=step_rng, stats=stats
    )
    return cache, (out, info)

  _, (logits, infos) = jax.lax.scan(
    step, cache, jnp.arange(prompt_len, seq_len)
  )  # logits [steps, b, vocab]; infos leaves [steps, b, h, 1]
  infos = jax.tree.map(lambda x: jnp.moveaxis(x[..., 0], 0, -1), infos)
  return jnp.moveaxis(logits, 0, 1), infos
