"""experiments/bench_scaling.py runs end to end with its smoke config."""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

from absl.testing import absltest

_ROOT = pathlib.Path(__file__).resolve().parents[2]


class BenchScalingSmokeTest(absltest.TestCase):
  def test_smoke_run_writes_results(self):
    workdir = pathlib.Path(tempfile.mkdtemp())
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run(
      [
        sys.executable,
        "-m",
        "experiments.bench_scaling",
        "--config=experiments/configs/bench_scaling.py:smoke",
        f"--workdir={workdir}",
      ],
      cwd=_ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
    )
    self.assertEqual(r.returncode, 0, r.stderr[-4000:])
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").open()]
    self.assertLen(rows, 2)
    one, sharded = sorted(rows, key=lambda x: x["devices"])
    self.assertEqual(one["collectives"], 0)
    self.assertEqual(sharded["devices"], 8)
    self.assertGreater(sharded["collectives"], 0)
    self.assertGreater(sharded["sent_bytes_per_row"], 0)
    self.assertTrue(sharded["k_kept_equal_1_device"])
    self.assertLess(sharded["max_abs_diff_vs_1_device"], 2e-2)  # bf16 output
    self.assertLessEqual(sharded["tv_bound_max"], 0.01)
    self.assertTrue((workdir / "scaling.png").exists())
    # A second run into the same workdir refuses instead of mixing results.
    again = subprocess.run(
      r.args, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    self.assertNotEqual(again.returncode, 0)
    self.assertIn("--overwrite", again.stderr + again.stdout)


if __name__ == "__main__":
  absltest.main()
