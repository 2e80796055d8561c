"""Synthetic long-context retrieval tasks for native Top-k studies.

THEORY 8 ([NATIVE]) studies whether Top-k attention keeps a model able to
retrieve one fact from a long context. These generators build such contexts on
the fly, seeded, as fixed-length token batches for next-token training:

- ``associative_recall``: ``k1 v1 k2 v2 ... kP vP Q kq -> vq`` (the pairs fill
  the context; keys are distinct within a sequence).
- ``needle_in_haystack``: random filler with one ``key value`` needle at a
  chosen depth, then ``Q key -> value``.
- ``multi_key_lookup``: pairs, then ``Q`` followed by ``num_queries`` keys,
  each followed by its value (multi-query associative recall): every value
  after ``Q`` is an answer.
- ``aggregate_recall``: pairs in which the queried key occurs
  ``num_occurrences`` times with small values, then ``S kq -> sum`` of its
  values. Unlike the tasks above (one key per head suffices at the answer),
  the answer needs every occurrence, so Top-k attention that keeps fewer
  keys per head than ``num_occurrences`` loses it.

Every task returns a :class:`RetrievalBatch` of ``inputs`` and ``targets``
(``targets[:, t] = inputs[:, t + 1]`` of the underlying sequence) and a
boolean ``answer_mask`` marking the positions whose target is an answer;
training scores only those. The answer positions are the same for every row
of a batch, so ``first_answer`` (the static index of the first answer
position) is the natural prefill length for KV-cache decoding.

The token ids of the shared :class:`Vocab` are disjoint ranges (specials,
keys, values, filler) so a model can learn one lookup rule for all tasks.
"""

import dataclasses

import numpy as np

PAD = 0
QUERY = 1
SUM = 2  # query marker of aggregate_recall (answer = a sum, not a copy)
NUM_SPECIAL = 3


@dataclasses.dataclass(frozen=True)
class Vocab:
  """Token layout shared by all retrieval tasks.

  Attributes:
    num_keys: size of the key range; a sequence holds at most this many
      distinct keys.
    num_values: size of the value range.
    num_filler: size of the haystack filler range.
  """

  num_keys: int = 128
  num_values: int = 64
  num_filler: int = 64

  def __post_init__(self):
    for name in ("num_keys", "num_values", "num_filler"):
      value = getattr(self, name)
      if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"Vocab.{name}={value!r} must be an int >= 1")

  @property
  def key_start(self) -> int:
    return NUM_SPECIAL

  @property
  def value_start(self) -> int:
    return self.key_start + self.num_keys

  @property
  def filler_start(self) -> int:
    return self.value_start + self.num_values

  @property
  def size(self) -> int:
    """Total vocabulary size (embedding rows)."""
    return self.filler_start + self.num_filler


@dataclasses.dataclass(frozen=True)
class RetrievalBatch:
  """A batch of fixed-length retrieval sequences.

  Attributes:
    inputs: int32 ``[batch, seq_len]`` input tokens.
    targets: int32 ``[batch, seq_len]`` next tokens.
    answer_mask: bool ``[batch, seq_len]``, True where ``targets`` is an
      answer (the same columns in every row).
    first_answer: index of the first answer column (static).
  """

  inputs: np.ndarray
  targets: np.ndarray
  answer_mask: np.ndarray
  first_answer: int


def _check(seq_len: int, batch_size: int) -> None:
  if not (isinstance(seq_len, int) and seq_len >= 4):
    raise ValueError(f"{seq_len=} must be an int >= 4")
  if not (isinstance(batch_size, int) and batch_size >= 1):
    raise ValueError(f"{batch_size=} must be an int >= 1")


def _rng(seed) -> np.random.Generator:
  return np.random.default_rng(seed)


def _pairs(rng, vocab: Vocab, batch_size: int, num_pairs: int):
  """Distinct keys ``[b, num_pairs]`` and values ``[b, num_pairs]``."""
  if num_pairs > vocab.num_keys:
    raise ValueError(
      f"{num_pairs=} distinct keys need vocab.num_keys >= {num_pairs}; "
      f"got {vocab.num_keys}"
    )
  keys = np.argsort(rng.random((batch_size, vocab.num_keys)), axis=-1)
  keys = keys[:, :num_pairs] + vocab.key_start  # [b, p]
  values = rng.integers(0, vocab.num_values, (batch_size, num_pairs))
  return keys, values + vocab.value_start  # [b, p], [b, p]


def _interleave(keys, values):
  """``[b, p]`` keys and values -> ``[b, 2p]`` k1 v1 k2 v2 ..."""
  return np.stack([keys, values], axis=-1).reshape(keys.shape[0], -1)


