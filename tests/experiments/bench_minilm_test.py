"""Smoke test of experiments/bench_minilm.py (runs it in seconds)."""

import json
import pathlib
import tempfile

import pytest
from absl.testing import absltest

from experiments import bench_minilm


class BenchMiniLMTest(absltest.TestCase):
  @pytest.mark.slow
  def test_smoke_run_writes_record(self):
    record = bench_minilm.run(batch_size=2, max_len=11, repeats=1)
    for name in ("load_minilm", "embed_forward_jit", "minilm_attention_rows"):
      timing = record[name]
      self.assertGreater(timing["min_s"], 0.0, msg=name)
      self.assertLessEqual(timing["min_s"], timing["median_s"], msg=name)
    self.assertLen(record["text_sources"], 2)
    self.assertGreater(record["embed_forward_jit"]["tokens_per_s_at_min"], 0)
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "out.json"
      path.write_text(json.dumps(record))  # the record is JSON-serialisable
      self.assertEqual(json.loads(path.read_text())["max_len"], 11)


if __name__ == "__main__":
  absltest.main()
