"""Tests for jaxtopk.models.load_pretrained / save_pretrained (no torch).

transformers parity lives in parity_test.py; here: the config.json forms,
the safetensors reader and writer, the refusals of what the architecture
cannot honour, and the tokenizer.
"""

import json
import os
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest
from flax import nnx

from jaxtopk import models
from jaxtopk.models import _safetensors

CONFIG = models.DecoderConfig(
  vocab_size=13,
  num_layers=2,
  num_heads=3,
  num_kv_heads=1,
  model_dim=10,
  head_dim=4,
  mlp_dim=7,
  rope_theta=90.0,
  rope_scaling=models.RopeScaling(
    "llama3", 3.0, 1.0, 2.0, original_max_position_embeddings=20
  ),
  qk_norm=True,
  attention_bias=True,
)


def _saved(tmp, config=CONFIG, **kw):
  model = models.TopKDecoder(config, rngs=nnx.Rngs(0))
  models.save_pretrained(model, tmp, **kw)
  return model


def _edit_config(tmp, **fields):
  path = pathlib.Path(tmp, "config.json")
  hf = json.loads(path.read_text())
  hf.update(fields)
  path.write_text(json.dumps(hf))


class PretrainedTest(absltest.TestCase):
  def _tmp(self):
    return self.enter_context(tempfile.TemporaryDirectory())

  def test_round_trip(self):
    tmp = self._tmp()
    model = _saved(tmp, bos_token_id=1, eos_token_id=[2, 3])
    loaded, config = models.load_pretrained(tmp)
    self.assertEqual(config.decoder, CONFIG)
    self.assertEqual((config.bos_token_id, config.eos_token_id), (1, [2, 3]))
    self.assertIsNone(config.tokenizer)
    jax.tree.map(
      np.testing.assert_array_equal,
      nnx.to_pure_dict(nnx.state(loaded)),
      nnx.to_pure_dict(nnx.state(model)),
    )

  def test_bfloat16(self):
    tmp = self._tmp()
    model = _saved(tmp, dtype=ml_dtypes.bfloat16)
    raw = _safetensors.read_safetensors(os.path.join(tmp, "model.safetensors"))
    self.assertEqual(raw["model.norm.weight"].dtype, ml_dtypes.bfloat16)
    loaded, _ = models.load_pretrained(tmp, dtype=jnp.bfloat16)
    self.assertEqual(loaded.embed.embedding[...].dtype, jnp.bfloat16)
    tokens = jnp.arange(7)[None] % 13
    got, _ = loaded(tokens)
    want, _ = model(tokens)
    self.assertEqual(got.dtype, jnp.float32)
    np.testing.assert_allclose(got, want, atol=0.1, rtol=0.1)  # bf16 weights

  def test_safetensors_format(self):
    tmp = self._tmp()
    path = os.path.join(tmp, "x.safetensors")
    tensors = {
      "b": np.arange(6, dtype=np.int32).reshape(2, 3),
      "a": np.linspace(-1, 1, 5).astype(ml_dtypes.bfloat16),
      "empty": np.zeros((0, 3), np.float32),
    }
    _safetensors.write_safetensors(path, tensors, {"format": "pt"})
    back = _safetensors.read_safetensors(path)
    self.assertEqual(sorted(back), ["a", "b", "empty"])
    for name, want in tensors.items():
      self.assertEqual(back[name].dtype, want.dtype)
      np.testing.assert_array_equal(back[name], want)
    with open(path, "rb") as f:
      n = int.from_bytes(f.read(8), "little")
      header = json.loads(f.read(n))
    self.assertEqual(header["__metadata__"], {"format": "pt"})
    self.assertEqual(header["a"]["dtype"], "BF16")
    with self.assertRaisesRegex(ValueError, "complex64"):
      _safetensors.write_safetensors(path, {"c": np.zeros(2, np.complex64)})

  def test_sharded_index(self):
    tmp = self._tmp()
    model = _saved(tmp)
    single = os.path.join(tmp, "model.safetensors")
    tensors = _safetensors.read_safetensors(single)
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
      file = f"model-0000{i + 1}-of-00002.safetensors"
      _safetensors.write_safetensors(
        os.path.join(tmp, file), {n: np.array(tensors[n]) for n in part}
      )
      weight_map.update({n: file for n in part})
    os.remove(single)
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {}, "weight_map": weight_map}, f)
    loaded, _ = models.load_pretrained(tmp)
    jax.tree.map(
      np.testing.assert_array_equal,
      nnx.to_pure_dict(nnx.state(loaded)),
      nnx.to_pure_dict(nnx.state(model)),
    )

  def test_config_forms(self):
    hf = CONFIG.to_hf()
    self.assertEqual(hf["model_type"], "qwen3")
    self.assertEqual(models.DecoderConfig.from_hf(hf), CONFIG)
    # transformers 5: rope_parameters holds theta and the scaling.
    params = dict(hf.pop("rope_scaling"), rope_theta=hf.pop("rope_theta"))
    self.assertEqual(
      models.DecoderConfig.from_hf(dict(hf, rope_parameters=params)), CONFIG
    )
    # llama3 without original_max_position_embeddings: the context.
    params.pop("original_max_position_embeddings")
    got = models.DecoderConfig.from_hf(
      dict(hf, rope_parameters=params, max_position_embeddings=77)
    )
    self.assertEqual(got.rope_scaling.original_max_position_embeddings, 77)
    # head_dim absent: hidden_size // num_attention_heads.
    plain = dict(CONFIG.to_hf(), head_dim=None, hidden_size=12)
    self.assertEqual(models.DecoderConfig.from_hf(plain).head_dim, 4)

  def test_refusals_are_named(self):
    hf = CONFIG.to_hf()
    bad = [
      (dict(model_type="mistral"), "model_type='mistral'"),
      (dict(hidden_act="gelu"), "hidden_act='gelu'"),
      (dict(use_sliding_window=True), "use_sliding_window"),
      (dict(layer_types=["sliding_attention"] * 2), "layer_types"),
      (dict(rope_scaling={"rope_type": "yarn", "factor": 2}), "'yarn'"),
      (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
      (dict(rope_scaling={"rope_type": "llama3", "factor": 2}), "low_freq"),
    ]
    for fields, match in bad:
      with self.assertRaisesRegex(ValueError, match):
        models.DecoderConfig.from_hf(dict(hf, **fields))
    without = dict(hf)
    del without["intermediate_size"]
    with self.assertRaisesRegex(ValueError, "intermediate_size"):
      models.DecoderConfig.from_hf(without)

  def test_load_errors_name_the_tensor(self):
    tmp = self._tmp()
    _saved(tmp)
    path = os.path.join(tmp, "model.safetensors")
    raw = _safetensors.read_safetensors(path)
    tensors = {k: np.array(v) for k, v in raw.items()}
    extra = dict(tensors, **{"model.layers.0.self_attn.extra": np.zeros(2)})
    _safetensors.write_safetensors(path, extra)
    with self.assertRaisesRegex(ValueError, "self_attn.extra"):
      models.load_pretrained(tmp)
    missing = dict(tensors)
    del missing["model.layers.1.self_attn.k_norm.weight"]
    _safetensors.write_safetensors(path, missing)
    with self.assertRaisesRegex(ValueError, "layers.1.self_attn.k_norm"):
      models.load_pretrained(tmp)
    _safetensors.write_safetensors(path, tensors)
    _edit_config(tmp, intermediate_size=8)
    with self.assertRaisesRegex(ValueError, "mlp.gate_proj.weight"):
      models.load_pretrained(tmp)
    os.remove(path)
    with self.assertRaisesRegex(FileNotFoundError, "model.safetensors"):
      models.load_pretrained(tmp)
    with self.assertRaisesRegex(FileNotFoundError, "config.json"):
      models.load_pretrained(self._tmp())

  def test_tokenizer(self):
    import tokenizers

    tok = tokenizers.Tokenizer(
      tokenizers.models.WordLevel({"[UNK]": 0, "hello": 5, "world": 7}, "[UNK]")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tmp = self._tmp()
    _saved(tmp, tokenizer=tok)
    _, config = models.load_pretrained(tmp)
    np.testing.assert_array_equal(config.encode("hello world"), [5, 7])
    self.assertEqual(config.decode([7, 5]), "world hello")
    bare_dir = self._tmp()
    _saved(bare_dir)
    _, bare = models.load_pretrained(bare_dir)
    with self.assertRaisesRegex(ValueError, "tokenizer.json"):
      bare.encode("hello")


if __name__ == "__main__":
  absltest.main()
