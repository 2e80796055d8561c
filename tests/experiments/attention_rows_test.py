"""Tests for minilm_attention_rows and minilm_qk_weights (real MiniLM rows)."""

import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from experiments import _attention_rows
from jaxtopk import models

_TEXTS = (
  "Sparse attention keeps only the keys that matter.",
  "Short one.",
  "The licence texts are long English prose that every Debian system ships.",
)
_MAX_LEN = 13


def _softmax_rows(logits, key_mask):
  """float64 softmax over the real keys; padded keys get probability 0."""
  x = np.where(key_mask, logits.astype(np.float64), -np.inf)
  p = np.exp(x - x.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


class MiniLMAttentionRowsTest(parameterized.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model, cls.tokenizer = models.load_minilm()
    cls.rows = _attention_rows.minilm_attention_rows(
      _TEXTS,
      _MAX_LEN,
      model=cls.model,
      tokenizer=cls.tokenizer,
      pad_to_max_len=True,
      batch_size=2,
    )

  def test_shapes_and_mask(self):
    r = self.rows
    layers, heads, dh, hidden = 6, 12, 32, 384
    b, s = len(_TEXTS), _MAX_LEN
    self.assertEqual(r["logits"].shape, (layers, b, heads, s, s))
    self.assertEqual(r["logits"].dtype, np.float32)
    for name in ("queries", "keys", "values", "outputs"):
      self.assertEqual(r[name].shape, (layers, b, heads, s, dh), msg=name)
    self.assertEqual(r["inputs"].shape, (layers, b, s, hidden))
    self.assertEqual(r["w_q"].shape, (layers, heads, hidden, dh))
    self.assertEqual(r["b_k"].shape, (layers, heads, dh))
    np.testing.assert_array_equal(r["layer_ids"], np.arange(layers))
    np.testing.assert_array_equal(r["head_ids"], np.arange(heads))
    np.testing.assert_array_equal(r["key_mask"].sum(-1), r["lengths"])
    # Text 1 is short (padded), text 2 is truncated at max_len.
    self.assertEqual(r["lengths"].tolist()[1:], [5, _MAX_LEN])
    self.assertEqual(r["input_ids"][2, -1], 102)  # [SEP] after truncation
    self.assertTrue(np.all(r["input_ids"][~r["key_mask"]] == 0))

  def test_logits_recomputed_from_inputs_and_weights(self):
    # THEORY 7.4 uses W_Q, W_K: they must reproduce the logits exactly.
    r = self.rows
    x = r["inputs"].astype(np.float64)  # [l, b, s, d]
    q = np.einsum("lbsd,lhde->lbhse", x, r["w_q"]) + r["b_q"][:, None, :, None]
    k = np.einsum("lbsd,lhde->lbhse", x, r["w_k"]) + r["b_k"][:, None, :, None]
    # float32 sums of 384 products, |q| up to ~14: a few 1e-6 absolute.
    np.testing.assert_allclose(q, r["queries"], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(k, r["keys"], atol=2e-5, rtol=1e-5)
    logits = np.einsum("lbhqe,lbhke->lbhqk", q, k) * r["scale"]
    # Logits up to ~75 from float32 q and k: about 1e-5 absolute.
    np.testing.assert_allclose(logits, r["logits"], atol=1e-4, rtol=1e-5)

  def test_outputs_are_softmax_over_real_keys_times_values(self):
    r = self.rows
    p = _softmax_rows(r["logits"], r["key_mask"][None, :, None, None, :])
    out = np.einsum("lbhqk,lbhkd->lbhqd", p, r["values"])
    np.testing.assert_allclose(out, r["outputs"], atol=1e-5, rtol=1e-4)

  def test_padding_and_batching_do_not_change_rows(self):
    alone = _attention_rows.minilm_attention_rows(
      _TEXTS[1:2], _MAX_LEN, model=self.model, tokenizer=self.tokenizer
    )
    n = int(self.rows["lengths"][1])
    self.assertEqual(alone["logits"].shape[-1], n)  # padded to longest only
    np.testing.assert_allclose(
      alone["logits"][:, 0],
      self.rows["logits"][:, 1, :, :n, :n],
      atol=1e-4,
      rtol=1e-5,
    )

  @parameterized.named_parameters(
    ("batch_size", dict(batch_size=0), "batch_size=0"),
    ("model_only", dict(model="m"), "both model and tokenizer"),
    ("max_len", dict(max_len=1), "max_len=1"),
  )
  def test_bad_input_raises(self, kwargs, message):
    kwargs = {"texts": _TEXTS[:1], **kwargs}
    if kwargs.get("model") == "m":
      kwargs["model"] = self.model
    elif "max_len" in kwargs:
      kwargs.update(model=self.model, tokenizer=self.tokenizer)
    with self.assertRaisesRegex(ValueError, message):
      _attention_rows.minilm_attention_rows(**kwargs)


if __name__ == "__main__":
  absltest.main()
