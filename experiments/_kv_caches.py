"""Long KV caches for the certified-retrieval experiment.

Each builder returns a :class:`Cache`: keys, values and decode queries of
some heads, head-major, with what the cache is. No downloads are possible
here, so the real caches are stand-ins (RESULTS.md says what they do and do
not resemble):

- ``minilm_cache``: MiniLM keys/values of one layer and head over many real
  passages concatenated (each passage encoded on its own, positions 0..255
  each), queries from the LAST passage attending over all of them.
- ``decoder_cache``: a decoder (jaxtopk.models.TopKDecoder, Llama
  architecture; by default the packaged long-context model) on retrieval
  tasks at a long context: per layer and head, the keys/values of a whole
  sequence and the query at its answer position.
- ``clustered_cache``: keys in tight clusters at random positions (content
  locality without position locality), retrieval-like queries.
- ``local_window_cache``: RoPE-like keys and queries whose logits peak at
  the query's own position and decay with distance, plus 4 attention-sink
  keys that every query favours (the StreamingLLM pattern).
"""

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Cache:
  """Keys, values and queries of ``heads`` independent caches.

  Attributes:
    name: short name for the records.
    keys: ``[heads, n, d]`` float32.
    values: ``[heads, n, dv]`` float32.
    queries: ``[heads, q, d]`` float32 decode queries over all n keys.
    scale: logit scale.
    note: what the cache is (for the records).
    labels: per head, a label (e.g. ``"L2H5"``).
  """

  name: str
  keys: np.ndarray
  values: np.ndarray
  queries: np.ndarray
  scale: float
  note: str
  labels: tuple

  @property
  def n(self) -> int:
    return self.keys.shape[1]


def minilm_cache(num_passages, max_len, heads, query_stride) -> Cache:
  """MiniLM over ``num_passages`` real-text passages, concatenated.

  Args:
    num_passages: passages (200 words each, truncated at ``max_len``
      tokens; padding dropped).
    max_len: tokens per passage.
    heads: ``[(layer, head), ...]``.
    query_stride: every this-many real tokens of the last passage is a
      query.
  """
  from experiments import _attention_rows
  from experiments import _real_text
  from jaxtopk import models

  texts = _real_text.real_text_passages(num_passages, max_words=200)
  model, tok = models.load_minilm()
  ks, vs, qs, masks = [], [], [], []
  for lo in range(0, num_passages, 8):
    a = _attention_rows.minilm_attention_rows(
      texts[lo : lo + 8], max_len, model=model, tokenizer=tok
    )
    pick = lambda x: np.stack([x[l_, :, h] for l_, h in heads], 1)
    ks.append(pick(a["keys"]))  # [B, heads, S, dh]
    vs.append(pick(a["values"]))
    qs.append(pick(a["queries"]))
    masks.append(a["key_mask"])  # [B, S]
  k = _concat_real(ks, masks)
  v = _concat_real(vs, masks)
  last_q = qs[-1][-1]  # [heads, S, dh] of the last passage
  last_m = masks[-1][-1]
  q = last_q[:, last_m][:, ::query_stride]
  return Cache(
    name="minilm",
    keys=k,
    values=v,
    queries=np.ascontiguousarray(q, np.float32),
    scale=1 / np.sqrt(k.shape[-1]),
    note=(
      f"all-MiniLM-L6-v2 over {num_passages} real-text passages (200 words,"
      f" <= {max_len} tokens each, encoded separately) concatenated into"
      f" {k.shape[1]} keys; queries: every {query_stride}th token of the"
      " last passage"
    ),
    labels=tuple(f"L{l_}H{h}" for l_, h in heads),
  )


def _concat_real(parts, masks):
  """``[heads, n_real, d]`` of the real tokens of every passage, in order."""
  out = []
  for x, m in zip(parts, masks, strict=True):
    for b in range(x.shape[0]):
      out.append(x[b][:, m[b]])  # [heads, S_real, d]
  return np.ascontiguousarray(np.concatenate(out, 1), np.float32)


