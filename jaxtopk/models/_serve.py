"""Batched generation over a paged KV cache: continuous batching.

:func:`serve` runs many requests (prompts of different lengths) through
``batch`` slots. Each layer keeps a ``jaxtopk.PagedKVCache``; every step
feeds each busy slot either the next chunk of its prompt (chunked prefill,
up to ``chunk`` tokens) or its last sampled token, in one ragged call of
``TopKDecoder.extend`` (``decode_attention`` over the pages, ``q_len`` the
chunk). A request that has its ``max_new_tokens`` (or samples ``eos_id``)
is finished: its pages are released in every layer and the next request
takes the slot and the freed pages. Greedy decoding.

Every generated token comes with the certificate of the attention that
produced it: the largest ``tv_bound`` over layers and heads, and whether
every row was valid.
"""

import collections
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtopk.attention import PagedKVCache
from jaxtopk.models._decoder import DecoderCache
from jaxtopk.models._decoder import TopKDecoder
from jaxtopk.models._decoder_attention import as_attention
from jaxtopk.selection import Certificate


@dataclasses.dataclass(frozen=True)
class Completion:
  """One request's generated tokens and their certificates.

  Attributes:
    tokens: the generated tokens (``max_new_tokens``, or fewer when
      ``eos_id`` came first, which is included).
    tv_bound: ``[len(tokens)]`` the largest ``tv_bound`` over layers and
      heads of the attention rows that produced each token (the prompt's
      last position for the first token); 0 for dense attention.
    valid: every one of those rows was valid.
  """

  tokens: list[int]
  tv_bound: np.ndarray
  valid: bool


@dataclasses.dataclass
class _Slot:
  request: int
  pending: list[int]
  reserved: int  # pages this request may hold
  tokens: list[int] = dataclasses.field(default_factory=list)
  tv: list[float] = dataclasses.field(default_factory=list)
  valid: bool = True


def _extend_impl(model, input_ids, cache, num_steps, *, attention):
  logits, cache, aux = model.extend(
    input_ids, cache, num_steps=num_steps, attention=attention
  )
  nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if all(isinstance(a, Certificate) for a in aux):  # the last real rows
    tv = jnp.max(jnp.stack([a.tv_bound[:, -1] for a in aux]), axis=(0, 2))
    ok = jnp.all(jnp.stack([a.valid[:, -1] for a in aux]), axis=(0, 2))
  else:  # a DecoderAttention with statistics of its own
    tv = jnp.full(nxt.shape, jnp.nan)
    ok = jnp.ones(nxt.shape, bool)
  return nxt, tv, ok, cache


_EXTEND: Any = nnx.jit(
  _extend_impl, static_argnames=("attention",), donate_argnames=("cache",)
)


@jax.jit
def _release(cache: DecoderCache, done) -> DecoderCache:
  return DecoderCache(layers=tuple(c.release(done) for c in cache.layers))


