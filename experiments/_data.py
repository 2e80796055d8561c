"""Rows the experiments analyse: synthetic Gaussian and real MiniLM.

Synthetic rows come from queries and keys (so the blockwise bounds of
THEORY 3.3 have key blocks to summarise) or straight from logits. Real rows
come from all-MiniLM-L6-v2 (jaxtopk.models, real weights) run on real text.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Rows:
  """Attention rows grouped by (layer, passage, head) or by synthetic draw.

  ``G`` groups each hold ``q`` query rows over the same ``s`` keys.

  Attributes:
    logits: ``[G, q, s]`` float32 scaled logits q.k * scale (no mask in).
    key_mask: ``[G, s]`` bool, True for a real key.
    query_mask: ``[G, q]`` bool, True for a real query row.
    queries: ``[G, q, d]`` or None.
    keys: ``[G, s, d]`` or None.
    values: ``[G, s, dv]`` or None.
    layer: ``[G]`` int layer index (0 for synthetic rows).
    scale: the logit scale used for ``logits``.
    source: where the rows come from (for the records).
  """

  logits: np.ndarray
  key_mask: np.ndarray
  query_mask: np.ndarray
  queries: np.ndarray | None
  keys: np.ndarray | None
  values: np.ndarray | None
  layer: np.ndarray
  scale: float
  source: str

  @property
  def num_rows(self) -> int:
    return int(self.query_mask.sum())

  def real_row_mask(self) -> np.ndarray:
    """``[G, q, s]`` bool key mask broadcast over query rows."""
    return np.broadcast_to(self.key_mask[:, None, :], self.logits.shape)


def gaussian_qk(key, *, groups, queries, n, head_dim, sigma) -> Rows:
  """Gaussian queries, keys and values whose logits have std about sigma.

  q ~ N(0, I_d), k ~ sigma N(0, I_d), scale = 1/sqrt(d), so each logit
  scale * q.k has variance sigma^2 ||q||^2 / d ~ sigma^2.
  """
  kq, kk, kv = jax.random.split(key, 3)
  q = jax.random.normal(kq, (groups, queries, head_dim))  # [G, q, d]
  k = sigma * jax.random.normal(kk, (groups, n, head_dim))  # [G, s, d]
  v = jax.random.normal(kv, (groups, n, head_dim))  # [G, s, d]
  return _rows_from_qkv(
    q, k, v, f"gaussian(sigma={sigma}, n={n}, d={head_dim})"
  )


def clustered_qk(
  key, *, groups, queries, n, head_dim, sigma, block_size, spread
) -> Rows:
  """Gaussian q and keys clustered by contiguous block (locality).

  Block b's keys are k = sigma (c_b + spread z) / sqrt(1 + spread^2) with a
  per-block centre c_b ~ N(0, I_d) and z ~ N(0, I_d), so logits still have
  std about sigma, but keys of one block are close to each other: the
  situation (e.g. neighbouring tokens) where block summaries are tight.
  """
  kq, kc, kz, kv = jax.random.split(key, 4)
  nb = -(-n // block_size)
  q = jax.random.normal(kq, (groups, queries, head_dim))  # [G, q, d]
  c = jax.random.normal(kc, (groups, nb, head_dim))  # [G, nb, d]
  c = jnp.repeat(c, block_size, axis=1)[:, :n]  # [G, s, d]
  z = jax.random.normal(kz, (groups, n, head_dim))  # [G, s, d]
  k = sigma * (c + spread * z) / math.sqrt(1 + spread**2)  # [G, s, d]
  v = jax.random.normal(kv, (groups, n, head_dim))  # [G, s, d]
  return _rows_from_qkv(q, k, v, f"clustered(sigma={sigma}, spread={spread})")


def np_log_tail_mass64(logits, keep, mask) -> np.ndarray:
  """float64 log tau (THEORY 2.5) in numpy: the truth bounds are held to.

  Args:
    logits: ``[..., s]`` logits (any float dtype; promoted to float64).
    keep: ``[..., s]`` bool kept set.
    mask: ``[..., s]`` bool real keys.

  Returns:
    ``[...]`` float64 log tau; -inf when no real key is outside ``keep``.
  """
  s = np.asarray(logits, np.float64)
  mask = np.broadcast_to(np.asarray(mask, bool), s.shape)
  keep = np.asarray(keep, bool) & mask
  tail = mask & ~keep
  m = np.max(np.where(mask, s, -np.inf), axis=-1, keepdims=True)
  e = np.exp(np.where(mask, s - m, -np.inf))
  with np.errstate(divide="ignore"):
    return np.log(np.sum(np.where(tail, e, 0.0), -1)) - np.log(
      np.sum(np.where(mask, e, 0.0), -1)
    )


def logits64(rows: Rows) -> np.ndarray:
  """``[G, q, s]`` float64 logits recomputed from queries and keys."""
  q = np.asarray(rows.queries, np.float64)
  k = np.asarray(rows.keys, np.float64)
  return np.einsum("gqd,gsd->gqs", q, k) * rows.scale


@functools.cache
def minilm_arrays(num_passages: int, max_len: int) -> dict:
  """``_attention_rows.minilm_attention_rows`` on real text passages (cached).

  Passages are ``max_len`` words of the public-domain text jaxtopk ships
  (``_real_text.real_text_passages``, seed 0), so every one fills the
  ``max_len`` tokens after WordPiece (at least one token per word).
  """
  from experiments import _attention_rows
  from experiments import _real_text

  texts = _real_text.real_text_passages(num_passages, max_words=max_len)
  return _attention_rows.minilm_attention_rows(texts, max_len)


def minilm_rows(num_passages: int, max_len: int) -> Rows:
  """Every layer's and head's attention rows of MiniLM on real text.

  Returns:
    Rows with ``G = layers * passages * heads`` groups of ``seq`` query rows
    over ``seq`` keys; padded tokens are masked as keys and as queries.
  """
  a = minilm_arrays(num_passages, max_len)
  num_layers, b, h, s, _ = a["logits"].shape
  flat = lambda x: np.asarray(x, np.float32).reshape(
    num_layers * b * h, *x.shape[3:]
  )
  key_mask = np.broadcast_to(
    np.asarray(a["key_mask"], bool)[None, :, None, :], (num_layers, b, h, s)
  ).reshape(-1, s)
  return Rows(
    logits=flat(a["logits"]),  # [G, s, s]
    key_mask=key_mask,  # [G, s]
    query_mask=key_mask.copy(),  # [G, s]: padded tokens ask nothing
    queries=flat(a["queries"]),  # [G, s, dh]
    keys=flat(a["keys"]),  # [G, s, dh]
    values=flat(a["values"]),  # [G, s, dh]
    layer=np.repeat(np.arange(num_layers), b * h),
    scale=float(a["scale"]),
    source="minilm",
  )


def _rows_from_qkv(q, k, v, source) -> Rows:
  """Rows of ``[G, q, d]`` queries over ``[G, s, d]`` keys, all real."""
  groups, queries, head_dim = q.shape
  n = k.shape[1]
  scale = 1.0 / math.sqrt(head_dim)
  logits = jnp.einsum("gqd,gsd->gqs", q, k) * scale  # [G, q, s]
  return Rows(
    logits=np.asarray(logits, np.float32),
    key_mask=np.ones((groups, n), bool),
    query_mask=np.ones((groups, queries), bool),
    queries=np.asarray(q, np.float32),
    keys=np.asarray(k, np.float32),
    values=np.asarray(v, np.float32),
    layer=np.zeros((groups,), np.int32),
    scale=scale,
    source=source,
  )
