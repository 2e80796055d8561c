"""Runs every experiment binary with its smoke config; checks its outputs.

Each binary's ``run(config, workdir)`` is called in-process (one jax start
for all of them); one test also launches ``python -m experiments.<name>``
as a subprocess to cover the absl flags path, the default workdir handling
and the refusal to mix two runs in one workdir.
"""

import importlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
from absl.testing import absltest

from experiments import _common

REPO = pathlib.Path(__file__).resolve().parents[2]


def _tmpdir(test) -> pathlib.Path:
  d = tempfile.TemporaryDirectory()
  test.addCleanup(d.cleanup)
  return pathlib.Path(d.name)


def _smoke(name):
  module = importlib.import_module(f"experiments.{name}")
  config = importlib.import_module(f"experiments.configs.{name}")
  return module, config.get_config("smoke")


def _check_common_outputs(test, workdir, figures):
  test.assertTrue((workdir / "config.json").is_file())
  json.loads((workdir / "config.json").read_text())
  test.assertTrue((workdir / "summary.txt").read_text().strip())
  for fig in figures:
    path = workdir / f"{fig}.png"
    test.assertTrue(path.is_file(), f"{path} missing")
    test.assertEqual(path.read_bytes()[:8], b"\x89PNG\r\n\x1a\n")
  return _common.read_metrics(workdir)


class KEpsScalingSmokeTest(absltest.TestCase):
  @pytest.mark.slow
  def test_smoke_run(self):
    module, config = _smoke("k_eps_scaling")
    workdir = _tmpdir(self) / "run"
    module.run(config, workdir)
    _check_common_outputs(
      self, workdir, ["k_eps_vs_sigma", "minilm_pred_vs_obs"]
    )
    gauss = _common.read_metrics(workdir, "gaussian")
    self.assertLen(
      gauss,
      len(config.gaussian.ns) * len(config.gaussian.sigmas) * len(config.epss),
    )
    for r in gauss:
      # k_eps in [1, n], as fractions.
      self.assertBetween(r["observed"], 1.0 / r["n"], 1.0)
      self.assertBetween(r["finite_n"], 1.0 / r["n"], 1.0)
      self.assertBetween(r["rule"], 0.0, 1.0)
    # Small sigma at n = 4096 is inside the rule's validity range (5.4):
    # observed and rule agree within 0.02 absolute.
    for r in gauss:
      if r["sigma"] <= 1.0 and r["n"] >= 4096:
        self.assertLess(abs(r["observed"] - r["rule"]), 0.02, r)
    parts = _common.read_metrics(workdir, "gaussian_part")
    self.assertLen(parts, len(config.gaussian.ns) * len(config.epss))
    minilm = _common.read_metrics(workdir, "minilm_summary")
    self.assertLen(minilm, len(config.epss))
    for r in minilm:
      self.assertTrue(r["k_in_range"])
      self.assertGreater(r["rows"], 0)
      self.assertBetween(r["observed_frac"], 0.0, 1.0)
      self.assertBetween(r["predicted_frac"], 0.0, 1.0)
    # A larger budget keeps fewer keys.
    fracs = [r["observed_frac"] for r in sorted(minilm, key=lambda r: r["eps"])]
    self.assertEqual(fracs, sorted(fracs, reverse=True))

  @pytest.mark.slow
  def test_cli_default_workdir_and_refusal(self):
    cwd = _tmpdir(self)
    cmd = [
      sys.executable,
      "-m",
      "experiments.k_eps_scaling",
      f"--config={REPO}/experiments/configs/k_eps_scaling.py:smoke",
      "--config.minilm.enabled=False",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    first = subprocess.run(
      cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )
    self.assertEqual(first.returncode, 0, first.stderr[-3000:])
    workdir = cwd / "workdirs" / "k_eps_scaling"
    self.assertTrue((workdir / "metrics.jsonl").is_file())
    self.assertIn("rule", first.stdout)
    second = subprocess.run(
      cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )
    self.assertNotEqual(second.returncode, 0)
    self.assertIn("--overwrite", second.stderr)


if __name__ == "__main__":
  absltest.main()
