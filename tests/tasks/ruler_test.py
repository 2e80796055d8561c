"""Tests for jaxtopk.tasks' RULER-style generators."""

import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from jaxtopk import tasks

VOCAB = tasks.Vocab(num_keys=23, num_values=11, num_filler=7)
TEXT = np.arange(VOCAB.filler_start, VOCAB.size).repeat(3)  # a "stream"


def _is_key(t):
  return VOCAB.key_start <= t < VOCAB.value_start


def _lookup(row, col, key):
  """The token after ``key``'s needle (its occurrence before ``col`` that
  is not itself the second token of a needle)."""
  hits = [
    i
    for i in np.flatnonzero(row[:col] == key)
    if i == 0 or not _is_key(row[i - 1]) or row[i - 1] == tasks.QUERY
  ]
  assert len(hits) == 1, (key, hits)
  return row[hits[0] + 1]


class RulerTest(parameterized.TestCase):
  def _common(self, batch, seq_len, rows):
    self.assertEqual(batch.inputs.shape, (rows, seq_len))
    self.assertEqual(batch.inputs.dtype, np.int32)
    np.testing.assert_array_equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    self.assertTrue(((batch.inputs >= 0) & (batch.inputs < VOCAB.size)).all())
    cols = np.flatnonzero(batch.answer_mask[0])
    self.assertEqual(cols.min(), batch.first_answer)
    self.assertTrue((batch.answer_mask == batch.answer_mask[:1]).all())
    return cols

  @parameterized.named_parameters(
    ("single_noise", 1, 1, 1, None),
    ("multikey_text", 4, 1, 1, TEXT),
    ("multiquery", 5, 3, 1, TEXT),
    ("long_values", 3, 1, 3, None),
  )
  def test_needles(self, needles, queries, value_len, haystack):
    seq_len = 61
    batch = tasks.needle_task(
      0,
      batch_size=7,
      seq_len=seq_len,
      vocab=VOCAB,
      haystack=haystack,
      num_needles=needles,
      num_queries=queries,
      value_len=value_len,
    )
    cols = self._common(batch, seq_len, 7)
    self.assertLen(cols, queries * value_len)
    for row in range(7):
      x = batch.inputs[row]
      keys = [t for t in x[: cols[0] - 1] if _is_key(t)]
      self.assertLen(keys, needles)  # distinct keys, one needle each
      for q in range(queries):
        col = cols[q * value_len]
        self.assertEqual(x[col - 1], tasks.QUERY)
        where = np.flatnonzero(x[: col - 1] == x[col])[0]
        want = x[where + 1 : where + 1 + value_len]
        got = batch.targets[row, col : col + value_len]
        np.testing.assert_array_equal(got, want)
    if haystack is not None:  # the haystack is the stream's tokens
      self.assertTrue(np.isin(batch.inputs[:, :5], TEXT).any())

  def test_needle_depth(self):
    seq_len = 41
    for depth in (0.0, 0.5, 1.0):
      batch = tasks.needle_task(
        1, batch_size=3, seq_len=seq_len, vocab=VOCAB, depth=depth
      )
      key = batch.inputs[:, -1]
      pairs = zip(batch.inputs, key, strict=True)
      where = [np.flatnonzero(r == k)[0] for r, k in pairs]
      hay_len = seq_len + 1 - 3
      np.testing.assert_array_equal(where, round(depth * (hay_len - 2)))

  @parameterized.named_parameters(("one_chain", 1, 1), ("distractors", 3, 2))
  def test_variable_tracking(self, hops, chains):
    seq_len = 53
    batch = tasks.variable_tracking(
      2,
      batch_size=5,
      seq_len=seq_len,
      vocab=VOCAB,
      haystack=TEXT,
      num_hops=hops,
      num_chains=chains,
    )
    cols = self._common(batch, seq_len, 5)
    self.assertLen(cols, hops + 1)
    for row in range(5):
      x = batch.inputs[row]
      current = x[cols[0]]  # the queried variable
      for col in cols:  # each answer resolves one hop of the chain
        current = _lookup(x, cols[0] - 1, current)
        self.assertEqual(batch.targets[row, col], current)
      self.assertFalse(_is_key(current))  # ends at the value

  def test_aggregation(self):
    seq_len = 47
    batch = tasks.aggregation(
      3,
      batch_size=6,
      seq_len=seq_len,
      vocab=VOCAB,
      num_occurrences=3,
      num_levels=3,
      num_distractors=2,
    )
    cols = self._common(batch, seq_len, 6)
    self.assertEqual(list(cols), [seq_len - 1])
    for row in range(6):
      x = batch.inputs[row]
      self.assertEqual(x[-2], tasks.SUM)
      hits = np.flatnonzero(x[:-2] == x[-1])
      self.assertLen(hits, 3)
      total = sum(x[i + 1] - VOCAB.value_start for i in hits)
      self.assertEqual(batch.targets[row, -1], VOCAB.value_start + total)

  def test_seeded_and_refusals(self):
    a = tasks.variable_tracking(4, batch_size=2, seq_len=30, vocab=VOCAB)
    b = tasks.variable_tracking(4, batch_size=2, seq_len=30, vocab=VOCAB)
    np.testing.assert_array_equal(a.inputs, b.inputs)
    with self.assertRaisesRegex(ValueError, "num_queries=3"):
      tasks.needle_task(
        0, batch_size=1, seq_len=30, num_needles=2, num_queries=3
      )
    with self.assertRaisesRegex(ValueError, "exceed"):
      tasks.needle_task(0, batch_size=1, seq_len=12, num_needles=6)
    with self.assertRaisesRegex(ValueError, "num_keys"):
      tasks.variable_tracking(
        0, batch_size=1, seq_len=99, vocab=VOCAB, num_hops=5, num_chains=4
      )
    with self.assertRaisesRegex(ValueError, "num_values"):
      tasks.aggregation(0, batch_size=1, seq_len=40, vocab=VOCAB, num_levels=5)
    with self.assertRaisesRegex(ValueError, "depth"):
      tasks.needle_task(0, batch_size=1, seq_len=30, depth=1.5)
    with self.assertRaisesRegex(ValueError, "empty"):
      tasks.needle_task(0, batch_size=1, seq_len=30, haystack=np.zeros(0))


if __name__ == "__main__":
  absltest.main()
