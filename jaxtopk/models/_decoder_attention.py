"""How the decoder attends: the one place it calls the library's attention.

``jaxtopk.models.TopKDecoder`` never calls an attention function itself: it
hands its rotated queries, keys and values to an object with ``prefill`` and
``decode`` methods (:class:`DecoderAttention`). :class:`PolicyAttention` is
that object for a jaxtopk policy; both its methods go through
:func:`library_attention`, the ONLY code of the models package that calls
the library's attention paths:

- prefill and training: ``jaxtopk.topk_attention(q, k, v, policy=...,
  is_causal=True)`` (blockwise, a Certificate per row);
- decode: ``jaxtopk.decode_attention(q, cache, policy=...)`` over the
  layer's ``jaxtopk.KVCache``.

A different decode path (multi-query, paged caches) is switched in there, or
passed per call as another DecoderAttention (experiments plug selectors that
are not policies in this way, see experiments/_selectors.py).
"""

import dataclasses
from typing import Any
from typing import Protocol

from jaxtyping import Array

from jaxtopk.attention import KVCache
from jaxtopk.attention import decode_attention
from jaxtopk.attention import topk_attention
from jaxtopk.selection import Dense
from jaxtopk.selection import Policy
from jaxtopk.selection.internal import check_policy


class DecoderAttention(Protocol):
  """The attention hook of :class:`jaxtopk.models.TopKDecoder`.

  Implementations must be hashable (frozen dataclasses): they are static
  arguments of jitted calls. Arrays are in the ``jax.nn`` layout; queries
  and keys arrive rotated (RoPE), the cache holds rotated keys.
  """

  def prefill(
    self, query: Array, key: Array, value: Array, *, rng: Array | None
  ) -> tuple[Array, Any]:
    """Causal attention over a whole sequence.

    Args:
      query: ``[batch, seq, heads, head_dim]``.
      key: ``[batch, seq, kv_heads, head_dim]``.
      value: ``[batch, seq, kv_heads, head_dim]``.
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
      cache: the layer's ``jaxtopk.KVCache`` (``kv_heads`` heads).
      rng: PRNG key for random selectors, or None.

    Returns:
      ``[batch, 1, heads, head_dim]`` output and per-row statistics with
      ``[batch, 1, heads]`` leaves.
    """
    ...


def library_attention(
  policy: Policy,
  query: Array,
  key: Array | None = None,
  value: Array | None = None,
  *,
  cache: KVCache | None = None,
  rng: Array | None = None,
) -> tuple[Array, Any]:
  """The decoder's one call into the library's attention.

  Causal prefill over ``key``/``value`` (``cache`` None):
  ``jaxtopk.topk_attention``; else one decode step over ``cache``:
  ``jaxtopk.decode_attention`` (MC-Search policies need ``rng``).

  Args:
    policy: a jaxtopk policy.
    query: ``[batch, q_len, heads, head_dim]`` (q_len 1 when decoding).
    key: ``[batch, seq, kv_heads, head_dim]`` (prefill only).
    value: ``[batch, seq, kv_heads, head_dim]`` (prefill only).
    cache: the layer's ``jaxtopk.KVCache`` (decode only).
    rng: PRNG key of MC-Search decoding.

  Returns:
    ``(output, Certificate)`` as the library path returns them.

  Raises:
    ValueError: MC-Search decoding without ``rng``.
  """
  if cache is None:
    res = topk_attention(query, key, value, policy=policy, is_causal=True)
    return res[0], res[-1]  # (output, Certificate): no residual asked for
  needs_key = policy.needs_rng
  if needs_key and rng is None:
    raise ValueError(f"{policy} decodes with MC-Search: pass rng=")
  res = decode_attention(
    query, cache, policy=policy, rng=rng if needs_key else None
  )
  return res[0], res[-1]  # (output, Certificate): no residual asked for


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
    check_policy(self.policy)

  def prefill(self, query, key, value, *, rng=None):
    """``jaxtopk.topk_attention`` with a causal mask; see DecoderAttention."""
    del rng  # prefill searches are deterministic (no MC-Search there)
    return library_attention(self.policy, query, key, value)

  def decode(self, query, cache, *, rng=None):
    """``jaxtopk.decode_attention`` over ``cache``; see DecoderAttention."""
    return library_attention(self.policy, query, cache=cache, rng=rng)


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


def cache_block_size(attention: Any, max_len: int) -> int:
  """Summary block of a decode cache for ``attention``.

  Delta-/MC-Search read the cache's per-block key boxes, so their
  ``Certified.block_size`` is the cache's; anything else takes
  ``min(64, max_len)``.
  """
  policy = getattr(attention, "policy", None)
  if policy is not None and not policy.scores_all:
    return policy.block_size
  return min(64, max_len)
