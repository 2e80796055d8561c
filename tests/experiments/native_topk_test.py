"""Runs experiments/native_topk.py with its smoke config."""

import json
import os
import tempfile

import jax
import numpy as np
import pytest
from absl.testing import absltest
from flax import nnx

from experiments import _common
from experiments import native_topk
from experiments.configs import native_topk as native_topk_config
from jaxtopk import tasks


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


class NativeTopkSmokeTest(absltest.TestCase):
  def _tmp(self):
    return self.enter_context(tempfile.TemporaryDirectory())

  @pytest.mark.slow
  def test_smoke_run(self):
    config = native_topk_config.get_config("smoke")
    workdir = self._tmp()
    self.assertTrue(native_topk.run(config, workdir))
    rows = _rows(workdir)
    base = [r for r in rows if r["kind"] == "train" and r["phase"] == "base"]
    self.assertEqual(base[-1]["step"], config.train.base_steps)
    # Training lowers the loss.
    self.assertLess(base[-1]["loss"], base[0]["loss"] - 0.3)
    # Decoding with rho = 1 equals dense decoding, on every task and model.
    checks = [r for r in rows if r["kind"] == "check"]
    self.assertLen(checks, 2 * (3 + len(config.eval.needle_depths)))
    for r in checks:
      self.assertLessEqual(r["rho1_vs_dense_max_abs_diff"], 1e-5)
    evals = {
      (r["model"], r["sweep"], r["param"], r["task"]): r
      for r in rows
      if r["kind"] == "eval"
    }
    for (model, sweep, _, task), r in evals.items():
      if sweep == "dense":
        self.assertEqual(r["acc"], evals[(model, "ratio", 1.0, task)]["acc"])
        self.assertEqual(r["tv_bound_max"], 0.0)
      self.assertLessEqual(r["tv_bound_max"], 1.0)
    # Both fine-tunes were evaluated, each with its own weights.
    entropy = {
      m: [
        r["entropy_all"]
        for r in rows
        if r.get("model") == m and r["kind"] == "entropy"
      ]
      for m in ("dense", "topk")
    }
    self.assertNotEmpty(entropy["dense"])
    self.assertNotEqual(entropy["dense"], entropy["topk"])
    for name in ("fig_ratio.png", "fig_fidelity.png", "results.md"):
      self.assertTrue(os.path.exists(os.path.join(workdir, name)), name)
    # Rerunning a finished phase restores its last checkpoint and trains
    # nothing (run() does this for every phase before re-evaluating; the
    # evaluation itself is not repeated here to keep the test short).
    metrics = native_topk.Metrics(os.path.join(workdir, "metrics.jsonl"))
    for phase in native_topk.PHASES:
      _, done = native_topk.train_phase(
        config, workdir, phase, metrics, lambda: True
      )
      self.assertTrue(done, phase)
    again = [r for r in _rows(workdir) if r["kind"] == "train"]
    self.assertEqual(again, [r for r in rows if r["kind"] == "train"])

  @pytest.mark.slow
  def test_interrupted_training_resumes_exactly(self):
    config = native_topk_config.get_config("smoke")
    with config.unlocked():
      config.train.checkpoint_every = 100  # only the stop saves mid-run
      config.train.base_steps = 8  # stopped after 4, resumed to the end
    straight = self._tmp()
    resumed = self._tmp()
    metrics = native_topk.Metrics(os.path.join(straight, "metrics.jsonl"))
    want, done = native_topk.train_phase(
      config, straight, "base", metrics, lambda: False
    )
    self.assertTrue(done)
    calls = []

    def stop_after_four():
      calls.append(1)
      return len(calls) >= 4

    metrics = native_topk.Metrics(os.path.join(resumed, "metrics.jsonl"))
    _, done = native_topk.train_phase(
      config, resumed, "base", metrics, stop_after_four
    )
    self.assertFalse(done)
    self.assertEqual(
      native_topk._manager(resumed, "base").latest_step(), 4
    )  # the four finished steps were checkpointed
    got, done = native_topk.train_phase(
      config, resumed, "base", metrics, lambda: False
    )
    self.assertTrue(done)
    jax.tree.map(
      np.testing.assert_array_equal,
      nnx.to_pure_dict(nnx.state(got)),
      nnx.to_pure_dict(nnx.state(want)),
    )
    steps = [r["step"] for r in metrics.rows]
    self.assertEqual(steps, sorted(set(steps)))

  def test_curriculum(self):
    config = native_topk_config.get_config()
    lengths = [
      native_topk.train_seq_len(config, "base", step)
      for step in (0, 149, 150, 449, 450, config.train.base_steps - 1)
    ]
    self.assertEqual(lengths, [16, 16, 32, 128, 256, 256])
    self.assertEqual(native_topk.train_seq_len(config, "topk", 0), 256)

  def test_train_batch_mixes_all_tasks(self):
    config = native_topk_config.get_config()
    inputs, targets, weights = native_topk.train_batch(config, "base", 0)
    self.assertEqual(inputs.shape, (config.train.batch_size, 16))
    per_task = config.train.batch_size // len(native_topk.TASKS)
    # aggregate rows: "S kq -> sum", one answer column.
    aggregate = inputs[:, -2] == tasks.SUM
    self.assertEqual(int(aggregate.sum()), per_task)
    np.testing.assert_array_equal(weights[aggregate].sum(1), 1.0)
    self.assertTrue((targets[aggregate, -1] >= tasks.Vocab().value_start).all())
    # lookup rows score lookup_queries answers each.
    self.assertEqual(
      int(weights.sum()),
      per_task * (3 + min(config.train.lookup_queries, (16 - 1) // 4)),
    )

  def test_refuses_other_config(self):
    config = native_topk_config.get_config("smoke")
    workdir = self._tmp()
    native_topk._check_workdir(config, workdir)
    with config.unlocked():
      config.seed = 1
    with self.assertRaisesRegex(
      _common.WorkdirNotEmptyError, "different config"
    ):
      native_topk._check_workdir(config, workdir)


if __name__ == "__main__":
  absltest.main()
