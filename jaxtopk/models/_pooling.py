"""Sentence embeddings as sentence-transformers all-MiniLM-L6-v2 makes them.

The package's ``modules.json`` chains Transformer -> Pooling -> Normalize;
``1_Pooling/config.json`` selects mean pooling over real tokens only
(``pooling_mode_mean_tokens``), and Normalize divides by the L2 norm. The
PyTorch code clamps the token count at 1e-9 and the norm at 1e-12; so do we.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array
from jaxtyping import Bool
from jaxtyping import Float
from jaxtyping import Int

_MIN_COUNT = 1e-9  # sentence_transformers.models.Pooling
_MIN_NORM = 1e-12  # torch.nn.functional.normalize default eps


def mean_pool(
  hidden: Float[Array, "b s d"],
  attention_mask: Int[Array, "b s"] | Bool[Array, "b s"],
) -> Float[Array, "b d"]:
  """Mean of the hidden states over real (non-padding) tokens.

  Args:
    hidden: ``[batch, seq, hidden]`` token states.
    attention_mask: ``[batch, seq]``, nonzero/True for a real token.

  Returns:
    ``[batch, hidden]`` in the dtype of ``hidden`` (summed in float32 or
    wider); an all-padding row gives zeros.

  Raises:
    ValueError: if the shapes do not match.
  """
  hidden = jnp.asarray(hidden)
  attention_mask = jnp.asarray(attention_mask)
  if hidden.ndim != 3 or attention_mask.shape != hidden.shape[:2]:
    raise ValueError(
      f"{hidden.shape=} must be [batch, seq, hidden] and "
      f"{attention_mask.shape=} must be [batch, seq]"
    )
  acc = jnp.promote_types(hidden.dtype, jnp.float32)
  m = (attention_mask != 0).astype(acc)[..., None]  # [b, s, 1]
  total = jnp.sum(hidden.astype(acc) * m, axis=1)  # [b, d]
  count = jnp.maximum(jnp.sum(m, axis=1), _MIN_COUNT)  # [b, 1]
  return (total / count).astype(hidden.dtype)


def l2_normalize(x: Float[Array, "... d"]) -> Float[Array, "... d"]:
  """``x / max(||x||_2, 1e-12)`` along the last axis, as torch normalizes."""
  x = jnp.asarray(x)
  acc = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  norm = jnp.linalg.norm(acc, axis=-1, keepdims=True)
  return (acc / jnp.maximum(norm, _MIN_NORM)).astype(x.dtype)


def sentence_embedding(
  model,
  input_ids: Int[Array, "b s"],
  attention_mask: Int[Array, "b s"] | Bool[Array, "b s"],
  token_type_ids: Int[Array, "b s"] | None = None,
) -> Float[Array, "b d"]:
  """all-MiniLM-L6-v2 sentence embedding: encode, mean-pool, L2-normalize.

  Args:
    model: a ``jaxtopk.models.MiniLM`` (e.g. from ``load_minilm``).
    input_ids: ``[batch, seq]`` token ids.
    attention_mask: ``[batch, seq]``, nonzero for a real token.
    token_type_ids: optional ``[batch, seq]`` segment ids.

  Returns:
    ``[batch, hidden]`` unit-norm embeddings in the model's compute dtype.

  Example:
    >>> model, tok = load_minilm()  # doctest: +SKIP
    >>> batch = minilm_tokenize(tok, ["A sentence."])  # doctest: +SKIP
    >>> sentence_embedding(model, **batch).shape  # doctest: +SKIP
    (1, 384)
  """
  hidden = model(input_ids, attention_mask, token_type_ids)
  return l2_normalize(mean_pool(hidden, attention_mask))
