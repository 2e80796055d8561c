"""RULER-style long-context tasks in a haystack (Hsieh et al. 2024).

RULER measures what a model retrieves from a long context with synthetic
tasks of known answers. These generators build them over the shared
:class:`Vocab` token layout (specials, keys, values, filler), with the
haystack either random filler tokens (RULER's noise haystack) or windows of
a given token stream (e.g. real text, RULER's essay haystack; for a model
whose filler range is bytes, ``filler_start + byte``):

- :func:`needle_task`: needles ``k v_1 .. v_L`` (``L = value_len``) with
  distinct keys at random positions (or the first at ``depth``), then for
  ``num_queries`` of them ``Q k -> v_1 .. v_L`` (RULER's single needle,
  multi-key with distractor needles, multi-query, and long values).
- :func:`variable_tracking`: chains ``x0 v``, ``x1 x0``, ..., ``xh x(h-1)``
  (each variable assigned the previous one), in order through the
  haystack, then ``Q xh -> x(h-1) .. x0 v``: the answer resolves the chain
  one hop per token, each hop a lookup of the current variable.
- :func:`aggregation`: ``kq l_i`` pairs (small values) for one key among
  distractor pairs, then ``S kq -> value_start + sum_i l_i`` (the answer
  needs every occurrence at once, as RULER's aggregation tasks do).

Every task returns a :class:`RetrievalBatch` whose answer columns are the
same in every row and follow ``first_answer``; when they are contiguous
(every task here with ``num_queries=1``), greedy generation from
``inputs[:, :first_answer + 1]`` reproduces the answers exactly when every
teacher-forced answer prediction is right.
"""

import numpy as np

from jaxtopk.tasks._retrieval import QUERY
from jaxtopk.tasks._retrieval import SUM
from jaxtopk.tasks._retrieval import RetrievalBatch
from jaxtopk.tasks._retrieval import Vocab
from jaxtopk.tasks._retrieval import _check
from jaxtopk.tasks._retrieval import _finish
from jaxtopk.tasks._retrieval import _rng

_VOCAB = Vocab()  # the default layout


