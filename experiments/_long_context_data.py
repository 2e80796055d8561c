"""Data of the long-context model: byte-level text, retrieval tasks, tokenizer.

The model trained by ``experiments/train_long_context.py`` (and evaluated by
``experiments/long_context.py``) reads one token layout, ``jaxtopk.tasks.
Vocab(num_keys, num_values, num_filler=256)``: specials (PAD, Q, S), key
tokens ``<k0>..``, value tokens ``<v0>..`` and, as the filler range, the 256
bytes: text is its UTF-8 bytes, token ``filler_start + byte``. The matching
``tokenizer.json`` (built here with ``tokenizers``: byte-level, no merges,
keys/values/specials as special tokens) and the layout itself (config.json
field ``jaxtopk_task_vocab``) are saved with the model, so any process can
rebuild the tasks for it.

Real text: the public-domain book jaxtopk ships
(``jaxtopk.models.public_domain_text``): training haystacks come from its
first ``TRAIN_SHARE`` of words (``TRAIN_PART``), evaluation haystacks from
the rest (``EVAL_PART``), text the training never reads. (The shipped model
was trained on the Debian licence texts before the book replaced them; its
evaluation haystacks are then text it never read either.)

Tasks (``TASKS``): the RULER-style generators of ``jaxtopk.tasks`` over a
noise or a text haystack, with their parameters drawn per row in training
and fixed (``eval_task``) in evaluation. Training also uses ``copy`` rows
(a text window, then a repeat of one of its spans: every repeated token is
a long-range lookup), and, at short lengths, ``recall`` and ``lookup`` rows
(``jaxtopk.tasks.associative_recall`` and ``multi_key_lookup``: pairs
filling the context, then one or many queries, the dense supervision that
teaches lookup quickly).
"""

import dataclasses

import numpy as np

from jaxtopk import models
from jaxtopk import tasks

FILLER_BYTES = 256
TRAIN_SHARE = 0.8
TRAIN_PART = "train"
EVAL_PART = "eval"
# RULER-style evaluation tasks (name -> generator and its fixed arguments).
TASKS = (
  "niah_noise",
  "niah_text",
  "niah_multikey",
  "niah_multiquery",
  "niah_long_value",
  "variable_tracking",
  "aggregation",
)


def vocab_of(num_keys: int, num_values: int) -> tasks.Vocab:
  """The layout: specials, keys, values, then the 256 bytes."""
  return tasks.Vocab(
    num_keys=num_keys, num_values=num_values, num_filler=FILLER_BYTES
  )


def text_tokens(part: str, vocab: tasks.Vocab) -> np.ndarray:
  """The shipped book's ``part`` (``TRAIN_PART`` or ``EVAL_PART``) as one
  int32 token stream (bytes, whitespace collapsed)."""
  if part not in (TRAIN_PART, EVAL_PART):
    raise ValueError(f"{part=} must be {TRAIN_PART!r} or {EVAL_PART!r}")
  words = models.public_domain_text().split()
  cut = int(len(words) * TRAIN_SHARE)
  words = words[:cut] if part == TRAIN_PART else words[cut:]
  raw = np.frombuffer(" ".join(words).encode("utf-8"), np.uint8)
  return raw.astype(np.int32) + vocab.filler_start


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's printable stand-in of every byte (the ByteLevel alphabet)."""
  bs = list(range(ord("!"), ord("~") + 1))
  bs += list(range(ord("¡"), ord("¬") + 1)) + list(
    range(ord("®"), ord("ÿ") + 1)
  )
  cs, n = bs[:], 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs), strict=True))


def build_tokenizer(vocab: tasks.Vocab):
  """A ``tokenizers.Tokenizer`` for the layout (byte-level, no merges)."""
  import tokenizers
  from tokenizers import decoders
  from tokenizers import models as tok_models
  from tokenizers import pre_tokenizers

  table = {ch: vocab.filler_start + b for b, ch in _bytes_to_unicode().items()}
  special = {"<pad>": tasks.PAD, "<Q>": tasks.QUERY, "<S>": tasks.SUM}
  special.update(
    {f"<k{i}>": vocab.key_start + i for i in range(vocab.num_keys)}
  )
  special.update(
    {f"<v{i}>": vocab.value_start + i for i in range(vocab.num_values)}
  )
  tok = tokenizers.Tokenizer(
    tok_models.BPE(vocab={**table, **special}, merges=[])
  )
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(
    add_prefix_space=False, use_regex=False
  )
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(
    [tokenizers.AddedToken(t, special=True, normalized=False) for t in special]
  )
  return tok


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """Fixed evaluation arguments of the RULER-style tasks (``eval_task``)."""

  num_needles_multikey: int = 4
  num_queries_multiquery: int = 2
  value_len: int = 4
  num_hops: int = 2
  num_chains: int = 2
  num_occurrences: int = 4
  num_levels: int = 3
  num_distractors: int = 4