def _finish(tokens: np.ndarray, answer_cols: np.ndarray) -> RetrievalBatch:
  """Splits ``[b, seq_len + 1]`` tokens into a batch scoring ``answer_cols``."""
  inputs = tokens[:, :-1].astype(np.int32)
  targets = tokens[:, 1:].astype(np.int32)
  answer_mask = np.zeros(inputs.shape, bool)
  answer_mask[:, answer_cols] = True
  return RetrievalBatch(inputs, targets, answer_mask, int(answer_cols.min()))


def associative_recall(
  seed, *, batch_size: int, seq_len: int, vocab: Vocab = Vocab()
) -> RetrievalBatch:
  """``k1 v1 ... kP vP Q kq -> vq`` with P = (seq_len - 2) // 2 pairs.

  Args:
    seed: anything ``np.random.default_rng`` accepts (int or tuple of ints).
    batch_size: rows.
    seq_len: input length; the pairs fill it (one leading filler token when
      ``seq_len`` is odd).
    vocab: token layout; needs ``num_keys >= (seq_len - 2) // 2``.

  Returns:
    A :class:`RetrievalBatch` with one answer column (the last).

  Raises:
    ValueError: on bad sizes or a key range too small for distinct keys.
  """
  _check(seq_len, batch_size)
  rng = _rng(seed)
  num_pairs = (seq_len - 2) // 2
  keys, values = _pairs(rng, vocab, batch_size, num_pairs)
  pick = rng.integers(0, num_pairs, batch_size)
  rows = np.arange(batch_size)
  head = rng.integers(0, vocab.num_filler, (batch_size, seq_len % 2))
  tokens = np.concatenate(
    [
      head + vocab.filler_start,
      _interleave(keys, values),
      np.full((batch_size, 1), QUERY),
      keys[rows, pick][:, None],
      values[rows, pick][:, None],
    ],
    axis=1,
  )  # [b, seq_len + 1]
  return _finish(tokens, np.array([seq_len - 1]))


def needle_in_haystack(
  seed,
  *,
  batch_size: int,
  seq_len: int,
  depth: float | None = None,
  vocab: Vocab = Vocab(),
) -> RetrievalBatch:
  """Filler with one ``key value`` needle at ``depth``, then ``Q key -> value``.

  Args:
    seed: anything ``np.random.default_rng`` accepts.
    batch_size: rows.
    seq_len: input length.
    depth: needle position as a fraction of the haystack, in [0, 1] (0 = the
      first token, 1 = just before the query); None draws it uniformly per
      row (for training).
    vocab: token layout.

  Returns:
    A :class:`RetrievalBatch` with one answer column (the last).

  Raises:
    ValueError: on bad sizes or a depth outside [0, 1].
  """
  _check(seq_len, batch_size)
  if depth is not None and not (0.0 <= depth <= 1.0):
    raise ValueError(f"{depth=} must be in [0, 1] or None")
  rng = _rng(seed)
  hay_len = seq_len - 2  # filler plus the two needle tokens
  tokens = rng.integers(0, vocab.num_filler, (batch_size, seq_len + 1))
  tokens += vocab.filler_start
  keys, values = _pairs(rng, vocab, batch_size, 1)
  if depth is None:
    start = rng.integers(0, hay_len - 1, batch_size)
  else:
    start = np.full(batch_size, round(depth * (hay_len - 2)))
  rows = np.arange(batch_size)
  tokens[rows, start] = keys[:, 0]
  tokens[rows, start + 1] = values[:, 0]
  tokens[:, seq_len - 2] = QUERY
  tokens[:, seq_len - 1] = keys[:, 0]
  tokens[:, seq_len] = values[:, 0]
  return _finish(tokens, np.array([seq_len - 1]))


