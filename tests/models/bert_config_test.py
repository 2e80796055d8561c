"""Tests for BertConfig (validation, Hugging Face config.json)."""

from absl.testing import absltest
from absl.testing import parameterized

from jaxtopk import models


class BertConfigTest(parameterized.TestCase):
  def test_package_config_is_minilm(self):
    cfg = models.BertConfig.from_json_file(
      models.minilm_model_dir() / "config.json"
    )
    self.assertEqual(cfg, models.BertConfig())
    self.assertEqual(cfg.head_dim, 32)

  @parameterized.named_parameters(
    ("heads_do_not_divide", dict(hidden_size=10, num_heads=3), "hidden_size"),
    ("bad_activation", dict(hidden_act="swish"), "hidden_act"),
    ("zero_layers", dict(num_layers=0), "num_layers"),
    ("float_width", dict(hidden_size=15.0, num_heads=3), "hidden_size"),
    ("bad_eps", dict(layer_norm_eps=0.0), "layer_norm_eps"),
  )
  def test_bad_config_raises(self, kwargs, name):
    with self.assertRaisesRegex(ValueError, name):
      models.BertConfig(**kwargs)

  def test_non_bert_hf_config_raises(self):
    with self.assertRaisesRegex(ValueError, "model_type"):
      models.BertConfig.from_hf_dict({"model_type": "gpt2"})


if __name__ == "__main__":
  absltest.main()
