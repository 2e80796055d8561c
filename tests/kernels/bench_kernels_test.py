"""experiments/bench_kernels.py: refuses CPU timings; code paths run."""

import pytest
from absl import app
from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver

from experiments import bench_kernels


def setUpModule():
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(["bench_kernels", "--out=/dev/null"])


class BenchKernelsTest(absltest.TestCase):
  def test_refuses_to_time_interpret_mode_on_cpu(self):
    with self.assertRaisesRegex(app.UsageError, "refuses"):
      bench_kernels.main(["bench_kernels"])

  def test_smoke_records_no_timings(self):
    rec = bench_kernels.run(smoke_only=True)
    self.assertIsNone(rec["timings"])
    self.assertIn("interpret mode", rec["note"])
    self.assertLess(rec["smoke"]["decode_max_abs_diff_vs_reference"], 1e-4)
    self.assertEqual(rec["smoke"]["decode_certificate"]["valid_fraction"], 1)

  @pytest.mark.slow
  @flagsaver.flagsaver(heads=2, kv_heads=1, head_dim=16, block=32, splits=2)
  def test_timing_code_paths_run(self):
    # Exercises every baseline's code path at a tiny size in interpret mode
    # (the GPU run uses the same code); the timings are discarded.
    bench_kernels.INTERPRET = True
    try:
      dec = bench_kernels.bench_decode(128, repeats=1)
      pre = bench_kernels.bench_prefill(64, repeats=1)
    finally:
      bench_kernels.INTERPRET = False
    for name in ("dense_xla", "xla_topk_delta", "pallas_certified_decode"):
      self.assertIn("min_s", dec[name], msg=(name, dec[name]))
    self.assertLessEqual(dec["pallas_certificate"]["tv_bound_max"], 0.01)
    for name in (
      "dense_xla",
      "pallas_sparse_flash_all_blocks",
      "pallas_sparse_flash_eighth_blocks",
      "pallas_certified_prefill",
      "xla_topk_certified",
    ):
      self.assertIn("min_s", pre[name], msg=(name, pre[name]))


if __name__ == "__main__":
  absltest.main()
