"""Tests for experiments/_common.py: workdir, metrics, figures, tables."""

import json
import tempfile

import numpy as np
from absl.testing import absltest

from experiments import _common
from experiments.configs import k_eps_scaling as k_eps_config


def _tmpdir(test) -> str:
  """A fresh directory removed after ``test`` (works under plain pytest)."""
  d = tempfile.TemporaryDirectory()
  test.addCleanup(d.cleanup)
  return d.name


class WorkdirTest(absltest.TestCase):
  def test_refuses_rerun_without_overwrite(self):
    workdir = _common.prepare_workdir(_tmpdir(self) + "/run", overwrite=False)
    _common.write_config(workdir, k_eps_config.get_config("smoke"))
    with self.assertRaisesRegex(_common.WorkdirNotEmptyError, "--overwrite"):
      _common.prepare_workdir(workdir, overwrite=False)

  def test_overwrite_removes_only_run_outputs(self):
    workdir = _common.prepare_workdir(_tmpdir(self), overwrite=False)
    writer = _common.MetricWriter(workdir)
    writer.write("a", x=1)
    fig, _ = _common.new_figure()
    _common.save_figure(fig, workdir, "f")
    (workdir / "notes.md").write_text("keep me")
    _common.prepare_workdir(workdir, overwrite=True)
    self.assertEqual(sorted(p.name for p in workdir.iterdir()), ["notes.md"])


class MetricsTest(absltest.TestCase):
  def test_jsonl_round_trip_with_numpy_values(self):
    workdir = _common.prepare_workdir(_tmpdir(self), overwrite=False)
    writer = _common.MetricWriter(workdir)
    writer.write("a", x=np.float32(0.5), k=np.int64(3), v=np.arange(3))
    writer.write("b", ok=np.bool_(True), nan=float("nan"))
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    self.assertLen(lines, 2)
    self.assertEqual(
      json.loads(lines[0]), {"kind": "a", "x": 0.5, "k": 3, "v": [0, 1, 2]}
    )
    self.assertEqual(_common.read_metrics(workdir, "b")[0]["ok"], True)

  def test_config_json_matches_config(self):
    workdir = _common.prepare_workdir(_tmpdir(self), overwrite=False)
    config = k_eps_config.get_config("smoke")
    _common.write_config(workdir, config)
    saved = json.loads((workdir / "config.json").read_text())
    self.assertEqual(saved["gaussian"]["ns"], list(config.gaussian.ns))
    self.assertEqual(saved["seed"], config.seed)


class TableTest(absltest.TestCase):
  def test_format_table(self):
    text = _common.format_table(
      [{"n": 512, "x": 0.25}, {"n": 4096, "x": 1e-7}], ["n", "x"]
    )
    lines = text.splitlines()
    self.assertLen(lines, 4)
    self.assertIn("0.25", lines[2])
    self.assertIn("1.000e-07", lines[3])


class ConfigTest(absltest.TestCase):
  def test_bad_arg_is_named(self):
    with self.assertRaisesRegex(ValueError, "arg='big'"):
      k_eps_config.get_config("big")


if __name__ == "__main__":
  absltest.main()