def clustered_cache(seed, n, d, heads, cluster_size, spread, sigma, qnoise):
  """Keys in tight clusters at random positions, retrieval-like queries.

  k = sigma (c_a + spread z) / sqrt(1 + spread^2), a uniform over n /
  cluster_size centres c ~ N(0, I); q = c_t / qnoise + N(0, I) for a
  target cluster t (larger qnoise: flatter attention).
  """
  kc, kz, ka, kq, kv, kt = jax.random.split(jax.random.key(seed), 6)
  m = max(1, n // cluster_size)
  cen = jax.random.normal(kc, (heads, m, d))
  a = jax.random.randint(ka, (heads, n), 0, m)
  k = jnp.take_along_axis(cen, a[..., None], 1)
  k = sigma * (k + spread * jax.random.normal(kz, (heads, n, d)))
  k = k / np.sqrt(1 + spread**2)
  v = jax.random.normal(kv, (heads, n, d))
  t = jax.random.randint(kt, (heads, 4), 0, m)
  q = jnp.take_along_axis(cen, t[..., None], 1) / qnoise
  q = q + jax.random.normal(kq, (heads, 4, d))
  return Cache(
    name="clustered",
    keys=np.asarray(k, np.float32),
    values=np.asarray(v, np.float32),
    queries=np.asarray(q, np.float32),
    scale=1 / np.sqrt(d),
    note=(
      f"{m} clusters of ~{cluster_size} keys (spread {spread}, logit scale"
      f" sigma {sigma}) at random positions; queries = centre / {qnoise}"
      " + N(0, I)"
    ),
    labels=tuple(f"h{h}" for h in range(heads)),
  )


def local_window_cache(seed, n, d, heads, num_queries, sinks, strength):
  """RoPE-like local attention plus attention sinks.

  With u a fixed unit-scale vector and R(t) the RoPE rotation at position
  t (frequencies 10000^(-2j/d)), k_s = R(s) u + noise, q_t = strength
  R(t) u, so q_t.k_s ~ strength sum_j |u_j|^2 cos((t - s) theta_j): large
  near s = t, decaying with distance. The first ``sinks`` keys also carry
  a sink direction e that every query shares (StreamingLLM's sinks).
  Queries sit at the last positions (decoding at the end of the cache).
  """
  rng = np.random.default_rng(seed)
  half = d // 2
  theta = 10000.0 ** (-np.arange(half) / half)  # [half]

  def rot(x, pos):  # x [..., d], pos [...] -> rotated pairs (RoPE)
    ang = pos[..., None] * theta  # [..., half]
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], -1)

  pos = np.arange(n, dtype=np.float64)
  qpos = np.arange(n - num_queries, n, dtype=np.float64)
  ks, qs = [], []
  for _ in range(heads):
    u = rng.normal(size=d) / np.sqrt(d) * 4
    e = np.zeros(d)
    e[0] = 1.0
    k = rot(np.broadcast_to(u, (n, d)), pos) + 0.3 * rng.normal(size=(n, d))
    k[:sinks] += 6.0 * e
    q = strength * rot(np.broadcast_to(u, (num_queries, d)), qpos)
    q = q + 1.5 * e * strength
    ks.append(k)
    qs.append(q)
  v = rng.normal(size=(heads, n, d))
  return Cache(
    name="local_window",
    keys=np.asarray(ks, np.float32),
    values=np.asarray(v, np.float32),
    queries=np.asarray(qs, np.float32),
    scale=1 / np.sqrt(d),
    note=(
      f"RoPE-like keys (local attention peaked at the query position) with"
      f" {sinks} sink keys; queries at the last {num_queries} positions"
    ),
    labels=tuple(f"h{h}" for h in range(heads)),
  )


# ------------------------------------------------------ native decoder


def native_config(dcfg):
  """The native_topk config that trains the decoder of ``dcfg``."""
  from experiments.configs import native_topk as native_cfg

  c = native_cfg.get_config("smoke" if dcfg.smoke else None)
  with c.unlocked():
    c.seed = dcfg.seed
    c.seq_len = dcfg.seq_len
    c.vocab.num_keys = dcfg.num_keys
    for k, v in dcfg.model.items():
      c.model[k] = v
    for k, v in dcfg.train.items():
      c.train[k] = v
  return c


def decoder_params(dcfg, workdir):
  """Trained decoder parameters: loaded from ``dcfg.init_from`` or trained.

  ``init_from`` may be a model directory (``jaxtopk.models.load_pretrained``;
  its config.json's ``jaxtopk_task_vocab`` then sets the token layout of the
  tasks, ``dcfg.model`` is not used) or a ``decoder_params.npz`` of an
  earlier run. Without it, training reuses experiments/native_topk (its
  dense base phase: the task mix, curriculum and resumable orbax
  checkpoints under ``<workdir>/decoder/ckpt``), then the parameters are
  saved as ``<workdir>/decoder_params.npz`` (small: ~0.1-0.5 MB).

  Returns:
    ``(model, native_config, seconds)``: the decoder with trained weights.
  """
  from experiments import native_topk as nt
  from jaxtopk import models

  c = native_config(dcfg)
  tick = time.time()
  if dcfg.init_from and os.path.isdir(dcfg.init_from):
    model, checkpoint = models.load_pretrained(dcfg.init_from)
    layout = checkpoint.hf_config.get("jaxtopk_task_vocab")
    if layout is None:
      raise ValueError(
        f"{dcfg.init_from!r}: config.json has no jaxtopk_task_vocab (the"
        " token layout of the retrieval tasks)"
      )
    with c.unlocked():
      for k, v in layout.items():
        c.vocab[k] = v
    logging.info("decoder: loaded %s", dcfg.init_from)
    return model, c, time.time() - tick
  model = nt._model(c, c.seed)
  out = os.path.join(workdir, "decoder_params.npz")
  src = dcfg.init_from if dcfg.init_from else out
  if os.path.exists(src):
    flat = dict(np.load(src))
    nt._restore_into(model, flat)
    logging.info("decoder: loaded %s", src)
  else:
    wd = os.path.join(workdir, "decoder")
    os.makedirs(wd, exist_ok=True)
    metrics = nt.Metrics(os.path.join(wd, "train.jsonl"))
    model, finished = nt.train_phase(c, wd, "base", metrics, lambda: False)
    if not finished:
      raise RuntimeError("decoder training stopped early")
  flat = nt._flat(nnx.to_pure_dict(nnx.state(model)))
  np.savez(out, **flat)
  return model, c, time.time() - tick


