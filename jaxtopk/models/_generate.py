"""Autoregressive generation on the library's KV cache, with certificates.

:func:`generate` prefills the prompt (``TopKDecoder.prefill``: one
``jaxtopk.KVCache`` per layer, the prompt's attention through
``jaxtopk.topk_attention``), then decodes ``max_new_tokens - 1`` further
steps (``TopKDecoder.decode_step``: ``jaxtopk.decode_attention`` over the
caches) in one ``jax.lax.scan``, the whole call jitted. Each step picks the
next token greedily (``temperature=0``) or samples it from
``softmax(logits / temperature)``.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array
from jaxtyping import Int

from jaxtopk.models._decoder import TopKDecoder
from jaxtopk.models._decoder_attention import as_attention
from jaxtopk.models._decoder_attention import cache_block_size
from jaxtopk.selection import Certificate


def _pick(logits, temperature, rng):
  if temperature == 0.0:
    return jnp.argmax(logits, -1).astype(jnp.int32)
  return jax.random.categorical(rng, logits / temperature, -1).astype(jnp.int32)


def _generate_impl(
  model,
  input_ids,
  rng,
  *,
  max_new_tokens,
  attention,
  prefill_attention,
  temperature,
  block_size,
):
  b, s = input_ids.shape
  total = s + max_new_tokens
  rngs = [None] * 3 if rng is None else list(jax.random.split(rng, 3))
  logits, cache, prefill_aux = model.prefill(
    input_ids,
    total,
    attention=prefill_attention,
    block_size=block_size,
    rng=rngs[0],
  )
  first = _pick(logits, temperature, rngs[1])

  def step(carry, t):
    token, cache = carry
    step_rng = None if rng is None else jax.random.fold_in(rngs[2], t)
    layer_rng, pick_rng = (
      (None, None) if step_rng is None else jax.random.split(step_rng)
    )
    logits, cache, aux = model.decode_step(
      token, cache, attention=attention, rng=layer_rng
    )
    nxt = _pick(logits, temperature, pick_rng)
    return (nxt, cache), (nxt, aux)

  _, (tokens, aux) = jax.lax.scan(
    step, (first, cache), jnp.arange(max_new_tokens - 1)
  )
  new = jnp.concatenate([first[:, None], tokens.T], axis=1)  # [b, new]
  out = jnp.concatenate([input_ids.astype(jnp.int32), new], axis=1)
  # decode statistics [steps, b, 1, h] -> [b, steps, h], after the prompt's.
  aux = jax.tree.map(lambda x: jnp.moveaxis(x[:, :, 0], 0, 1), aux)
  certs = [
    jax.tree.map(
      lambda p, d: jnp.concatenate([p, d], axis=1), *_same_static(pre, dec)
    )
    for pre, dec in zip(prefill_aux, aux, strict=True)
  ]
  return out, certs


def _same_static(pre, dec):
  """Certificates of a dense or exact prefill (failure_prob 0) and of
  MC-Search decode steps (failure_prob delta) joined under the larger
  failure_prob, which bounds every row's (a sound statement for all)."""
  if isinstance(pre, Certificate) and isinstance(dec, Certificate):
    worst = max(pre.failure_prob, dec.failure_prob)
    pre = dataclasses.replace(pre, failure_prob=worst)
    dec = dataclasses.replace(dec, failure_prob=worst)
  return pre, dec


_GENERATE: Any = nnx.jit(
  _generate_impl,
  static_argnames=(
    "max_new_tokens",
    "attention",
    "prefill_attention",
    "temperature",
    "block_size",
  ),
)


def generate(
  model: TopKDecoder,
  input_ids: Int[Array, "b s"],
  *,
  max_new_tokens: int,
  attention: Any = None,
  dense_prefill: bool = False,
  temperature: float = 0.0,
  rng: Array | None = None,
  block_size: int | None = None,
) -> tuple[Int[Array, "b t"], list[Any]]:
  """Generates ``max_new_tokens`` tokens after each prompt.

  THEORY 8.1. The prompt is prefilled into the library's KV caches and
  every new token is decoded over them; ``attention`` chooses the keys of
  both (or of the decode steps only, with ``dense_prefill=True``, the
  protocol of native Top-k decoding: dense prefill, sparse decode).

  Args:
    model: the decoder.
    input_ids: int ``[batch, prompt_len]`` prompts, all of the same length
      (positions from 0; no padding).
    max_new_tokens: tokens to generate, >= 1.
    attention: None (dense), a jaxtopk policy, or a DecoderAttention whose
      ``prefill`` and ``decode`` return statistics of the same structure.
    dense_prefill: prefill the prompt densely whatever ``attention`` is.
    temperature: 0 for greedy decoding, > 0 to sample from
      ``softmax(logits / temperature)`` (needs ``rng``).
    rng: PRNG key for sampling, MC-Search and random selectors.
    block_size: cache summary block; default ``Certified.block_size`` for
      Delta-/MC-Search, else ``min(64, prompt_len + max_new_tokens)``.

  Returns:
    ``(tokens, certificates)``: int32 ``[batch, prompt_len +
    max_new_tokens]`` (prompt then generated tokens), and per layer the
    statistics of every query processed, ``[batch, prompt_len +
    max_new_tokens - 1, heads]`` leaves: the prompt's rows, then one row
    per decode step (the last generated token is never fed back). For a
    policy these are Certificates (Dense rows have ``tv_bound`` 0).

  Raises:
    ValueError: ``max_new_tokens < 1``, a bad ``temperature``, sampling
      without ``rng``, or an empty prompt.
    TypeError: ``attention`` is not None, a policy or a DecoderAttention.

  Example:
    >>> import jax.numpy as jnp, jaxtopk
    >>> from flax import nnx
    >>> from jaxtopk import models
    >>> model = models.TopKDecoder(
    ...     models.DecoderConfig(vocab_size=11), rngs=nnx.Rngs(0))
    >>> tokens, certs = models.generate(
    ...     model, jnp.zeros((2, 5), jnp.int32), max_new_tokens=3,
    ...     attention=jaxtopk.Certified(0.1))
    >>> tokens.shape, certs[0].tv_bound.shape
    ((2, 8), (2, 7, 4))
  """
  input_ids = jnp.asarray(input_ids)
  if input_ids.ndim != 2 or input_ids.shape[1] < 1:
    raise ValueError(
      f"input_ids must be [batch, prompt_len >= 1]; got {input_ids.shape=}"
    )
  if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
    raise ValueError(f"{max_new_tokens=} must be an int >= 1")
  temperature = float(temperature)
  if not temperature >= 0.0:
    raise ValueError(f"{temperature=} must be >= 0")
  if temperature > 0.0 and rng is None:
    raise ValueError(f"sampling ({temperature=}) needs rng=")
  attention = as_attention(attention)
  prefill_attention = as_attention(None) if dense_prefill else attention
  if block_size is None:
    block_size = cache_block_size(
      attention, input_ids.shape[1] + max_new_tokens
    )
  return _GENERATE(
    model,
    input_ids,
    rng,
    max_new_tokens=max_new_tokens,
    attention=attention,
    prefill_attention=prefill_attention,
    temperature=temperature,
    block_size=block_size,
  )
