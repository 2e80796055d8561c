"""Smoke runs of bench_decode and bench_selection at tiny sizes (no timing
asserted: the figures live in their JSON)."""

from absl.testing import absltest

from experiments import bench_decode
from experiments import bench_selection


class BenchSmokeTest(absltest.TestCase):
  def test_decode_bench_runs_and_agrees(self):
    r = bench_decode.bench(1024, heads=2, head_dim=8, rho=1 / 64, repeats=1)
    self.assertLess(r["max_abs_diff_vs_lax_topk"], 1e-5)
    for name in ("floor", "dense", "lax_topk", "jaxtopk"):
      self.assertGreater(r[name]["min_ms"], 0.0)

  def test_selection_bench_matches_sort_baseline(self):
    (r,) = bench_selection.part_exact([2048], rows=3, eps=0.05, repeats=1)
    self.assertEqual(r["same_keep_fraction"], 1.0)
    self.assertLessEqual(r["tv_bound_max"], 0.05)


if __name__ == "__main__":
  absltest.main()