def eval_task(
  name: str,
  seed,
  batch_size: int,
  seq_len: int,
  vocab: tasks.Vocab,
  text: np.ndarray,
  spec: TaskSpec = TaskSpec(),
  depth: float | None = None,
) -> tasks.RetrievalBatch:
  """One RULER-style evaluation batch (see ``TASKS``)."""
  common = dict(batch_size=batch_size, seq_len=seq_len, vocab=vocab)
  if name == "niah_noise":
    return tasks.needle_task(seed, depth=depth, **common)
  if name == "niah_text":
    return tasks.needle_task(seed, haystack=text, depth=depth, **common)
  if name == "niah_multikey":
    return tasks.needle_task(
      seed, haystack=text, num_needles=spec.num_needles_multikey, **common
    )
  if name == "niah_multiquery":
    return tasks.needle_task(
      seed,
      haystack=text,
      num_needles=spec.num_needles_multikey,
      num_queries=spec.num_queries_multiquery,
      **common,
    )
  if name == "niah_long_value":
    return tasks.needle_task(
      seed, haystack=text, value_len=spec.value_len, **common
    )
  if name == "variable_tracking":
    return tasks.variable_tracking(
      seed,
      haystack=text,
      num_hops=spec.num_hops,
      num_chains=spec.num_chains,
      **common,
    )
  if name == "aggregation":
    return tasks.aggregation(
      seed,
      haystack=text,
      num_occurrences=spec.num_occurrences,
      num_levels=spec.num_levels,
      num_distractors=spec.num_distractors,
      **common,
    )
  raise ValueError(f"unknown task {name=}; expected one of {TASKS}")


# ---------------------------------------------------------------- training

TRAIN_KINDS = ("copy", "recall", "lookup") + TASKS


def _copy_row(rng, seq_len, vocab, text):
  """A text window, then a repeat of one of its spans (the answers)."""
  span = int(rng.integers(max(2, seq_len // 8), max(3, seq_len // 3)))
  hay = tasks.haystack_windows(rng, 1, seq_len + 1 - span, vocab, text)[0]
  start = int(rng.integers(0, hay.size - span))
  tokens = np.concatenate([hay, hay[start : start + span]])
  mask = np.zeros(seq_len, bool)
  mask[hay.size + 1 :] = True  # predictable after its first token
  return tokens[:-1], tokens[1:], mask


def _task_row(kind, rng, seq_len, vocab, text):
  """One row of a RULER-style task with parameters drawn per row."""
  seed = int(rng.integers(0, 2**62))
  one = dict(batch_size=1, seq_len=seq_len, vocab=vocab)
  room = max(1, seq_len // 16)  # needles a context holds comfortably
  if kind == "recall":
    b = tasks.associative_recall(seed, **one)
  elif kind == "lookup":  # pairs, then many queries: dense supervision
    pairs = (seq_len - 1) // 2
    q = int(rng.integers(1, max(1, min(32, pairs // 3)) + 1))
    b = tasks.multi_key_lookup(seed, num_queries=q, **one)
  elif kind in ("niah_noise", "niah_text"):
    hay = None if kind == "niah_noise" else text
    n = int(rng.integers(1, min(8, room) + 1))
    q = int(rng.integers(1, n + 1))
    b = tasks.needle_task(
      seed, haystack=hay, num_needles=n, num_queries=q, **one
    )
  elif kind in ("niah_multikey", "niah_multiquery"):
    n = int(rng.integers(2, min(16, max(2, room)) + 1))
    q = int(rng.integers(1, n + 1)) if kind == "niah_multiquery" else 1
    b = tasks.needle_task(
      seed, haystack=text, num_needles=n, num_queries=q, **one
    )
  elif kind == "niah_long_value":
    b = tasks.needle_task(
      seed,
      haystack=text,
      num_needles=int(rng.integers(1, min(4, room) + 1)),
      value_len=int(rng.integers(2, 6)),
      **one,
    )
  elif kind == "variable_tracking":
    b = tasks.variable_tracking(
      seed,
      haystack=text,
      num_hops=int(rng.integers(1, 4)),
      num_chains=int(rng.integers(1, 4)),
      **one,
    )
  elif kind == "aggregation":
    b = tasks.aggregation(
      seed,
      haystack=text,
      num_occurrences=int(rng.integers(1, 6)),
      num_levels=3,
      num_distractors=int(rng.integers(0, min(8, room) + 1)),
      **one,
    )
  else:
    raise ValueError(f"unknown training row kind {kind=}")
  return b.inputs[0], b.targets[0], b.answer_mask[0]


def train_batch(seed, step, seq_len, batch_size, kinds, vocab, text, lm_weight):
  """``(inputs, targets, weights, kind_ids)`` of one step; pure in its args.

  Rows cycle through ``kinds`` (offset by the step, so a batch smaller than
  ``len(kinds)`` still visits every kind). Weights: 1 at answers, and
  ``lm_weight`` at every other position whose target is text (a byte), so
  the model also models the text it reads.
  """
  rng = np.random.default_rng((seed, step))
  rows, kind_ids = [], []
  for i in range(batch_size):
    k = (step * batch_size + i) % len(kinds)
    kind = kinds[k]
    if kind in ("recall", "lookup") and (seq_len - 2) // 2 > vocab.num_keys:
      # Pairs would not fit the key range: a multi-query needle row instead
      # (its metrics keep the scheduled kind's name).
      kind = "niah_multiquery"
    if kind == "copy":
      rows.append(_copy_row(rng, seq_len, vocab, text))
    else:
      rows.append(_task_row(kind, rng, seq_len, vocab, text))
    kind_ids.append(k)
  inputs, targets, answers = (np.stack(x) for x in zip(*rows, strict=True))
  text_pos = targets >= vocab.filler_start
  weights = np.where(answers, 1.0, np.where(text_pos, lm_weight, 0.0))
  return (
    inputs.astype(np.int32),
    targets.astype(np.int32),
    weights.astype(np.float32),
    answers,
    np.asarray(kind_ids, np.int32),
  )