@dataclasses.dataclass(frozen=True)
class _RecordQKV:
  """Dense attention (``jaxtopk.Dense()``) that also returns its q, k, v.

  A ``jaxtopk.models.DecoderAttention``: the decoder hands it the rotated
  queries, keys and values of every layer.
  """

  def prefill(self, query, key, value, *, rng=None):
    import jaxtopk
    from jaxtopk import models

    out, _ = models.PolicyAttention(jaxtopk.Dense()).prefill(query, key, value)
    group = query.shape[2] // key.shape[2]  # GQA: one key head per group

    def heads_first(x, repeat=1):  # [b, s, h, d] -> [b, h * repeat, s, d]
      return jnp.repeat(x, repeat, axis=2).transpose(0, 2, 1, 3)

    return out, (heads_first(query), heads_first(key, group),
                 heads_first(value, group))  # fmt: skip

  def decode(self, query, cache, *, rng=None):
    raise NotImplementedError("_RecordQKV records prefills only")


@nnx.jit
def _decoder_qkv(model, tokens):
  """Per layer: (q, k, v) ``[b, h, s, d]`` of a dense forward pass."""
  logits, qkv = model(tokens, attention=_RecordQKV())
  return qkv, logits


def decoder_cache(model, c, tasks, num_sequences, seed) -> tuple[Cache, dict]:
  """The decoder's caches at its answer position, per layer and head.

  For each task, ``num_sequences`` eval sequences of ``c.seq_len`` tokens
  (seeds disjoint from training); the cache of layer l, head h is the
  keys/values of the whole sequence, the query the one at the answer
  position (the last), which attends causally to every key.

  Returns:
    ``(cache, accuracy)``: heads = tasks x layers x heads x sequences
    (each row its own cache of n = seq_len keys, one query), and the dense
    answer accuracy per task at this context.
  """
  from experiments import _long_context_data as lcd
  from experiments import native_topk as nt

  def make(task, task_seed):
    if task in lcd.TASKS:  # the long-context model's own (RULER-style) tasks
      vocab = nt._vocab(c)
      text = lcd.text_tokens(lcd.EVAL_PART, vocab)
      return lcd.eval_task(
        task, task_seed, num_sequences, c.seq_len, vocab, text
      )
    return nt.make_task(c, task, task_seed, num_sequences)

  ks, vs, qs, labels, acc = [], [], [], [], {}
  for i, task in enumerate(tasks):
    batch = make(task, (seed, 77, i))
    tokens = jnp.asarray(batch.inputs)
    layers, logits = _decoder_qkv(model, tokens)
    col = batch.first_answer
    hit = np.argmax(np.asarray(logits)[:, col], -1) == batch.targets[:, col]
    acc[task] = float(np.mean(hit))
    for li, (q, k, v) in enumerate(layers):
      for h in range(q.shape[1]):
        for b in range(num_sequences):
          ks.append(np.asarray(k[b, h, : col + 1]))
          vs.append(np.asarray(v[b, h, : col + 1]))
          qs.append(np.asarray(q[b, h, col : col + 1]))
          labels.append(f"{task}/L{li}H{h}")
  n = min(x.shape[0] for x in ks)
  keys = np.stack([x[-n:] for x in ks]).astype(np.float32)
  values = np.stack([x[-n:] for x in vs]).astype(np.float32)
  d = keys.shape[-1]
  cache = Cache(
    name="decoder",
    keys=keys,
    values=values,
    queries=np.stack(qs).astype(np.float32),
    scale=1 / np.sqrt(d),
    note=(
      f"decoder ({model.config.num_layers} layers x"
      f" {model.config.num_heads} heads, head_dim {d}) at context"
      f" {c.seq_len}; per task ({', '.join(tasks)}), layer, head and"
      f" sequence ({num_sequences}), the {n} keys before the answer and the"
      " answer query"
    ),
    labels=tuple(labels),
  )
  return cache, acc
