"""Real attention rows of all-MiniLM-L6-v2, stacked for experiments.

The k_eps scaling, bound tightness and certified-search experiments need real
rows: the scaled logits of every layer and head (THEORY.md sections 1, 5.5),
which keys are real (padding removed by a mask, never by -inf), the values
(for the output-error bounds of section 4), the queries and keys (Delta-Search
scores keys from q and k, section 6.2), and the projection weights W_Q, W_K
(section 7.4's R = B^2 ||W_Q W_K^T||_F). This module runs the real encoder on
a list of texts and returns all of these as numpy arrays, layers first.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
from flax import nnx

from jaxtopk.models import MiniLM
from jaxtopk.models import load_minilm
from jaxtopk.models import minilm_tokenize


@functools.lru_cache(maxsize=1)
def _default_minilm():
  return load_minilm()


@nnx.jit
def _trace(model, input_ids, attention_mask, token_type_ids):
  return model(input_ids, attention_mask, token_type_ids, return_logits=True)[1]


def minilm_qk_weights(model: MiniLM) -> dict[str, np.ndarray]:
  """Per layer and head query/key projections of a ``MiniLM``.

  With ``x`` the ``[seq, hidden]`` input of layer ``l``, head ``h`` computes
  ``q = x @ w_q[l, h] + b_q[l, h]``, ``k = x @ w_k[l, h] + b_k[l, h]`` and
  logits ``q @ k.T * scale``, ``scale = head_dim**-0.5``.

  Args:
    model: a ``MiniLM`` (e.g. from ``load_minilm``).

  Returns:
    ``dict(w_q, w_k)`` of shape ``[layers, heads, hidden, head_dim]`` and
    ``dict(b_q, b_k)`` of shape ``[layers, heads, head_dim]``, float32 numpy.
  """
  cfg = model.config
  h, dh = cfg.num_heads, cfg.head_dim

  def kernel(linear):
    w = np.asarray(linear.kernel[...], np.float32)  # [hidden, h * dh]
    return w.reshape(cfg.hidden_size, h, dh).transpose(1, 0, 2)  # [h, d, dh]

  def bias(linear):
    return np.asarray(linear.bias[...], np.float32).reshape(h, dh)  # [h, dh]

  att = [layer.attention for layer in model.layers]
  return dict(
    w_q=np.stack([kernel(a.query) for a in att]),
    w_k=np.stack([kernel(a.key) for a in att]),
    b_q=np.stack([bias(a.query) for a in att]),
    b_k=np.stack([bias(a.key) for a in att]),
  )


def minilm_attention_rows(
  texts: Sequence[str],
  max_len: int = 256,
  *,
  model: MiniLM | None = None,
  tokenizer=None,
  pad_to_max_len: bool = False,
  batch_size: int = 8,
) -> dict[str, np.ndarray]:
  """Every attention row of the real all-MiniLM-L6-v2 on ``texts``.

  Texts are tokenized together (truncated at ``max_len``, padded to the
  longest, or to ``max_len``) and encoded ``batch_size`` at a time. Memory:
  the logits take ``4 * L * B * H * S * S`` bytes, 18.9 MB per text at
  ``S = 256`` (6 layers, 12 heads).

  Args:
    texts: the texts (e.g. from ``real_text_passages``).
    max_len: longest tokenized length, in ``[2, 512]``.
    model: a ``MiniLM``; None loads the real weights once per process.
    tokenizer: its tokenizer; None uses the one ``load_minilm`` returns.
    pad_to_max_len: pad every text to ``max_len`` tokens.
    batch_size: texts per encoder call, at least 1.

  Returns:
    A dict of numpy arrays, with ``L`` layers, ``B`` texts, ``H`` heads,
    ``S`` tokens, ``dh`` head dim, ``D`` hidden size:
    - ``logits`` ``[L, B, H, S, S]`` float32, scaled pre-softmax scores, no
      mask applied (THEORY.md section 1);
    - ``key_mask`` ``[B, S]`` bool, True for a real token (the rows to study
      are ``logits[l, b, h, i][key_mask[b]]`` for real queries ``i``);
    - ``queries``, ``keys``, ``values``, ``outputs`` ``[L, B, H, S, dh]``
      (``outputs`` is the dense attention output, softmax(logits) @ values);
    - ``inputs`` ``[L, B, S, D]``, the hidden states entering each layer;
    - ``input_ids`` ``[B, S]`` int32, ``lengths`` ``[B]`` int32 (real tokens);
    - ``layer_ids`` ``[L]``, ``head_ids`` ``[H]``, ``scale`` (float);
    - ``w_q``, ``w_k`` ``[L, H, D, dh]``, ``b_q``, ``b_k`` ``[L, H, dh]`` (see
      ``minilm_qk_weights``).

  Raises:
    ValueError: for bad ``texts``, ``max_len`` or ``batch_size``, or a
      ``model`` given without its ``tokenizer``.

  Example:
    >>> rows = minilm_attention_rows(["Hi there."])  # doctest: +SKIP
    >>> rows["logits"].shape  # doctest: +SKIP
    (6, 1, 12, 5, 5)
  """
  if not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"{batch_size=} must be a positive int")
  if (model is None) != (tokenizer is None):
    raise ValueError("pass both model and tokenizer, or neither")
  if model is None:
    model, tokenizer = _default_minilm()
  batch = minilm_tokenize(
    tokenizer, texts, max_len=max_len, pad_to_max_len=pad_to_max_len
  )
  n = batch["input_ids"].shape[0]
  parts = []
  for start in range(0, n, batch_size):
    chunk = {k: v[start : start + batch_size] for k, v in batch.items()}
    trace = _trace(
      model,
      chunk["input_ids"],
      chunk["attention_mask"],
      chunk["token_type_ids"],
    )
    parts.append(
      {
        name: np.stack([np.asarray(x) for x in getattr(trace, name)])
        for name in ("logits", "queries", "keys", "values", "outputs", "inputs")
      }
    )
  out = {
    name: np.concatenate([p[name] for p in parts], axis=1) for name in parts[0]
  }
  cfg = model.config
  out.update(
    key_mask=batch["attention_mask"] != 0,
    input_ids=batch["input_ids"],
    lengths=batch["attention_mask"].sum(-1).astype(np.int32),
    layer_ids=np.arange(cfg.num_layers),
    head_ids=np.arange(cfg.num_heads),
    scale=1.0 / math.sqrt(cfg.head_dim),
  )
  out.update(minilm_qk_weights(model))
  return out
