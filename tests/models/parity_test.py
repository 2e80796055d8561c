"""Parity of jaxtopk.models with Hugging Face transformers (PyTorch, CPU).

Tiny random LlamaForCausalLM and Qwen3ForCausalLM are saved with
``save_pretrained`` (sharded and not, tied and untied embeddings, grouped
queries, biases), loaded with ``jaxtopk.models.load_pretrained``, and must
give the same logits (1e-4 relative) and the same greedy generations. Norm
gains, biases and rope settings are drawn away from their defaults so that
a loader skipping any of them fails: the llama3 rope scaling is set so the
head's frequencies fall in all three of its regimes (kept, interpolated,
divided). The reverse direction, ``save_pretrained`` read by transformers,
is checked too.

Needs the ``parity`` extra (``pip install -e .[parity]``: torch==2.13.0 CPU
and transformers); skipped only when those are not importable.
"""

import json
import tempfile

import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx

from jaxtopk import models

torch = pytest.importorskip(
  "torch", reason="parity tests need torch (pip install -e .[parity])"
)
transformers = pytest.importorskip(
  "transformers",
  reason="parity tests need transformers (pip install -e .[parity])",
)

VOCAB, BATCH, PROMPT, NEW = 37, 3, 13, 7
COMMON = dict(
  vocab_size=VOCAB,
  hidden_size=24,
  intermediate_size=40,
  num_hidden_layers=2,
  num_attention_heads=6,
  num_key_value_heads=2,
  head_dim=8,
  max_position_embeddings=64,
  rms_norm_eps=1e-5,
  initializer_range=0.3,  # logits far apart: greedy steps are not ties
  bos_token_id=None,
  eos_token_id=None,
)
# head_dim 8, theta 50: wavelengths 6.3, 16.8, 44.4, 118 positions; with
# original context 32, low 1 and high 4, they are kept (< 8), interpolated
# (8..32) and divided by the factor (> 32).
LLAMA3 = dict(
  rope_type="llama3",
  factor=4.0,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
  original_max_position_embeddings=32,
)
CASES = (
  dict(
    testcase_name="llama_tied_llama3_rope_sharded",
    arch="llama",
    kwargs=dict(
      rope_theta=50.0,
      rope_scaling=LLAMA3,
      tie_word_embeddings=True,
      attention_bias=True,
      mlp_bias=True,
    ),
    shard=True,
  ),
  dict(
    testcase_name="qwen3_untied",
    arch="qwen3",
    kwargs=dict(rope_theta=300.0, tie_word_embeddings=False),
    shard=False,
  ),
)


def _hf_model(arch, kwargs, seed=0):
  torch.manual_seed(seed)
  if arch == "llama":
    model = transformers.LlamaForCausalLM(
      transformers.LlamaConfig(**COMMON, **kwargs)
    )
  else:
    model = transformers.Qwen3ForCausalLM(
      transformers.Qwen3Config(**COMMON, **kwargs)
    )
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:  # gains away from 1
        p.copy_(1 + 0.3 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.2 * torch.randn_like(p))
  return model.eval()


def _prompts(seed=1):
  gen = torch.Generator().manual_seed(seed)
  return torch.randint(0, VOCAB, (BATCH, PROMPT), generator=gen)


def _hf_greedy(model, ids):
  out = model.generate(
    ids,
    attention_mask=torch.ones_like(ids),
    max_new_tokens=NEW,
    do_sample=False,
    pad_token_id=VOCAB,  # no real token: nothing is masked as padding
  )
  with torch.no_grad():
    logits = model(out).logits[:, PROMPT - 1 : -1].numpy()
  top2 = np.sort(logits, -1)[..., -2:]
  return out.numpy(), float(np.min(top2[..., 1] - top2[..., 0]))


def _rel_err(got, want):
  return float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))


class ParityTest(parameterized.TestCase):
  def _tmp(self):
    return self.enter_context(tempfile.TemporaryDirectory())

  @parameterized.named_parameters(*CASES)
  def test_logits_and_greedy_generation(self, arch, kwargs, shard):
    hf = _hf_model(arch, kwargs)
    path = self._tmp()
    hf.save_pretrained(path, max_shard_size="4KB" if shard else "1GB")
    saved = json.load(open(f"{path}/config.json"))
    self.assertIn("rope_parameters", saved)  # the transformers 5 form
    ids = _prompts()
    with torch.no_grad():
      want = hf(ids).logits.numpy()
    model, config = models.load_pretrained(path)
    self.assertEqual(config.decoder.qk_norm, arch == "qwen3")
    self.assertEqual(config.decoder.num_kv_heads, 2)
    got, certs = model(jnp.asarray(ids.numpy()))
    self.assertLess(_rel_err(got, want), 1e-4)
    self.assertLen(certs, 2)
    tokens_hf, gap = _hf_greedy(hf, ids)
    self.assertGreater(gap, 1e-3)  # no near tie: the comparison is exact
    tokens, certs = models.generate(
      model, jnp.asarray(ids.numpy()), max_new_tokens=NEW
    )
    np.testing.assert_array_equal(tokens, tokens_hf)
    self.assertEqual(certs[0].tv_bound.shape, (BATCH, PROMPT + NEW - 1, 6))

  def test_published_config_form(self):
    # Published checkpoints write rope_theta and rope_scaling ("type" in
    # older ones); the loader must read them as transformers does.
    hf = _hf_model("llama", dict(rope_theta=50.0, rope_scaling=LLAMA3))
    path = self._tmp()
    hf.save_pretrained(path)
    raw = json.load(open(f"{path}/config.json"))
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    raw["rope_scaling"] = params
    with open(f"{path}/config.json", "w") as f:
      json.dump(raw, f)
    ids = _prompts(2)
    with torch.no_grad():
      want = hf(ids).logits.numpy()
    model, config = models.load_pretrained(path)
    self.assertEqual(config.decoder.rope_scaling.rope_type, "llama3")
    got, _ = model(jnp.asarray(ids.numpy()))
    self.assertLess(_rel_err(got, want), 1e-4)

  @parameterized.named_parameters(("llama", False), ("qwen3", True))
  def test_transformers_reads_save_pretrained(self, qk_norm):
    config = models.DecoderConfig(
      vocab_size=VOCAB,
      num_layers=2,
      num_heads=6,
      num_kv_heads=3,
      model_dim=18,
      head_dim=4,
      mlp_dim=11,
      rope_theta=70.0,
      rope_scaling=models.RopeScaling("linear", 2.5),
      qk_norm=qk_norm,
      tie_embeddings=not qk_norm,
    )
    model = models.TopKDecoder(config, rngs=nnx.Rngs(3))
    with tempfile.TemporaryDirectory() as path:
      models.save_pretrained(model, path)
      hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
      ids = _prompts(3)
      with torch.no_grad():
        want = hf(ids).logits.numpy()
    got, _ = model(jnp.asarray(ids.numpy()))
    self.assertLess(_rel_err(got, want), 1e-4)


if __name__ == "__main__":
  absltest.main()
