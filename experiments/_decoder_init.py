"""Structured initialisation of the decoder for fast lookup learning.

``previous_token_init`` makes the first heads of layer 0 attend to the
previous token(s) from the start, the half of the induction circuit
(Olsson et al. 2022) that a rotary-position decoder otherwise learns slowly
on small data; experiments/train_long_context.py and experiments/native_topk
use it (``config.init``).
"""

import jax.numpy as jnp
import numpy as np

from jaxtopk import models


def _pair_weights(inv_freq, offset, span, pairs, seed=0):
  """Weights ``[pairs] >= 0`` of the fastest rotary pairs whose score
  ``sum_i w_i cos((d + offset) f_i)`` peaks at ``d = -offset`` with the
  largest margin over ``d`` in ``[-span, 0]`` (random search); and that
  margin."""
  d = np.arange(-span, 1)
  cos = np.cos((d[:, None] + offset) * inv_freq[None, :pairs])  # [n, p]
  rng = np.random.default_rng(seed)
  best, best_w = -np.inf, None
  for _ in range(2000):
    w = rng.random(pairs) ** 2
    w /= w.sum()
    score = cos @ w
    margin = score[d == -offset][0] - np.max(score[d != -offset])
    if margin > best:
      best, best_w = margin, w
  return best_w, best


def previous_token_init(model, init) -> list[dict]:
  """Initialises layer 0's first heads as previous-token heads.

  A structured ("mimetic", Trockman & Kolter 2023) initialisation of the
  Llama architecture itself, no new part: every token embedding gets the
  same component ``c`` on dimension 0, so the normalised residual has a
  content-free direction; kv head 0 of layer 0 keys on it (rotated by its
  position, RoPE) and query head ``j`` asks for it rotated back by
  ``offsets[j]``, so that head attends to the token ``offsets[j]`` back
  (logit margin ``init.margin`` over ``init.span`` positions). Training
  then adjusts these weights like any others. Without it, the induction
  circuit (a previous-token head feeding a content-matching head) did not
  form within 2,500 steps of multi-query lookup at 64 tokens; with it, it
  forms in ~700 (BUILD_NOTES, "Long-context model"). With tied
  embeddings the shared component shifts every logit equally (no effect).

  Returns:
    per head: the offset and the margin of the normalised score.
  """
  cfg = model.config
  inv = models.rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
  dim, hd = cfg.model_dim, cfg.head_dim
  group = cfg.num_heads // cfg.num_kv_heads
  if len(init.offsets) > group:
    raise ValueError(f"{init.offsets=}: at most {group=} heads share kv 0")
  emb = np.array(model.embed.embedding[...]) * init.embed_scale
  std = float(np.std(emb[:, 1:]))
  emb[:, 0] = init.constant * std * np.sqrt(dim)  # ~ constant/rms units
  model.embed.embedding[...] = jnp.asarray(emb, emb.dtype)
  x0 = float(np.mean(emb[:, 0] / np.sqrt(np.mean(emb**2, -1))))
  attn = model.blocks[0].attn
  q = np.array(attn.query.kernel[...])
  k = np.array(attn.key.kernel[...])
  k[:, 0, :] = 0.0
  pairs = min(init.pairs, hd // 2)
  out = []
  gains = []
  for head, offset in enumerate(init.offsets):
    w, margin = _pair_weights(inv, offset, init.span, pairs)
    gain = np.sqrt(init.margin * np.sqrt(hd) / (x0 * x0 * margin))
    gains.append(gain)
    q[:, head, :] = 0.0
    q[0, head, :pairs] = gain * w * np.cos(offset * inv[:pairs])
    q[0, head, hd // 2 : hd // 2 + pairs] = (
      -gain * w * np.sin(offset * inv[:pairs])
    )
    out.append(dict(offset=offset, margin=float(margin)))
  k[0, 0, :pairs] = max(gains)  # q carries each head's own gain
  for head in range(len(init.offsets)):
    q[0, head] *= gains[head] / max(gains)
  attn.query.kernel[...] = jnp.asarray(q)
  attn.key.kernel[...] = jnp.asarray(k)
  return out