def haystack_windows(
  rng: np.random.Generator,
  batch_size: int,
  length: int,
  vocab: Vocab,
  haystack: np.ndarray | None,
) -> np.ndarray:
  """``[batch, length]`` haystack tokens: random filler or stream windows.

  Args:
    rng: the generator.
    batch_size: rows.
    length: tokens per row.
    vocab: token layout (filler range for the noise haystack).
    haystack: None for random filler tokens, else a 1-D int token stream;
      each row is a window starting at a random offset (the stream is
      repeated when shorter than ``length``).

  Returns:
    int64 ``[batch, length]``.
  """
  if haystack is None:
    return rng.integers(0, vocab.num_filler, (batch_size, length)) + (
      vocab.filler_start
    )
  stream = np.asarray(haystack).reshape(-1)
  if stream.size == 0:
    raise ValueError("haystack is empty")
  reps = -(-(length + stream.size) // stream.size)
  tiled = np.tile(stream, reps)
  start = rng.integers(0, stream.size, batch_size)
  idx = start[:, None] + np.arange(length)[None, :]  # [b, length]
  return tiled[idx].astype(np.int64)


def _slots(rng, batch_size, hay_len, widths, first_at=None):
  """Non-overlapping start positions ``[b, n]`` of needles of ``widths``.

  Stars and bars: n sorted draws from ``hay_len - sum(widths) + 1`` gaps,
  each shifted by the widths before it, so needles never overlap and keep
  their order. Every needle is followed by at least one haystack token (two
  needles never touch: the token before a needle is never another
  needle's). ``first_at``: ``[b]`` start of needle 0 (the others drawn
  around it).
  """
  widths = np.asarray(widths) + 1  # one haystack token after each needle
  free = hay_len - int(widths.sum())
  if free < 0:
    raise ValueError(f"needles of {int(widths.sum())} tokens exceed {hay_len=}")
  n = widths.size
  if first_at is None:
    gaps = np.sort(rng.integers(0, free + 1, (batch_size, n)), axis=1)
    return gaps + np.concatenate([[0], np.cumsum(widths)[:-1]])[None, :]
  # needle 0 at first_at, the rest in the free space before or after it.
  out = np.zeros((batch_size, n), np.int64)
  for row in range(batch_size):
    start = int(first_at[row])
    taken = [(start, start + widths[0])]
    for j in range(1, n):
      for _ in range(1000):
        p = int(rng.integers(0, hay_len - widths[j] + 1))
        if all(p + widths[j] <= a or p >= b for a, b in taken):
          break
      else:
        raise ValueError(f"no room for {n} needles in {hay_len=}")
      taken.append((p, p + widths[j]))
    out[row] = [a for a, _ in taken]
  return out


def _distinct_keys(rng, vocab, batch_size, count):
  if count > vocab.num_keys:
    raise ValueError(
      f"{count} distinct keys need vocab.num_keys >= {count}; got"
      f" {vocab.num_keys}"
    )
  keys = np.argsort(rng.random((batch_size, vocab.num_keys)), axis=-1)
  return keys[:, :count] + vocab.key_start  # [b, count]


def _place(tokens, starts, needles):
  """Writes ``needles[b][j]`` (1-D arrays) at ``tokens[b, starts[b, j]:]``."""
  for row in range(tokens.shape[0]):
    for j, needle in enumerate(needles[row]):
      tokens[row, starts[row, j] : starts[row, j] + len(needle)] = needle


def _assemble(hay, tail, seq_len, answer_offsets):
  """``hay`` then ``tail`` as ``seq_len + 1`` tokens; answers at offsets."""
  tokens = np.concatenate([hay, tail], axis=1)
  assert tokens.shape[1] == seq_len + 1, tokens.shape
  cols = hay.shape[1] + np.asarray(answer_offsets) - 1  # input columns
  return _finish(tokens, cols)


def needle_task(
  seed,
  *,
  batch_size: int,
  seq_len: int,
  vocab: Vocab = _VOCAB,
  haystack: np.ndarray | None = None,
  num_needles: int = 1,
  num_queries: int = 1,
  value_len: int = 1,
  depth: float | None = None,
) -> RetrievalBatch:
  """Needles in a haystack, then ``Q key -> value`` for some of them.

  Args:
    seed: anything ``np.random.default_rng`` accepts.
    batch_size: rows.
    seq_len: input length.
    vocab: token layout.
    haystack: None (random filler) or a token stream (see
      :func:`haystack_windows`).
    num_needles: needles with distinct keys (the others are distractors).
    num_queries: needles queried, in [1, num_needles]; each query is
      ``Q key`` followed by its ``value_len`` value tokens (the answers).
    value_len: value tokens per needle.
    depth: position of the first queried needle as a fraction of the
      haystack, in [0, 1]; None draws every needle uniformly.

  Returns:
    A :class:`RetrievalBatch` with ``num_queries * value_len`` answers.

  Raises:
    ValueError: on bad sizes, or needles that do not fit.
  """
  _check(seq_len, batch_size)
  for name, val in (
    ("num_needles", num_needles),
    ("num_queries", num_queries),
    ("value_len", value_len),
  ):
    if not (isinstance(val, int) and val >= 1):
      raise ValueError(f"{name}={val!r} must be an int >= 1")
  if num_queries > num_needles:
    raise ValueError(f"{num_queries=} must be <= {num_needles=}")
  if depth is not None and not 0.0 <= depth <= 1.0:
    raise ValueError(f"{depth=} must be in [0, 1] or None")
  rng = _rng(seed)
  width = 1 + value_len
  tail_len = num_queries * (2 + value_len)
  hay_len = seq_len + 1 - tail_len
  keys = _distinct_keys(rng, vocab, batch_size, num_needles)  # [b, n]
  shape = (batch_size, num_needles, value_len)
  values = rng.integers(0, vocab.num_values, shape) + vocab.value_start
  first = None
  if depth is not None:
    first = np.full(batch_size, round(depth * (hay_len - width)))
  starts = _slots(rng, batch_size, hay_len, [width] * num_needles, first)
  hay = haystack_windows(rng, batch_size, hay_len, vocab, haystack)
  _place(
    hay,
    starts,
    [
      [np.concatenate([[keys[b, j]], values[b, j]]) for j in range(num_needles)]
      for b in range(batch_size)
    ],
  )
  tail, answers = [], []
  for j in range(num_queries):
    tail += [np.full((batch_size, 1), QUERY), keys[:, j : j + 1], values[:, j]]
    base = j * (2 + value_len) + 2
    answers += [base + i for i in range(value_len)]
  return _assemble(hay, np.concatenate(tail, axis=1), seq_len, answers)


def variable_tracking(
  seed,
  *,
  batch_size: int,
  seq_len: int,
  vocab: Vocab = _VOCAB,
  haystack: np.ndarray | None = None,
  num_hops: int = 2,
  num_chains: int = 1,
) -> RetrievalBatch:
  """Chains of variable assignments, then ``Q last -> chain .. value``.

  Chain c: distinct variables (keys) ``x0 .. xh`` (h = ``num_hops``) and a
  value v; the needles ``x0 v``, ``x1 x0``, ..., ``xh x(h-1)`` lie in that
  order through the haystack, the chains interleaved. The query ``Q xh`` of
  chain 0 is answered by ``x(h-1) .. x0 v`` (h + 1 answer tokens).

  Args:
    seed: anything ``np.random.default_rng`` accepts.
    batch_size: rows.
    seq_len: input length.
    vocab: token layout; needs ``num_keys >= num_chains * (num_hops + 1)``.
    haystack: None (random filler) or a token stream.
    num_hops: assignments between the queried variable and the value, >= 1.
    num_chains: chains (1 queried, the rest distractors), >= 1.

  Returns:
    A :class:`RetrievalBatch` with ``num_hops + 1`` contiguous answers.
  """
  _check(seq_len, batch_size)
  for name, val in (("num_hops", num_hops), ("num_chains", num_chains)):
    if not (isinstance(val, int) and val >= 1):
      raise ValueError(f"{name}={val!r} must be an int >= 1")
  rng = _rng(seed)
  h = num_hops
  tail_len = 2 + h + 1
  hay_len = seq_len + 1 - tail_len
  n_vars = num_chains * (h + 1)
  xs = _distinct_keys(rng, vocab, batch_size, n_vars).reshape(
    batch_size, num_chains, h + 1
  )
  vals = rng.integers(0, vocab.num_values, (batch_size, num_chains))
  vals = vals + vocab.value_start
  n = num_chains * (h + 1)
  starts = _slots(rng, batch_size, hay_len, [2] * n)  # sorted positions
  needles = []
  for b in range(batch_size):
    # Interleave the chains: a random order of (chain, hop) that keeps each
    # chain's hops in order.
    order = rng.permutation(np.repeat(np.arange(num_chains), h + 1))
    hop = np.zeros(num_chains, int)
    row = []
    for c in order:
      i = hop[c]
      hop[c] += 1
      prev = vals[b, c] if i == 0 else xs[b, c, i - 1]
      row.append(np.array([xs[b, c, i], prev]))
    needles.append(row)
  hay = haystack_windows(rng, batch_size, hay_len, vocab, haystack)
  _place(hay, starts, needles)
  chain = xs[:, 0, ::-1]  # [b, h + 1]: xh .. x0
  tail = np.concatenate(
    [np.full((batch_size, 1), QUERY), chain, vals[:, :1]], axis=1
  )
  return _assemble(hay, tail, seq_len, list(range(2, 2 + h + 1)))


def aggregation(
  seed,
  *,
  batch_size: int,
  seq_len: int,
  vocab: Vocab = _VOCAB,
  haystack: np.ndarray | None = None,
  num_occurrences: int = 4,
  num_levels: int = 3,
  num_distractors: int = 4,
) -> RetrievalBatch:
  """Pairs ``kq l_i`` among distractors, then ``S kq -> value(sum l_i)``.

  Args:
    seed: anything ``np.random.default_rng`` accepts.
    batch_size: rows.
    seq_len: input length.
    vocab: token layout; ``num_occurrences * (num_levels - 1)`` must be
      below ``num_values``.
    haystack: None (random filler) or a token stream.
    num_occurrences: pairs of the queried key, >= 1.
    num_levels: each pair's value is ``value_start + l``, ``l`` in
      ``[0, num_levels)``.
    num_distractors: pairs of other (distinct) keys.

  Returns:
    A :class:`RetrievalBatch` with one answer (the last column).
  """
  _check(seq_len, batch_size)
  m = num_occurrences
  if not (isinstance(m, int) and m >= 1):
    raise ValueError(f"{num_occurrences=} must be an int >= 1")
  if not (isinstance(num_levels, int) and num_levels >= 1):
    raise ValueError(f"{num_levels=} must be an int >= 1")
  if m * (num_levels - 1) >= vocab.num_values:
    raise ValueError(
      f"{num_occurrences=} * ({num_levels=} - 1) must be < "
      f"vocab.num_values={vocab.num_values} (the sum is a value token)"
    )
  rng = _rng(seed)
  hay_len = seq_len + 1 - 3
  keys = _distinct_keys(rng, vocab, batch_size, 1 + num_distractors)
  owner = np.concatenate(
    [np.zeros(m, int), 1 + np.arange(num_distractors)]
  )  # pair -> key index
  n = owner.size
  levels = rng.integers(0, num_levels, (batch_size, n))
  perm = np.argsort(rng.random((batch_size, n)), axis=1)
  pair_owner = owner[perm]  # [b, n] random order of the pairs
  starts = _slots(rng, batch_size, hay_len, [2] * n)
  hay = haystack_windows(rng, batch_size, hay_len, vocab, haystack)
  _place(
    hay,
    starts,
    [
      [
        np.array([keys[b, pair_owner[b, j]], vocab.value_start + levels[b, j]])
        for j in range(n)
      ]
      for b in range(batch_size)
    ],
  )
  total = np.sum(np.where(pair_owner == 0, levels, 0), axis=1)
  tail = np.stack(
    [np.full(batch_size, SUM), keys[:, 0], vocab.value_start + total], axis=1
  )
  return _assemble(hay, tail, seq_len, [2])
