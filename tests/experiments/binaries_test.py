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
      # Config overrides from the command line; one point keeps it short.
      "--config.gaussian.ns=(512,)",
      "--config.gaussian.sigmas=(1.0,)",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    first = subprocess.run(
      cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )
    self.assertEqual(first.returncode, 0, first.stderr[-3000:])
    workdir = cwd / "workdirs" / "k_eps_scaling"
    self.assertTrue((workdir / "metrics.jsonl").is_file())
    saved = json.loads((workdir / "config.json").read_text())
    self.assertEqual(saved["gaussian"]["ns"], [512])
    self.assertLen(_common.read_metrics(workdir, "gaussian"), 2)
    self.assertIn("rule", first.stdout)
    second = subprocess.run(
      cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )
    self.assertNotEqual(second.returncode, 0)
    self.assertIn("--overwrite", second.stderr)


class BoundTightnessSmokeTest(absltest.TestCase):
  @pytest.mark.slow
  def test_smoke_run(self):
    module, config = _smoke("bound_tightness")
    workdir = _tmpdir(self)
    module.run(config, workdir)
    _check_common_outputs(self, workdir, ["tightness"])
    records = _common.read_metrics(workdir, "tightness")
    sources = {r["source"] for r in records}
    self.assertIn("minilm", sources)
    self.assertGreater(len(sources), 1)
    self.assertEqual({r["bound"] for r in records}, set(module.BOUNDS), records)
    for r in records:
      # Every bound is sound on every row, hence bound / exact >= 1.
      self.assertEqual(r["sound_frac"], 1.0, r)
      if r["rows_with_tail"]:
        self.assertGreaterEqual(r["ratio_min"], 1.0, r)
    # The single-gap ratio form is never tighter than the exact-head form.
    med = {
      (r["source"], r["rho"], r["bound"]): r["ratio_median"] for r in records
    }
    for (src, rho, b), v in med.items():
      if b == "single_gap_ratio":
        self.assertGreaterEqual(
          v * (1 + 1e-5), med[(src, rho, "single_gap_exact_head")]
        )


class OutputErrorSmokeTest(absltest.TestCase):
  @pytest.mark.slow
  def test_smoke_run(self):
    module, config = _smoke("output_error")
    workdir = _tmpdir(self)
    module.run(config, workdir)
    _check_common_outputs(self, workdir, ["output_error"])
    idents = _common.read_metrics(workdir, "identity")
    self.assertLen(idents, len(config.rhos))
    for r in idents:
      # The head-tail identity matches the dense float64 error to float32
      # round-off relative to the error's size.
      self.assertLess(r["max_abs_dev"], 1e-4 * max(1.0, r["max_real_error"]))
      self.assertLess(r["max_rel_dev"], 1e-3, r)
    bounds = _common.read_metrics(workdir, "output_bound")
    self.assertLen(bounds, len(config.rhos) * len(module.BOUNDS))
    for r in bounds:
      self.assertEqual(r["sound_frac"], 1.0, r)
      self.assertGreaterEqual(r["ratio_min"], 1.0 - 1e-5, r)


class NcSparsitySmokeTest(absltest.TestCase):
  @pytest.mark.slow
  def test_smoke_run(self):
    module, config = _smoke("nc_sparsity")
    workdir = _tmpdir(self)
    module.run(config, workdir)
    _check_common_outputs(self, workdir, ["nc_sparsity"])
    cfg = config.synthetic
    sparsity = _common.read_metrics(workdir, "synthetic_sparsity")
    self.assertLen(sparsity, len(cfg.growth) * len(cfg.ns))
    for r in sparsity:
      for e in config.effective_eps:
        # At most 1/eps entries can carry mass >= eps.
        self.assertBetween(r[f"effective@{e}"], 1.0, min(r["n"], 1.0 / e))
        self.assertBetween(r[f"ineffective@{e}"], 0.0, 1.0)
      # The weights were rescaled to hit the target logit spread.
      # (sample std of q * n logits: a few percent of noise).
      self.assertAlmostEqual(r["sigma"] / r["sigma_target"], 1.0, delta=0.1)
    # R grows with n (the weights grow to widen the logits).
    for a in cfg.growth:
      rs = [r["R"] for r in sparsity if r["a"] == a]
      self.assertEqual(rs, sorted(rs))
    policies = _common.read_metrics(workdir, "synthetic_policy")
    for r in policies:
      self.assertBetween(r["tv"], 0.0, 1.0)
      self.assertBetween(r["topk"], 1, r["n"])
    minilm = _common.read_metrics(workdir, "minilm_sparsity")
    self.assertLen(minilm, len(config.minilm.max_lens) * 6)
    r_recs = _common.read_metrics(workdir, "minilm_R")
    self.assertLen(r_recs, 6 * 12)
    self.assertTrue(all(r["R"] > 0 for r in r_recs))


class CertifiedSearchSmokeTest(absltest.TestCase):
  @pytest.mark.slow
  def test_smoke_run(self):
    module, config = _smoke("certified_search")
    workdir = _tmpdir(self)
    module.run(config, workdir)
    _check_common_outputs(self, workdir, ["certified_search"])
    records = _common.read_metrics(workdir, "search")
    self.assertLen(
      records,
      (2 * len(config.synthetic.sigmas) + 1)
      * len(config.epss)
      * len(config.searches),
    )
    for r in records:
      self.assertEqual(r["valid_frac"], 1.0, r)
      self.assertEqual(r["within_budget_frac"], 1.0, r)
      self.assertGreater(r["scored_frac"], 0.0)
      # Deterministic searches are sound on every row and never keep fewer
      # keys than the minimal k_eps; MC-Search may fail on a few rows (its
      # certificate holds with probability >= 1 - delta) and counts its
      # sampled keys as scored, so it may score more than n per row. An
      # explicit search also counts its block summaries (a box is 2
      # key-equivalents, the ball 1: THEORY 6.4): at most n + 3 n / block.
      block = min(config.synthetic.block_size, config.minilm.block_size)
      if r["search"] == "mc":
        self.assertLessEqual(r["failure_rate"], 0.05, r)
      else:
        self.assertEqual(r["sound_frac"], 1.0, r)
        self.assertLessEqual(r["scored_frac"], 1.0 + 3 / block + 1e-9, r)
        self.assertGreaterEqual(r["kept_frac"], r["k_eps_frac"] - 1e-9, r)
      if r["search"] == "exact":
        self.assertAlmostEqual(r["scored_frac"], 1.0)
    gaps = {
      r["source"]: r for r in _common.read_metrics(workdir, "block_bound")
    }
    self.assertEqual(set(gaps), {r["source"] for r in records})
    for r in gaps.values():
      # Sound block bounds: u_b >= every real logit of its block.
      self.assertGreaterEqual(r["p10_gap"], 0.0, r)
      self.assertBetween(r["frac_blocks_above_row_max"], 0.0, 1.0)
    # Keys clustered by block give tighter block bounds than iid keys.
    sigma = config.synthetic.sigmas[0]
    self.assertLess(
      gaps[f"clustered sigma={sigma}"]["median_gap"],
      gaps[f"gaussian sigma={sigma}"]["median_gap"],
    )


if __name__ == "__main__":
  absltest.main()
