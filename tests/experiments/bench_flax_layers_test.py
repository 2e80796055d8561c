"""Smoke test of experiments/bench_flax_layers.py (runs it in seconds)."""

import json

import pytest
from absl.testing import absltest

from experiments import bench_flax_layers


class BenchFlaxLayersTest(absltest.TestCase):
  @pytest.mark.slow
  def test_smoke_run_writes_record(self):
    # Two of the four layers (compiles dominate on a shared CPU).
    record = bench_flax_layers.run(
      batch=1,
      seq=32,
      heads=2,
      head_dim=4,
      repeats=1,
      only=["nnx_multi_head_attention", "topk_fixed_k"],
    )
    for phase in ("prefill", "decode"):
      self.assertLen(record[phase], 2, msg=phase)
      for name, timing in record[phase].items():
        self.assertGreater(timing["min_s"], 0.0, msg=name)
        self.assertLessEqual(timing["min_s"], timing["median_s"], msg=name)
    cert = record["decode"]["topk_fixed_k_2"]["certificate"]
    self.assertEqual(cert["k_kept_mean"], 2.0)
    self.assertEqual(
      record["decode"]["nnx_multi_head_attention"]["cache_filled_to"], 31
    )
    json.dumps(record)  # serialisable

  def test_unknown_layer_name_raises(self):
    with self.assertRaisesRegex(ValueError, "name='nope'"):
      bench_flax_layers.run(
        batch=1, seq=8, heads=1, head_dim=2, repeats=1, only=["nope"]
      )


if __name__ == "__main__":
  absltest.main()
