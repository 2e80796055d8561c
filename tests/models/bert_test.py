"""Tests for the BERT/MiniLM encoder, its loader, tokenizer and pooling.

Two halves: a small random BERT (every dimension a different size) checks the
mechanics (padding, logits vs attention, pluggable attention, errors), and
the real all-MiniLM-L6-v2 weights are checked against outputs of the original
PyTorch model stored in ``shared/fixtures/minilm_reference.json``.
"""

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx

from jaxtopk import models
from tests import rand
from tests.tolerances import tol

_REPO = pathlib.Path(__file__).resolve().parents[2]


def _fixture_path() -> pathlib.Path | None:
  """``shared/fixtures/minilm_reference.json`` beside the checkout.

  CI has ``shared/`` beside the clone (``X/../shared``); a git worktree under
  ``wt/`` has it one level further up. ``JAXTOPK_SHARED`` overrides both.
  """
  candidates = [_REPO.parent / "shared", _REPO.parent.parent / "shared"]
  if "JAXTOPK_SHARED" in os.environ:
    candidates.insert(0, pathlib.Path(os.environ["JAXTOPK_SHARED"]))
  for shared in candidates:
    path = shared / "fixtures" / "minilm_reference.json"
    if path.is_file():
      return path
  return None


# Small config: vocab 13, hidden 15 = 3 heads x 5, ffn 11, 2 layers, 17
# positions; batch 2 and seq 7 in the tests.
_SMALL = models.BertConfig(
  vocab_size=13,
  hidden_size=15,
  num_layers=2,
  num_heads=3,
  intermediate_size=11,
  max_position_embeddings=17,
)
_BATCH, _SEQ = 2, 7


# Jitted entry points: on CPU one compile per shape costs about a third of
# op-by-op eager dispatch for the 6-layer model.
_embed = nnx.jit(models.sentence_embedding)
_forward = nnx.jit(lambda model, *args: model(*args))
_forward_trace = nnx.jit(lambda model, *args: model(*args, return_logits=True))


def _small_model(**kw):
  return models.MiniLM(_SMALL, rngs=nnx.Rngs(0), **kw)


def _small_inputs():
  key = jax.random.key(0)
  ids = rand.randint(key, (_BATCH, _SEQ), 1, _SMALL.vocab_size)
  lengths = jnp.array([_SEQ, 4])
  mask = jnp.arange(_SEQ)[None] < lengths[:, None]  # [b, s]
  ids = jnp.where(mask, ids, 0)
  types = (jnp.arange(_SEQ)[None] >= 3).astype(jnp.int32) * mask
  return ids, mask.astype(jnp.int32), types


def _dense_attention(query, key, value, bias=None, mask=None, **kwargs):
  """A hand-written softmax attention with nnx.dot_product_attention's API."""
  del bias, kwargs
  logits = jnp.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(query.shape[-1])
  logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), value)


