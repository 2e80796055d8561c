"""experiments/bench_kernels.py: refuses CPU timings; code paths run."""

import tempfile

import jax
import pytest
from absl import app
from absl.testing import absltest

from experiments import bench_kernels
from experiments.configs import bench_kernels as bench_kernels_config


class BenchKernelsTest(absltest.TestCase):
  def test_refuses_to_time_interpret_mode_on_cpu(self):
    if jax.default_backend() != "cpu":  # there run() would time everything
      self.skipTest("the refusal is the CPU's; a GPU or TPU runs the bench")
    config = bench_kernels_config.get_config()
    with tempfile.TemporaryDirectory() as workdir:
      with self.assertRaisesRegex(app.UsageError, "refuses"):
        bench_kernels.run(config, workdir)

  @pytest.mark.slow
  def test_timing_code_paths_run(self):
    # Exercises every baseline's code path at a tiny size in interpret mode
    # (the GPU run uses the same code); the timings are discarded.
    c = bench_kernels_config.get_config()
    with c.unlocked():
      c.update(heads=2, kv_heads=1, head_dim=16, block=32, splits=2, repeats=1)
    bench_kernels.INTERPRET = True
    try:
      dec = bench_kernels.bench_decode(c, 128)
      pre = bench_kernels.bench_prefill(c, 64)
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