def serve(
  model: TopKDecoder,
  prompts: Sequence[Sequence[int]],
  *,
  max_new_tokens: int,
  attention: Any = None,
  batch: int = 4,
  page_size: int = 64,
  chunk: int = 128,
  num_pages: int | None = None,
  eos_id: int | None = None,
) -> tuple[list[Completion], dict]:
  """Generates ``max_new_tokens`` tokens for every prompt, ``batch`` at once.

  Args:
    model: the decoder.
    prompts: token ids of each request (lengths may differ; each >= 1).
    max_new_tokens: tokens to generate per request, >= 1.
    attention: None (dense), a jaxtopk policy (its ``block_size``, if any,
      must be ``page_size``), or a DecoderAttention.
    batch: slots decoded together.
    page_size: positions per page (and per summary block).
    chunk: prompt tokens fed per step (chunked prefill).
    num_pages: pages per layer's pool; default enough for every slot to
      hold the longest request. A request waits for a slot until its pages
      (prompt and new tokens) are free.
    eos_id: a token that finishes its request early.

  Returns:
    ``(completions, stats)``: one :class:`Completion` per prompt, in
    order, and ``stats`` (``steps``, ``prefill_steps``, ``decode_steps``,
    ``new_tokens``, ``seconds``, ``tokens_per_second``).

  Raises:
    ValueError: an empty prompt, a size that is not a positive int, or a
      request needing more pages than the pool has (all named).
  """
  for name, val in (
    ("max_new_tokens", max_new_tokens),
    ("batch", batch),
    ("page_size", page_size),
    ("chunk", chunk),
  ):
    if isinstance(val, bool) or not (isinstance(val, int) and val >= 1):
      raise ValueError(f"{name}={val!r} must be a positive int")
  prompts = [list(map(int, p)) for p in prompts]
  for i, p in enumerate(prompts):
    if not p:
      raise ValueError(f"prompts[{i}] is empty; every prompt needs a token")
  attention = as_attention(attention)
  block = getattr(getattr(attention, "policy", None), "block_size", page_size)
  if block != page_size:
    raise ValueError(
      f"the policy's block_size={block} must equal page_size={page_size}"
      " (the certified search bounds the cache's pages)"
    )

  def pages(n):
    return -(-n // page_size)

  need = [pages(len(p) + max_new_tokens) for p in prompts]
  per_seq = max(need, default=1)
  num_pages = batch * per_seq if num_pages is None else num_pages
  if max(need, default=0) > num_pages:
    i = int(np.argmax(need))
    raise ValueError(
      f"prompts[{i}] needs {need[i]} pages of page_size={page_size} with"
      f" max_new_tokens={max_new_tokens}; num_pages={num_pages}"
    )
  cfg = model.config
  dtype = model.embed.embedding[...].dtype
  cache = DecoderCache(
    layers=tuple(
      PagedKVCache.create(
        batch,
        num_pages,
        page_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        max_pages_per_seq=per_seq,
        dtype=dtype,
      )
      for _ in range(cfg.num_layers)
    )
  )
  queue = collections.deque(range(len(prompts)))
  slots: list[_Slot | None] = [None] * batch
  done_requests: dict[int, Completion] = {}
  stats: dict[str, Any] = dict(
    steps=0, prefill_steps=0, decode_steps=0, new_tokens=0
  )
  t0 = time.perf_counter()
  while queue or any(slots):
    free = num_pages - sum(s.reserved for s in slots if s is not None)
    for j in range(batch):
      if slots[j] is None and queue and need[queue[0]] <= free:
        i = queue.popleft()
        slots[j] = _Slot(i, list(prompts[i]), need[i])
        free -= need[i]
    prefill = any(s is not None and s.pending for s in slots)
    width = chunk if prefill else 1
    ids = np.zeros((batch, width), np.int32)
    num = np.zeros((batch,), np.int32)
    for j, s in enumerate(slots):
      if s is None:
        continue
      feed = s.pending[:width] if s.pending else [s.tokens[-1]]
      s.pending = s.pending[width:]
      ids[j, : len(feed)] = feed
      num[j] = len(feed)
    nxt, tv, ok, cache = _EXTEND(
      model, jnp.asarray(ids), cache, jnp.asarray(num), attention=attention
    )
    nxt, tv, ok = np.asarray(nxt), np.asarray(tv), np.asarray(ok)
    stats["steps"] += 1
    stats["prefill_steps" if prefill else "decode_steps"] += 1
    finished = np.zeros((batch,), bool)
    for j, s in enumerate(slots):
      if s is None or s.pending:
        continue  # idle, or its prompt is not all in yet
      s.tokens.append(int(nxt[j]))
      s.tv.append(float(tv[j]))
      s.valid &= bool(ok[j])
      stats["new_tokens"] += 1
      if len(s.tokens) >= max_new_tokens or s.tokens[-1] == eos_id:
        done_requests[s.request] = Completion(
          s.tokens, np.asarray(s.tv), s.valid
        )
        finished[j] = True
        slots[j] = None
    if finished.any():
      cache = _release(cache, jnp.asarray(finished))
  seconds = time.perf_counter() - t0
  stats.update(seconds=seconds, tokens_per_second=stats["new_tokens"] / seconds)
  return [done_requests[i] for i in range(len(prompts))], stats