class SmallBertTest(parameterized.TestCase):
  def test_shape_dtype_and_jit(self):
    model = _small_model()
    ids, mask, types = _small_inputs()
    hidden = model(ids, mask, types)
    self.assertEqual(hidden.shape, (_BATCH, _SEQ, _SMALL.hidden_size))
    self.assertEqual(hidden.dtype, jnp.float32)
    jitted = nnx.jit(lambda m, *a: m(*a))(model, ids, mask, types)
    np.testing.assert_allclose(jitted, hidden, **tol(jnp.float32))

  def test_padding_does_not_change_real_tokens(self):
    model = _small_model()
    ids, mask, types = _small_inputs()
    hidden = model(ids, mask, types)
    alone = model(ids[1:, :4], mask[1:, :4], types[1:, :4])  # row 1 unpadded
    np.testing.assert_allclose(hidden[1, :4], alone[0], **tol(jnp.float32))
    # Changing a padded id changes nothing on the real tokens.
    other = model(ids.at[1, 5].set(7), mask, types)
    np.testing.assert_allclose(other[1, :4], hidden[1, :4], **tol(jnp.float32))

  def test_trace_logits_agree_with_attention_outputs(self):
    model = _small_model()
    ids, mask, types = _small_inputs()
    hidden, trace = model(ids, mask, types, return_logits=True)
    np.testing.assert_array_equal(trace.key_mask, mask != 0)
    np.testing.assert_allclose(
      hidden, model(ids, mask, types), **tol(jnp.float32)
    )
    for name in ("logits", "queries", "keys", "values", "outputs", "inputs"):
      self.assertLen(getattr(trace, name), _SMALL.num_layers, msg=name)
    head_dim = _SMALL.head_dim
    for layer in range(_SMALL.num_layers):
      logits = trace.logits[layer]
      self.assertEqual(logits.shape, (_BATCH, _SMALL.num_heads, _SEQ, _SEQ))
      self.assertEqual(logits.dtype, jnp.float32)
      self.assertEqual(
        trace.values[layer].shape, (_BATCH, _SMALL.num_heads, _SEQ, head_dim)
      )
      expect = jnp.einsum(
        "bhqd,bhkd->bhqk", trace.queries[layer], trace.keys[layer]
      ) / np.sqrt(head_dim)
      np.testing.assert_allclose(logits, expect, **tol(jnp.float32))
      # softmax over the real keys of the logits, times the values, is what
      # the attention function returned.
      probs = jax.nn.softmax(
        logits, axis=-1, where=trace.key_mask[:, None, None, :]
      )
      probs = jnp.where(trace.key_mask[:, None, None, :], probs, 0.0)
      out = jnp.einsum("bhqk,bhkd->bhqd", probs, trace.values[layer])
      np.testing.assert_allclose(out, trace.outputs[layer], **tol(jnp.float32))

  def test_attention_fn_is_pluggable(self):
    ids, mask, types = _small_inputs()
    calls = []

    def recording(query, key, value, **kwargs):
      self.assertIsNone(kwargs["module"])  # sow_weights=False
      self.assertFalse(kwargs["is_causal"])
      calls.append((query.shape, kwargs["mask"].shape, kwargs["dtype"]))
      return _dense_attention(query, key, value, **kwargs)

    dense = _forward(_small_model(), ids, mask, types)
    custom = _forward(_small_model(attention_fn=recording), ids, mask, types)
    np.testing.assert_allclose(custom, dense, **tol(jnp.float32))
    self.assertEqual(
      calls,
      [
        (
          (_BATCH, _SEQ, _SMALL.num_heads, _SMALL.head_dim),
          (_BATCH, 1, 1, _SEQ),
          None,
        )
      ]
      * _SMALL.num_layers,
    )
    # A different attention really changes the output (the hook is used).
    uniform = lambda q, k, v, **kw: jnp.broadcast_to(
      v.mean(axis=1, keepdims=True), q.shape[:3] + v.shape[-1:]
    )
    changed = _forward(_small_model(attention_fn=uniform), ids, mask, types)
    self.assertGreater(float(jnp.max(jnp.abs(changed - dense))), 1e-3)

  def test_sow_weights_passes_the_layer_as_module(self):
    model = _small_model()
    ids, mask, types = _small_inputs()
    model(ids, mask, types)
    self.assertEmpty(jax.tree.leaves(nnx.state(model, nnx.Intermediate)))
    forward = nnx.capture(
      lambda m: m(ids, mask, types, return_logits=True, sow_weights=True),
      nnx.Intermediate,
    )
    (_, trace), sown = forward(model)
    for layer in range(_SMALL.num_layers):
      sown_layer = sown["layers"][layer]["attention"]
      (weights,) = sown_layer["attention_weights"].get_value()
      key_mask = trace.key_mask[:, None, None, :]  # [b, 1, 1, s]
      probs = jax.nn.softmax(trace.logits[layer], axis=-1, where=key_mask)
      np.testing.assert_allclose(
        weights, jnp.where(key_mask, probs, 0.0), **tol(jnp.float32)
      )

  def test_bfloat16_compute(self):
    ids, mask, types = _small_inputs()
    del types  # token types are covered elsewhere; keep one jit signature
    ref = _forward(_small_model(), ids, mask)
    half, trace = _forward_trace(_small_model(dtype=jnp.bfloat16), ids, mask)
    self.assertEqual(half.dtype, jnp.bfloat16)
    self.assertEqual(trace.logits[0].dtype, jnp.float32)
    # bf16 through 2 layers with LayerNorms: looser than one bf16 op.
    np.testing.assert_allclose(
      np.asarray(half, np.float32), ref, atol=0.1, rtol=0.1
    )

  @parameterized.named_parameters(
    ("one_dim_ids", dict(input_ids=np.arange(5)), "input_ids.shape"),
    ("float_ids", dict(input_ids=np.ones((2, 5))), "input_ids.dtype"),
    (
      "mask_shape",
      dict(input_ids=np.ones((2, 5), int), attention_mask=np.ones((2, 3))),
      "attention_mask.shape",
    ),
    (
      "types_shape",
      dict(input_ids=np.ones((2, 5), int), token_type_ids=np.ones((5,), int)),
      "token_type_ids.shape",
    ),
    ("too_long", dict(input_ids=np.ones((2, 18), int)), "sequence length 18"),
    ("empty", dict(input_ids=np.ones((2, 0), int)), "sequence length 0"),
    ("id_too_big", dict(input_ids=np.full((2, 5), 13)), "input_ids must lie"),
    ("negative_id", dict(input_ids=-np.ones((2, 5), int)), "min -1"),
    (
      "type_too_big",
      dict(input_ids=np.ones((2, 5), int), token_type_ids=np.full((2, 5), 2)),
      r"token_type_ids must lie in \[0, 2\)",
    ),
  )
  def test_bad_input_raises(self, kwargs, message):
    with self.assertRaisesRegex(ValueError, message):
      _small_model()(**kwargs)


