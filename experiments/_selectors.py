"""Key selectors for the native Top-k study (experiments/native_topk.py).

A *selector* is a frozen, hashable dataclass called as
``selector(logits, mask, rng) -> keep``: from float32 logits
``[..., n_keys]`` and a bool ``mask`` (True = real key, e.g. causal) it
returns the bool kept set ``keep`` (a subset of ``mask``). Attention then
renormalises the softmax over ``keep`` (THEORY 1, the truncated
distribution P_hat). Selectors are the hook the native Top-k experiments need
beyond the library's policies (THEORY 8.3): an approximate Top-k of a chosen
precision, and jax.lax.approx_max_k. ``None`` means dense (keep = mask).

- :class:`ExactTopK` keeps ``ceil(rho * n)`` largest logits of each row, ``n``
  = the row's real keys (THEORY 8.1; the same set as ``jaxtopk.Ratio``).
- :class:`MixedTopK` keeps the same budget, but only ``round(precision *
  budget)`` of it from the exact top set and the rest uniformly from the
  other real keys (THEORY 8.3: precision p = |K_approx cap K_top| / |K_top|).
- :class:`ApproxMaxK` keeps the budget chosen by ``jax.lax.approx_max_k``
  (``emulate=False``; XLA CPU and GPU fall back to an exact sort, so recall
  is 1 there), or by a pure-jnp emulation of its TPU PartialReduce algorithm
  (``emulate=True``): keys are dealt into L bins by index modulo L, each bin
  keeps its maximum, and the budget is the top of the bin maxima, with
  ``L = 2**ceil(log2((budget - 1) / (1 - recall_target)))`` (the bin count
  XLA derives from the recall target, without TPU's 128-bin floor, which
  would make it exact at the context lengths a CPU trains).

Exact Top-k and certified sets come from the library's policies
(``jaxtopk.Ratio(rho)``, ``jaxtopk.Certified(eps)``), which the decoder runs
on the library's own attention paths; ``ExactTopK`` keeps the same set as
``Ratio(rho)`` (tested) with one ``lax.top_k`` and is the building block of
the approximate selectors. These selectors are not policies (a policy is a
rule the library's certified paths honour; these are experiment devices that
deliberately keep a wrong set), so they reach ``jaxtopk.models.TopKDecoder``
through its attention hook: :class:`SelectorAttention` implements
``jaxtopk.models.DecoderAttention`` with them, and ``DENSE_STATS`` is the
dense attention that also reports each row's entropy (THEORY 8.4).

Ties among logits are broken by ``jax.lax.top_k`` (the lower index first).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxtopk import theory
from jaxtopk.selection import core

# Ranking value given to masked keys; used only to order keys, never inside a
# softmax (masked keys are removed with ``where``).
_RANK_FLOOR = -1e30


def _check_rho(rho) -> None:
  if not (isinstance(rho, int | float) and 0.0 < rho <= 1.0):
    raise ValueError(f"{rho=} must be in (0, 1]")


def _ranking(logits, mask):
  return jnp.where(mask, logits.astype(jnp.float32), _RANK_FLOOR)


def num_kept(mask: jax.Array, rho: float) -> jax.Array:
  """Per-row budget ``max(1, ceil(rho * n))``, ``n`` = real keys of the row.

  Args:
    mask: bool ``[..., n_keys]``.
    rho: kept fraction in (0, 1].

  Returns:
    int32 ``[...]``; 0 only for a row with no real key.
  """
  n = jnp.sum(mask, axis=-1, dtype=jnp.int32)
  topk = jnp.ceil(rho * n.astype(jnp.float32) - 1e-6).astype(jnp.int32)
  return jnp.minimum(jnp.maximum(topk, 1), n)


def _static_topk(n_keys: int, rho: float) -> int:
  return max(1, min(n_keys, math.ceil(rho * n_keys - 1e-9)))


def keep_first(indices, counts, n_keys: int) -> jax.Array:
  """Bool ``[..., n_keys]`` set of ``indices[..., :counts]``.

  Args:
    indices: int ``[..., m]`` distinct key indices, in priority order.
    counts: int ``[...]`` how many of them to keep (<= m).
    n_keys: size of the key axis.
  """
  order = jnp.arange(indices.shape[-1])
  take = order < counts[..., None]  # [..., m]
  keep = jnp.zeros((*indices.shape[:-1], n_keys), bool)
  return jnp.put_along_axis(keep, indices, take, axis=-1, inplace=False)


def exact_topk_keep(logits, mask, topk_per_row, max_topk: int) -> jax.Array:
  """Keeps the ``topk_per_row`` largest real logits (<= ``max_topk``)."""
  _, idx = jax.lax.top_k(_ranking(logits, mask), max_topk)  # [..., max_topk]
  return keep_first(idx, topk_per_row, logits.shape[-1]) & mask


def _ranks(priority):
  """Rank of each entry along the last axis (0 = smallest)."""
  return jnp.argsort(jnp.argsort(priority, axis=-1), axis=-1)


@dataclasses.dataclass(frozen=True)
class ExactTopK:
  """Keep the ``ceil(rho * n)`` largest logits of each row (THEORY 8.1).

  Attributes:
    rho: kept fraction in (0, 1]; 1 keeps every real key (dense).
  """

  rho: float

  def __post_init__(self):
    _check_rho(self.rho)

  def __call__(self, logits, mask, rng=None) -> jax.Array:
    """Bool ``[..., n_keys]`` kept set; ``rng`` is unused."""
    del rng
    max_topk = _static_topk(logits.shape[-1], self.rho)
    return exact_topk_keep(logits, mask, num_kept(mask, self.rho), max_topk)


@dataclasses.dataclass(frozen=True)
class MixedTopK:
  """Budget ``ceil(rho * n)``, a fraction ``precision`` of it truly top.

  THEORY 8.3. Keeps ``round(precision * budget)`` keys drawn uniformly from
  the exact top-budget set and fills the budget with keys drawn uniformly
  from the other real keys; when too few other keys exist, the deficit is
  filled from the top set (so the achieved precision can exceed the target;
  measure it with :func:`selection_precision`).

  Attributes:
    rho: kept fraction in (0, 1].
    precision: target precision in [0, 1].
  """

  rho: float
  precision: float

  def __post_init__(self):
    _check_rho(self.rho)
    p = self.precision
    if not (isinstance(p, int | float) and 0.0 <= p <= 1.0):
      raise ValueError(f"precision={p!r} must be in [0, 1]")

  def __call__(self, logits, mask, rng) -> jax.Array:
    """Bool ``[..., n_keys]`` kept set; ``rng`` draws the random keys."""
    if rng is None:
      raise ValueError("MixedTopK needs an rng key; got rng=None")
    top = ExactTopK(self.rho)(logits, mask)
    budget = num_kept(mask, self.rho)  # [...]
    n = jnp.sum(mask, axis=-1, dtype=jnp.int32)
    from_top = jnp.round(self.precision * budget).astype(jnp.int32)
    others = mask & ~top
    from_top = jnp.maximum(from_top, budget - (n - budget))
    u = jax.random.uniform(rng, logits.shape)
    keep_top = top & (_ranks(jnp.where(top, u, 2.0)) < from_top[..., None])
    keep_other = others & (
      _ranks(jnp.where(others, u, 2.0)) < (budget - from_top)[..., None]
    )
    return keep_top | keep_other


def approx_bins(n_keys: int, topk: int, recall_target: float) -> int:
  """Bin count of the PartialReduce approximate top-k, at most ``n_keys``."""
  if topk <= 1:
    return n_keys
  bins = 2 ** math.ceil(math.log2((topk - 1) / (1.0 - recall_target)))
  return max(topk, min(n_keys, bins))


@dataclasses.dataclass(frozen=True)
class ApproxMaxK:
  """Budget chosen by an approximate max-k at ``recall_target``.

  The static budget is ``ceil(rho * n_keys)`` over the key axis; each row
  keeps the first ``ceil(rho * n)`` of the candidates (``n`` its real keys).

  Attributes:
    rho: kept fraction in (0, 1].
    recall_target: in (0, 1).
    emulate: True runs the pure-jnp emulation of the TPU algorithm (real
      approximation on any backend); False calls ``jax.lax.approx_max_k``
      (exact on CPU and GPU).
  """

  rho: float
  recall_target: float
  emulate: bool = True

  def __post_init__(self):
    _check_rho(self.rho)
    r = self.recall_target
    if not (isinstance(r, int | float) and 0.0 < r < 1.0):
      raise ValueError(f"recall_target={r!r} must be in (0, 1)")

  def __call__(self, logits, mask, rng=None) -> jax.Array:
    """Bool ``[..., n_keys]`` kept set; ``rng`` is unused."""
    del rng
    n_keys = logits.shape[-1]
    max_topk = _static_topk(n_keys, self.rho)
    ranking = _ranking(logits, mask)
    if not self.emulate:
      _, idx = jax.lax.approx_max_k(
        ranking, max_topk, recall_target=self.recall_target
      )
    else:
      bins = approx_bins(n_keys, max_topk, self.recall_target)
      rows = -(-n_keys // bins)
      pad = rows * bins - n_keys
      padded = jnp.pad(
        ranking,
        [(0, 0)] * (ranking.ndim - 1) + [(0, pad)],
        constant_values=2 * _RANK_FLOOR,
      )
      dealt = padded.reshape(*ranking.shape[:-1], rows, bins)  # [..., r, L]
      best_row = jnp.argmax(dealt, axis=-2)  # [..., L]
      best = jnp.max(dealt, axis=-2)  # [..., L]
      _, bin_idx = jax.lax.top_k(best, max_topk)  # [..., topk]
      idx = jnp.take_along_axis(best_row, bin_idx, axis=-1) * bins + bin_idx
    return keep_first(idx, num_kept(mask, self.rho), n_keys) & mask


def selection_precision(keep, logits, mask, rho: float) -> jax.Array:
  """|keep cap exact top| / |exact top| per row (THEORY 8.3), float32 [...]."""
  top = ExactTopK(rho)(logits, mask)
  hits = jnp.sum(keep & top, axis=-1).astype(jnp.float32)
  return hits / jnp.maximum(jnp.sum(top, axis=-1), 1).astype(jnp.float32)


def truncated_softmax(logits, keep) -> jax.Array:
  """Softmax over the kept keys, exactly 0 elsewhere (THEORY 1, P_hat).

  Written with double ``where`` so dropped keys get neither overflow nor NaN
  gradients. ``logits`` float32 ``[..., n_keys]``, ``keep`` bool.
  """
  top = jnp.max(logits, axis=-1, where=keep, initial=-jnp.inf, keepdims=True)
  top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
  e = jnp.where(keep, jnp.exp(jnp.where(keep, logits - top, 0.0)), 0.0)
  return e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)


def _heads_first(x):
  return jnp.swapaxes(x, 1, 2)  # [b, s, h, d] <-> [b, h, s, d]


def select_attend(q, k, v, mask, selector, rng):
  """Attention of head-major ``q`` over ``k, v`` keeping ``selector``'s keys.

  Args:
    q: ``[batch, heads, q_len, head_dim]``.
    k: ``[batch, heads, kv_len, head_dim]``.
    v: ``[batch, heads, kv_len, head_dim]``.
    mask: bool ``[batch, heads, q_len, kv_len]``, True for a real key.
    selector: ``(logits, mask, rng) -> keep``, or None for dense.
    rng: PRNG key for random selectors.

  Returns:
    ``[batch, heads, q_len, head_dim]`` in ``q.dtype``, and a dict of
    ``[batch, heads, q_len]`` statistics: ``kept``; ``precision`` (THEORY
    8.3: the fraction of the kept keys among the exact top-``kept``
    logits); ``tv`` (the dropped mass of the float32 logits, THEORY 2.1);
    ``tv_bound`` (a sound bound on the dropped mass of the exact logits:
    ``jaxtopk.theory.blockwise_bound`` with every key scored and the
    float32 rounding of the logits from ``selection.core.logit_error_of``);
    ``entropy`` (of the dense row, THEORY 8.4).
  """
  scale = q.shape[-1] ** -0.5
  q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
  logits = jnp.einsum("bhqd,bhsd->bhqs", q32, k32) * scale  # [b, h, q, s]
  keep = mask if selector is None else selector(logits, mask, rng)
  probs = truncated_softmax(logits, keep)
  out = jnp.einsum("bhqs,bhsd->bhqd", probs, v.astype(jnp.float32))
  sg = jax.lax.stop_gradient
  logits, keep = sg(logits), sg(keep)
  kept = jnp.sum(keep, axis=-1)
  top = exact_topk_keep(logits, mask, kept, logits.shape[-1])
  keys = jnp.broadcast_to(k32[:, :, None], (*logits.shape, k.shape[-1]))
  err = core.logit_error_of(sg(q32), sg(keys), mask, scale=scale)
  no_blocks = jnp.zeros((*logits.shape[:-1], 1))  # every key is scored
  info = dict(
    kept=kept,
    precision=jnp.sum(keep & top, axis=-1) / jnp.maximum(kept, 1),
    tv=theory.tail_mass(logits, keep, mask),
    tv_bound=theory.blockwise_bound(
      logits,
      keep,
      mask,
      no_blocks,
      no_blocks.astype(jnp.int32),
      mask,
      logit_error=err,
    ),
    entropy=theory.attention_entropy(logits, mask),
  )
  return out.astype(q.dtype), info


@dataclasses.dataclass(frozen=True)
class SelectorAttention:
  """``jaxtopk.models.DecoderAttention`` keeping a selector's keys.

  Statistics as :func:`select_attend`, with ``[batch, q_len, heads]``
  leaves (the layout of the library's certificates).

  Attributes:
    selector: ``(logits, mask, rng) -> keep`` (``ExactTopK``, ``MixedTopK``,
      ``ApproxMaxK``), or None for dense.
  """

  selector: object = None

  def prefill(self, query, key, value, *, rng=None):
    """Causal attention over ``[batch, seq, heads, head_dim]`` inputs."""
    q, k, v = map(_heads_first, (query, key, value))
    s = q.shape[2]
    causal = jnp.tril(jnp.ones((s, s), bool))
    mask = jnp.broadcast_to(causal, (*q.shape[:2], s, s))
    out, info = select_attend(q, k, v, mask, self.selector, rng)
    return _heads_first(out), jax.tree.map(
      lambda x: jnp.swapaxes(x, 1, 2), info
    )

  def decode(self, query, cache, *, rng=None):
    """One query ``[batch, 1, heads, head_dim]`` over a ``jaxtopk.KVCache``."""
    q = _heads_first(query)  # [b, h, 1, d]
    mask = jnp.broadcast_to(
      cache.valid()[:, :, None, :], (*q.shape[:3], cache.max_len)
    )
    out, info = select_attend(
      q, cache.keys, cache.values, mask, self.selector, rng
    )
    return _heads_first(out), jax.tree.map(
      lambda x: jnp.swapaxes(x, 1, 2), info
    )


# Dense attention that also reports each row's entropy (THEORY 8.4).
DENSE_STATS = SelectorAttention(None)
