"""The long-context binaries: training (smoke) and the RULER-style study.

train_long_context's smoke config trains a tiny model and writes it as a
Hugging Face directory; long_context's smoke config evaluates that
directory (dense, Ratio and Certified decoding); and the packaged model
(jaxtopk.models.long_context_lm_dir) is checked to retrieve.
"""

import json
import pathlib
import tempfile

import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest

from experiments import _common
from experiments import _long_context_data as data
from experiments import long_context
from experiments import train_long_context
from experiments.configs import long_context as long_context_config
from experiments.configs import train_long_context as train_config
from jaxtopk import models


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

  def test_packaged_model_retrieves(self):
    # The committed model finds a needle in real text (dense, 512 tokens).
    model, checkpoint = models.load_pretrained(models.long_context_lm_dir())
    vocab = long_context.task_vocab(checkpoint)
    self.assertEqual(checkpoint.decoder.vocab_size, vocab.size)
    text = data.text_tokens(data.EVAL_PART, vocab)
    batch = data.eval_task("niah_text", 0, 8, 512, vocab, text)
    logits, _ = model(jnp.asarray(batch.inputs))
    col = batch.first_answer
    hits = np.argmax(np.asarray(logits)[:, col], -1) == batch.targets[:, col]
    self.assertGreaterEqual(float(np.mean(hits)), 0.75)
    # Its tokenizer reads text as bytes and the task tokens by name.
    ids = checkpoint.encode("key <k3> is <v7>")
    self.assertEqual(ids[4], vocab.key_start + 3)
    self.assertEqual(checkpoint.decode(ids), "key <k3> is <v7>")


if __name__ == "__main__":
  absltest.main()