class PoolingTest(parameterized.TestCase):
  def test_mean_pool_ignores_padding(self):
    hidden = rand.normal(0, (3, 5, 7))
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    pooled = np.asarray(models.mean_pool(hidden, mask))
    h = np.asarray(hidden)
    np.testing.assert_allclose(pooled[0], h[0].mean(0), **tol(jnp.float32))
    np.testing.assert_allclose(pooled[1], h[1, :2].mean(0), **tol(jnp.float32))
    np.testing.assert_array_equal(pooled[2], np.zeros(7))

  def test_l2_normalize(self):
    x = rand.normal(0, (3, 5))
    y = models.l2_normalize(x)
    np.testing.assert_allclose(
      jnp.linalg.norm(y, axis=-1), np.ones(3), **tol(jnp.float32)
    )
    np.testing.assert_array_equal(
      models.l2_normalize(jnp.zeros(5)), np.zeros(5)
    )

  def test_mean_pool_shape_mismatch_raises(self):
    with self.assertRaisesRegex(ValueError, "attention_mask.shape"):
      models.mean_pool(jnp.zeros((3, 5, 7)), jnp.ones((3, 7)))


class MiniLMRealWeightsTest(parameterized.TestCase):
  """The real all-MiniLM-L6-v2 against the original PyTorch model's outputs."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model, cls.tokenizer = models.load_minilm()
    path = _fixture_path()
    cls.fixture = None
    if path is not None:
      cls.fixture = json.loads(path.read_text())["sentences"]

  def _need_fixture(self):
    if self.fixture is None:
      self.skipTest(
        "shared/fixtures/minilm_reference.json not found beside the checkout"
      )
    return self.fixture

  def test_token_ids_match_reference(self):
    sentences = self._need_fixture()
    for s in sentences:
      batch = models.minilm_tokenize(self.tokenizer, [s["text"]])
      self.assertEqual(batch["input_ids"][0].tolist(), s["input_ids"])
      self.assertTrue(np.all(batch["attention_mask"] == 1))

  def test_embeddings_and_attention_match_reference(self):
    sentences = self._need_fixture()
    texts = [s["text"] for s in sentences]
    batch = models.minilm_tokenize(self.tokenizer, texts)  # padded to longest
    lengths = batch["attention_mask"].sum(-1)
    self.assertLess(lengths.min(), batch["input_ids"].shape[1])  # has padding
    run = nnx.jit(
      lambda m, b: (
        models.l2_normalize(models.mean_pool(m(**b), b["attention_mask"])),
        m(**b, return_logits=True)[1].logits,
      )
    )
    emb, logits = run(self.model, batch)
    emb = np.asarray(emb, np.float64)
    for i, s in enumerate(sentences):
      ref = np.asarray(s["embedding"])
      cosine = emb[i] @ ref / (np.linalg.norm(emb[i]) * np.linalg.norm(ref))
      self.assertGreaterEqual(cosine, 0.9999, msg=s["text"])
      n = int(lengths[i])
      self.assertEqual(n, len(s["input_ids"]))
      for layer, head in ((0, 0), (5, 11)):
        row = np.asarray(logits[layer][i, head, :n, :n], np.float64)
        probs = np.exp(row - row.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ref_map = np.asarray(s[f"attention_layer{layer}_head{head}"])
        np.testing.assert_allclose(probs, ref_map, atol=1e-5, rtol=1e-4)

  @pytest.mark.slow
  def test_bfloat16_embeddings_close_to_reference(self):
    sentences = self._need_fixture()
    model, _ = models.load_minilm(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    batch = models.minilm_tokenize(
      self.tokenizer, [s["text"] for s in sentences]
    )
    emb = _embed(model, **batch)
    self.assertEqual(emb.dtype, jnp.bfloat16)
    emb = np.asarray(emb, np.float64)
    ref = np.asarray([s["embedding"] for s in sentences])
    cosine = np.sum(emb * ref, -1) / (
      np.linalg.norm(emb, axis=-1) * np.linalg.norm(ref, axis=-1)
    )
    # bf16 weights and compute (8-bit mantissa): measured 0.99994; float32
    # is held to 0.9999 above, bf16 to 0.999.
    self.assertTrue(np.all(cosine >= 0.999), msg=f"{cosine=}")

  def test_sentence_embedding_unit_norm_and_padding_invariant(self):
    texts = ["Top-k attention.", "A rather longer sentence about keys here."]
    batch = models.minilm_tokenize(self.tokenizer, texts)
    emb = _embed(self.model, **batch)
    self.assertEqual(emb.shape, (2, 384))
    np.testing.assert_allclose(
      jnp.linalg.norm(emb, axis=-1), np.ones(2), **tol(jnp.float32)
    )
    alone = _embed(
      self.model, **models.minilm_tokenize(self.tokenizer, texts[:1])
    )
    # 6 layers of float32 with different padding: a few ulps of the norm.
    np.testing.assert_allclose(emb[0], alone[0], atol=2e-6, rtol=1e-5)

  def test_tokenizer_truncates_and_pads(self):
    long_text = " ".join(["attention"] * 600)
    batch = models.minilm_tokenize(self.tokenizer, [long_text, "short"])
    self.assertEqual(batch["input_ids"].shape, (2, 256))
    self.assertEqual(batch["input_ids"][0, 0], 101)  # [CLS]
    self.assertEqual(batch["input_ids"][0, -1], 102)  # [SEP] kept
    self.assertEqual(batch["attention_mask"][1].sum(), 3)
    fixed = models.minilm_tokenize(
      self.tokenizer, ["short"], max_len=11, pad_to_max_len=True
    )
    self.assertEqual(fixed["input_ids"].shape, (1, 11))
    self.assertEqual(fixed["input_ids"].dtype, np.int32)
    # The tokenizer load_minilm returns is configured as sentence-transformers.
    enc = self.tokenizer.encode_batch([long_text, "short"])
    self.assertEqual([len(e.ids) for e in enc], [256, 256])

  @parameterized.named_parameters(
    ("empty", dict(texts=[]), "texts"),
    ("one_string", dict(texts="abc"), "sequence of strings"),
    ("not_str", dict(texts=["a", 3]), "every text"),
    ("max_len", dict(texts=["a"], max_len=513), "max_len=513"),
  )
  def test_tokenize_bad_input_raises(self, kwargs, message):
    with self.assertRaisesRegex(ValueError, message):
      models.minilm_tokenize(self.tokenizer, **kwargs)

  def test_strict_weight_loading(self):
    from safetensors.numpy import load_file

    weights = load_file(str(models.minilm_model_dir() / "model.safetensors"))
    abstract = lambda: nnx.eval_shape(lambda: models.MiniLM(rngs=nnx.Rngs(0)))
    missing = dict(weights)
    del missing["encoder.layer.3.attention.self.key.bias"]
    with self.assertRaisesRegex(ValueError, "layer.3.attention.self.key.bias"):
      models.load_bert_weights(abstract(), missing)
    bad = dict(weights)
    bad["encoder.layer.2.output.dense.weight"] = np.zeros((3, 5), np.float32)
    with self.assertRaisesRegex(ValueError, "layer.2.output.dense.weight"):
      models.load_bert_weights(abstract(), bad)


if __name__ == "__main__":
  absltest.main()