def multi_key_lookup(
  seed,
  *,
  batch_size: int,
  seq_len: int,
  num_queries: int = 4,
  vocab: Vocab = Vocab(),
) -> RetrievalBatch:
  """Pairs, then ``Q ka va kb vb ...``: each queried key's value is an answer.

  Args:
    seed: anything ``np.random.default_rng`` accepts.
    batch_size: rows.
    seq_len: input length; P = (seq_len - 1 - 2 * num_queries) // 2 pairs.
    num_queries: distinct keys queried after ``Q``; >= 1 and <= P.
    vocab: token layout; needs ``num_keys >= P``.

  Returns:
    A :class:`RetrievalBatch` with ``num_queries`` answer columns.

  Raises:
    ValueError: on bad sizes.
  """
  _check(seq_len, batch_size)
  num_pairs = (seq_len - 1 - 2 * num_queries) // 2
  if not (isinstance(num_queries, int) and 1 <= num_queries <= num_pairs):
    raise ValueError(
      f"{num_queries=} must be an int in [1, {num_pairs}] for {seq_len=}"
    )
  rng = _rng(seed)
  keys, values = _pairs(rng, vocab, batch_size, num_pairs)
  pick = np.argsort(rng.random((batch_size, num_pairs)), axis=-1)
  pick = pick[:, :num_queries]  # [b, m] distinct pairs
  rows = np.arange(batch_size)[:, None]
  pad = seq_len + 1 - 2 * num_pairs - 1 - 2 * num_queries
  head = rng.integers(0, vocab.num_filler, (batch_size, pad))
  tokens = np.concatenate(
    [
      head + vocab.filler_start,
      _interleave(keys, values),
      np.full((batch_size, 1), QUERY),
      _interleave(keys[rows, pick], values[rows, pick]),
    ],
    axis=1,
  )  # [b, seq_len + 1]
  answer_cols = seq_len - 1 - 2 * np.arange(num_queries)[::-1]
  return _finish(tokens, answer_cols)


def aggregate_recall(
  seed,
  *,
  batch_size: int,
  seq_len: int,
  num_occurrences: int = 4,
  num_levels: int = 3,
  vocab: Vocab = Vocab(),
) -> RetrievalBatch:
  """Pairs where ``kq`` occurs ``num_occurrences`` times, then ``S kq -> sum``.

  The context holds P = (seq_len - 2) // 2 pairs; the queried key ``kq`` is
  the key of ``num_occurrences`` of them (random positions), the other keys
  are distinct and differ from ``kq``. Every value is a small number, value
  token ``value_start + v`` with ``v`` in ``[0, num_levels)``; the answer is
  the value token ``value_start + sum`` of the values that followed ``kq``.
  Reading all occurrences needs ``num_occurrences`` keys in one attention
  row (THEORY 8.1: exact Top-k below that budget cannot see them all).

  Args:
    seed: anything ``np.random.default_rng`` accepts.
    batch_size: rows.
    seq_len: input length (one leading filler token when odd).
    num_occurrences: occurrences of the queried key; in [1, P].
    num_levels: values per pair, in [1, num_values]; the largest sum
      ``num_occurrences * (num_levels - 1)`` must be < ``vocab.num_values``.
    vocab: token layout; needs ``num_keys >= P - num_occurrences + 1``.

  Returns:
    A :class:`RetrievalBatch` with one answer column (the last).

  Raises:
    ValueError: on bad sizes, or a value range too small for the sums.
  """
  _check(seq_len, batch_size)
  num_pairs = (seq_len - 2) // 2
  m = num_occurrences
  if not (isinstance(m, int) and 1 <= m <= num_pairs):
    raise ValueError(
      f"{num_occurrences=} must be an int in [1, {num_pairs}] for {seq_len=}"
    )
  if not (isinstance(num_levels, int) and num_levels >= 1):
    raise ValueError(f"{num_levels=} must be an int >= 1")
  if m * (num_levels - 1) >= vocab.num_values:
    raise ValueError(
      f"{num_occurrences=} * ({num_levels=} - 1) must be < "
      f"vocab.num_values={vocab.num_values} (the sum is a value token)"
    )
  rng = _rng(seed)
  distinct, _ = _pairs(rng, vocab, batch_size, num_pairs - m + 1)  # [b, d]
  query = distinct[:, :1]  # [b, 1]
  keys = np.concatenate(
    [np.repeat(query, m, axis=1), distinct[:, 1:]], axis=1
  )  # [b, p]: the first m are kq
  order = np.argsort(rng.random((batch_size, num_pairs)), axis=-1)
  keys = np.take_along_axis(keys, order, axis=1)  # kq at random positions
  levels = rng.integers(0, num_levels, (batch_size, num_pairs))  # [b, p]
  total = np.sum(np.where(keys == query, levels, 0), axis=1)  # [b]
  head = rng.integers(0, vocab.num_filler, (batch_size, seq_len % 2))
  tokens = np.concatenate(
    [
      head + vocab.filler_start,
      _interleave(keys, levels + vocab.value_start),
      np.full((batch_size, 1), SUM),
      query,
      total[:, None] + vocab.value_start,
    ],
    axis=1,
  )  # [b, seq_len + 1]
  return _finish(tokens, np.array([seq_len - 1]))
