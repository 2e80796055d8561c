"""Tests for jaxtopk.tasks retrieval generators."""

import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from jaxtopk import tasks

VOCAB = tasks.Vocab(num_keys=13, num_values=7, num_filler=5)


def _answer_from_context(inputs, col):
  """The value that followed the queried key earlier in the row."""
  query_key = inputs[col]
  hits = np.flatnonzero(inputs[:col] == query_key)
  return inputs[hits[0] + 1]


class RetrievalTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("recall_even", "recall", 24),
    ("recall_odd", "recall", 23),
    ("needle", "needle", 29),
    ("lookup", "lookup", 27),
  )
  def test_answers_are_retrievable(self, name, seq_len):
    make = {
      "recall": tasks.associative_recall,
      "needle": tasks.needle_in_haystack,
      "lookup": tasks.multi_key_lookup,
    }[name]
    batch = make(0, batch_size=11, seq_len=seq_len, vocab=VOCAB)
    self.assertEqual(batch.inputs.shape, (11, seq_len))
    self.assertEqual(batch.inputs.dtype, np.int32)
    np.testing.assert_array_equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    self.assertTrue((batch.inputs < VOCAB.size).all())
    cols = np.flatnonzero(batch.answer_mask[0])
    self.assertEqual(cols.min(), batch.first_answer)
    self.assertTrue((batch.answer_mask == batch.answer_mask[:1]).all())
    for row in range(11):
      for col in cols:
        target = batch.targets[row, col]
        self.assertGreaterEqual(target, VOCAB.value_start)
        self.assertLess(target, VOCAB.filler_start)
        self.assertEqual(_answer_from_context(batch.inputs[row], col), target)

  def test_keys_distinct_within_row(self):
    batch = tasks.associative_recall(0, batch_size=5, seq_len=26, vocab=VOCAB)
    keys = batch.inputs[:, 0:24:2]
    for row in keys:
      self.assertLen(set(row.tolist()), len(row))

  def test_seeded(self):
    a = tasks.multi_key_lookup(3, batch_size=3, seq_len=21, vocab=VOCAB)
    b = tasks.multi_key_lookup(3, batch_size=3, seq_len=21, vocab=VOCAB)
    c = tasks.multi_key_lookup(4, batch_size=3, seq_len=21, vocab=VOCAB)
    np.testing.assert_array_equal(a.inputs, b.inputs)
    self.assertFalse((a.inputs == c.inputs).all())

  @parameterized.parameters(0.0, 0.5, 1.0)
  def test_needle_depth(self, depth):
    seq_len = 31
    batch = tasks.needle_in_haystack(
      0, batch_size=3, seq_len=seq_len, depth=depth, vocab=VOCAB
    )
    key_cols = np.flatnonzero(
      (batch.inputs[0] >= VOCAB.key_start)
      & (batch.inputs[0] < VOCAB.value_start)
    )
    self.assertEqual(key_cols[0], round(depth * (seq_len - 4)))

  def test_lookup_answers(self):
    batch = tasks.multi_key_lookup(
      0, batch_size=2, seq_len=27, num_queries=3, vocab=VOCAB
    )
    np.testing.assert_array_equal(
      np.flatnonzero(batch.answer_mask[0]), [22, 24, 26]
    )

  def test_errors_name_value(self):
    with self.assertRaisesRegex(ValueError, "num_pairs=11"):
      tasks.associative_recall(
        0, batch_size=2, seq_len=24, vocab=tasks.Vocab(num_keys=5)
      )
    with self.assertRaisesRegex(ValueError, "depth=1.5"):
      tasks.needle_in_haystack(0, batch_size=2, seq_len=24, depth=1.5)
    with self.assertRaisesRegex(ValueError, "seq_len=2"):
      tasks.associative_recall(0, batch_size=2, seq_len=2)
    with self.assertRaisesRegex(ValueError, "num_queries=0"):
      tasks.multi_key_lookup(0, batch_size=2, seq_len=24, num_queries=0)
    with self.assertRaisesRegex(ValueError, "num_keys=0"):
      tasks.Vocab(num_keys=0)

  @parameterized.parameters((3, 2, 29), (5, 3, 30), (1, 7, 13))
  def test_aggregate_answer_is_sum_over_occurrences(self, m, levels, seq_len):
    vocab = tasks.Vocab(num_keys=13, num_values=17, num_filler=5)
    batch = tasks.aggregate_recall(
      0,
      batch_size=11,
      seq_len=seq_len,
      num_occurrences=m,
      num_levels=levels,
      vocab=vocab,
    )
    self.assertEqual(batch.inputs.shape, (11, seq_len))
    np.testing.assert_array_equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    np.testing.assert_array_equal(
      np.flatnonzero(batch.answer_mask[0]), [seq_len - 1]
    )
    start = seq_len % 2  # one leading filler token when odd
    for row in range(11):
      inputs = batch.inputs[row]
      self.assertEqual(inputs[-2], tasks.SUM)
      query = inputs[-1]
      keys = inputs[start : seq_len - 2 : 2]
      values = inputs[start + 1 : seq_len - 2 : 2] - vocab.value_start
      self.assertTrue((keys >= vocab.key_start).all())
      self.assertTrue((keys < vocab.value_start).all())
      self.assertTrue(((values >= 0) & (values < levels)).all())
      self.assertEqual(np.sum(keys == query), m)
      others = keys[keys != query].tolist()
      self.assertLen(set(others), len(others))
      want = vocab.value_start + values[keys == query].sum()
      self.assertEqual(batch.targets[row, -1], want)

  def test_aggregate_positions_vary(self):
    batch = tasks.aggregate_recall(0, batch_size=7, seq_len=26)
    where = batch.inputs[:, :-2] == batch.inputs[:, -1:]
    self.assertGreater(len({tuple(np.flatnonzero(w)) for w in where}), 1)
    sums = batch.targets[:, -1]
    self.assertGreater(len(set(sums.tolist())), 1)

  def test_aggregate_errors_name_value(self):
    with self.assertRaisesRegex(ValueError, "num_occurrences=12"):
      tasks.aggregate_recall(0, batch_size=2, seq_len=24, num_occurrences=12)
    with self.assertRaisesRegex(ValueError, "num_levels=0"):
      tasks.aggregate_recall(0, batch_size=2, seq_len=24, num_levels=0)
    with self.assertRaisesRegex(ValueError, "num_values=7"):
      tasks.aggregate_recall(
        0, batch_size=2, seq_len=24, vocab=tasks.Vocab(num_values=7)
      )


if __name__ == "__main__":
  absltest.main()
