"""The long-context binaries: training (smoke) and the RULER-style study.

train_long_context's smoke config trains a tiny model and writes it as a
Hugging Face directory; long_context's smoke config evaluates that
directory (dense, Ratio and Certified decoding).
"""

import json
import pathlib
import tempfile

import numpy as np
import pytest
from absl.testing import absltest

from experiments import _common
from experiments import long_context
from experiments import train_long_context
from experiments.configs import long_context as long_context_config
from experiments.configs import train_long_context as train_config


class LongContextTest(absltest.TestCase):
  def _tmp(self):
    return pathlib.Path(self.enter_context(tempfile.TemporaryDirectory()))

  @pytest.mark.slow
  def test_train_then_evaluate(self):
    config = train_config.get_config("smoke")
    workdir = self._tmp()
    train_long_context.run(config, workdir)
    train = _common.read_metrics(workdir, "train")
    self.assertEqual(train[-1]["step"], config.train.steps)
    self.assertEqual(train[-1]["seq_len"], 64)
    self.assertLen(_common.read_metrics(workdir, "eval"), 2)
    self.assertTrue((workdir / "training.png").exists())
    model_dir = workdir / "model"
    hf = json.loads((model_dir / "config.json").read_text())
    self.assertEqual(hf["model_type"], "llama")
    self.assertEqual(hf["rope_scaling"]["rope_type"], "llama3")
    # A rerun of the same config resumes (nothing left to train).
    train_long_context.run(config, workdir)
    self.assertEqual(_common.read_metrics(workdir, "train"), train)

    lc = long_context_config.get_config("smoke")
    with lc.unlocked():
      lc.model_dir = str(model_dir)
    out = self._tmp() / "run"
    rows = long_context.run(lc, out)
    policies = {r["policy"] for r in rows}
    self.assertEqual(
      policies,
      {"dense", "ratio_0.0625", "certified_exact_0.1", "certified_delta_0.1"},
    )
    for r in rows:
      self.assertEqual(r["valid"], 1.0)
      if r["policy"] == "dense":
        self.assertEqual(r["tv_bound_max"], 0.0)
        self.assertEqual(r["kept_frac"], 1.0)
      if r["policy"].startswith("certified"):
        self.assertLessEqual(r["tv_bound_max"], 0.1)
      layer_head = np.asarray(r["tv_bound_layer_head"])
      self.assertEqual(layer_head.shape, (1, 2))  # smoke: 1 layer, 2 heads
    for name in ("accuracy.png", "certificates.png", "results.json"):
      self.assertTrue((out / name).exists(), name)
    with self.assertRaises(_common.WorkdirNotEmptyError):
      long_context.run(lc, out)


if __name__ == "__main__":
  absltest.main()
