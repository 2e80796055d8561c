"""Hugging Face checkpoints in and out: Llama 3.x and Qwen3, no torch.

:func:`load_pretrained` reads a Hugging Face-format directory (what
``save_pretrained`` of ``transformers`` writes and the Hub publishes):
``config.json`` (both its published form and transformers 5's, see
``DecoderConfig.from_hf``), the weights in ``model.safetensors`` or sharded
through ``model.safetensors.index.json``, and ``tokenizer.json`` (read with
the ``tokenizers`` package) when present. No torch and no network: tensors
are memory-mapped (``_safetensors.py``) and converted one at a time into an
abstract model (``nnx.eval_shape``), so a large checkpoint is never
initialised randomly first. :func:`save_pretrained` writes the same layout
back (transformers loads it).

Weight layout: transformers' ``nn.Linear`` stores ``[out, in]``; the
decoder's kernels are ``[in, ...]`` with heads split out (``[model_dim,
heads, head_dim]`` for q/k/v, ``[heads, head_dim, model_dim]`` for the
output). Every tensor is checked against the shape the config implies, and
a missing or unexpected tensor is an error naming it (rotary
``inv_freq`` buffers of old checkpoints excepted; a tied checkpoint's
``lm_head.weight``, if present, is the embedding and is not read).
"""

import dataclasses
import json
import logging
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtopk.models._decoder import TopKDecoder
from jaxtopk.models._decoder_config import DecoderConfig
from jaxtopk.models._safetensors import read_safetensors
from jaxtopk.models._safetensors import write_safetensors

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """What :func:`load_pretrained` read besides the weights.

  Attributes:
    decoder: the architecture (``DecoderConfig``).
    hf_config: the parsed ``config.json``.
    path: the checkpoint directory.
    tokenizer: a ``tokenizers.Tokenizer`` from ``tokenizer.json``, or None
      when the directory has none.
    bos_token_id: from config.json (None if unset).
    eos_token_id: from config.json: an int, a list of ints, or None.
  """

  decoder: DecoderConfig
  hf_config: dict = dataclasses.field(compare=False, repr=False)
  path: str = ""
  tokenizer: Any = dataclasses.field(default=None, compare=False, repr=False)
  bos_token_id: int | None = None
  eos_token_id: Any = None

  def encode(self, text: str) -> np.ndarray:
    """int32 token ids of ``text`` (no special tokens added).

    Raises:
      ValueError: the checkpoint has no tokenizer.
    """
    if self.tokenizer is None:
      raise ValueError(f"{self.path!r} has no tokenizer.json")
    ids = self.tokenizer.encode(text, add_special_tokens=False).ids
    return np.asarray(ids, np.int32)

  def decode(self, ids) -> str:
    """Text of token ids (special tokens kept).

    Raises:
      ValueError: the checkpoint has no tokenizer.
    """
    if self.tokenizer is None:
      raise ValueError(f"{self.path!r} has no tokenizer.json")
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    return self.tokenizer.decode(ids, skip_special_tokens=False)


def _hf_names(config: DecoderConfig) -> dict[str, tuple[tuple, str]]:
  """HF tensor name -> (decoder parameter path, conversion)."""
  names: dict[str, tuple[tuple, str]] = {
    "model.embed_tokens.weight": (("embed", "embedding"), "same"),
    "model.norm.weight": (("final_norm", "scale"), "same"),
  }
  if not config.tie_embeddings:
    names["lm_head.weight"] = (("lm_head", "kernel"), "t")
  for i in range(config.num_layers):
    hf, me = f"model.layers.{i}.", ("blocks", i)
    names[hf + "input_layernorm.weight"] = (me + ("attn_norm", "scale"), "same")
    names[hf + "post_attention_layernorm.weight"] = (
      me + ("mlp_norm", "scale"),
      "same",
    )
    for proj, mine in (("q", "query"), ("k", "key"), ("v", "value")):
      a = me + ("attn", mine)
      kernel = (a + ("kernel",), "heads_out")
      names[hf + f"self_attn.{proj}_proj.weight"] = kernel
      if config.attention_bias:
        names[hf + f"self_attn.{proj}_proj.bias"] = (a + ("bias",), "heads")
    a = me + ("attn", "out")
    names[hf + "self_attn.o_proj.weight"] = (a + ("kernel",), "heads_in")
    if config.attention_bias:
      names[hf + "self_attn.o_proj.bias"] = (a + ("bias",), "same")
    if config.qk_norm:
      for proj, mine in (("q", "query_norm"), ("k", "key_norm")):
        names[hf + f"self_attn.{proj}_norm.weight"] = (
          me + ("attn", mine, "scale"),
          "same",
        )
    for proj in ("gate", "up", "down"):
      m = me + ("mlp", proj)
      names[hf + f"mlp.{proj}_proj.weight"] = (m + ("kernel",), "t")
      if config.mlp_bias:
        names[hf + f"mlp.{proj}_proj.bias"] = (m + ("bias",), "same")
  return names


def _to_decoder(array: np.ndarray, how: str, shape: tuple) -> np.ndarray:
  """An HF tensor in the decoder's layout of ``shape``."""
  if how == "t":
    return array.T
  if how == "heads_out":  # [heads * d, in] -> [in, heads, d]
    return array.T.reshape(shape)
  if how == "heads_in":  # [out, heads * d] -> [heads, d, out]
    return array.T.reshape(shape)
  if how == "heads":  # [heads * d] -> [heads, d]
    return array.reshape(shape)
  return array


def _to_hf(array: np.ndarray, how: str) -> np.ndarray:
  """A decoder parameter in transformers' layout (inverse of _to_decoder)."""
  if how == "t":
    return array.T
  if how == "heads_out":  # [in, heads, d] -> [heads * d, in]
    return array.reshape(array.shape[0], -1).T
  if how == "heads_in":  # [heads, d, out] -> [out, heads * d]
    return array.reshape(-1, array.shape[-1]).T
  if how == "heads":
    return array.reshape(-1)
  return array


def _shard_files(path: pathlib.Path) -> list[pathlib.Path]:
  if (path / _INDEX).exists():
    index = json.loads((path / _INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    return [path / f for f in files]
  if (path / _SINGLE).exists():
    return [path / _SINGLE]
  found = sorted(p.name for p in path.iterdir())
  raise FileNotFoundError(
    f"{str(path)!r} has neither {_SINGLE} nor {_INDEX} (found: {found});"
    " only safetensors checkpoints are read"
  )


def _get(tree, keys):
  for k in keys:
    tree = tree[k]
  return tree


def _set(tree, keys, value):
  for k in keys[:-1]:
    tree = tree[k]
  tree[keys[-1]] = value


def load_pretrained(
  path: str | os.PathLike, *, dtype=jnp.float32
) -> tuple[TopKDecoder, CheckpointConfig]:
  """Loads a Llama 3.x or Qwen3 checkpoint from a Hugging Face directory.

  Args:
    path: directory with config.json, model.safetensors (or the shards of
      model.safetensors.index.json) and optionally tokenizer.json.
    dtype: dtype of the parameters and of the computation (logits are
      float32 either way).

  Returns:
    ``(model, config)``: a :class:`TopKDecoder` holding the weights and a
    :class:`CheckpointConfig` (architecture, raw config.json, tokenizer,
    special token ids).

  Raises:
    FileNotFoundError: no config.json or no safetensors weights.
    ValueError: an unsupported architecture field, or a missing,
      unexpected or mis-shaped tensor (named).

  Example:
    >>> import tempfile, jax.numpy as jnp, jaxtopk
    >>> from flax import nnx
    >>> from jaxtopk import models
    >>> tiny = models.TopKDecoder(
    ...     models.DecoderConfig(vocab_size=11), rngs=nnx.Rngs(0))
    >>> path = tempfile.mkdtemp()
    >>> models.save_pretrained(tiny, path)
    >>> model, config = models.load_pretrained(path)
    >>> config.decoder == tiny.config
    True
    >>> logits, certificates = model(
    ...     jnp.zeros((1, 5), jnp.int32), attention=jaxtopk.Certified(0.01))
    >>> logits.shape, len(certificates)
    ((1, 5, 11), 2)
  """
  path = pathlib.Path(path)
  if not (path / "config.json").exists():
    raise FileNotFoundError(f"{str(path)!r} has no config.json")
  hf = json.loads((path / "config.json").read_text())
  decoder = DecoderConfig.from_hf(hf)
  abstract = nnx.eval_shape(
    lambda: TopKDecoder(
      decoder, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)
    )
  )
  graphdef, state = nnx.split(abstract)
  pure = nnx.to_pure_dict(state)
  names = _hf_names(decoder)
  tensors: dict[str, np.ndarray] = {}
  for file in _shard_files(path):
    tensors.update(read_safetensors(file))
  if not any(k.startswith("model.") for k in tensors):  # a bare LlamaModel
    tensors = {
      (k if k == "lm_head.weight" else "model." + k): v
      for k, v in tensors.items()
    }
  ignored = {
    k
    for k in tensors
    if k.endswith("rotary_emb.inv_freq")
    or (decoder.tie_embeddings and k == "lm_head.weight")
  }
  missing = sorted(set(names) - set(tensors))
  unexpected = sorted(set(tensors) - set(names) - ignored)
  if missing or unexpected:
    raise ValueError(
      f"{str(path)!r} does not match its config.json: missing tensors"
      f" {missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected"
      f" tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
    )
  for name, (keys, how) in names.items():
    target = _get(pure, keys)
    array = _to_decoder(np.asarray(tensors[name]), how, target.shape)
    if array.shape != target.shape:
      raise ValueError(
        f"tensor {name!r} of shape {tensors[name].shape} does not give the"
        f" decoder's {target.shape} (config.json disagrees with the weights)"
      )
    _set(pure, keys, jnp.asarray(array, dtype))
  nnx.replace_by_pure_dict(state, pure)
  model = nnx.merge(graphdef, state)
  config = CheckpointConfig(
    decoder=decoder,
    hf_config=hf,
    path=str(path),
    tokenizer=_tokenizer(path),
    bos_token_id=hf.get("bos_token_id"),
    eos_token_id=hf.get("eos_token_id"),
  )
  return model, config


def _tokenizer(path: pathlib.Path):
  file = path / "tokenizer.json"
  if not file.exists():
    return None
  try:
    import tokenizers
  except ImportError:
    logging.warning(
      "%s: tokenizer.json not read (pip install tokenizers)", str(path)
    )
    return None
  return tokenizers.Tokenizer.from_file(str(file))


def save_pretrained(
  model: TopKDecoder,
  path: str | os.PathLike,
  *,
  tokenizer: Any = None,
  dtype=None,
  **hf_fields: Any,
) -> None:
  """Writes ``model`` as a Hugging Face directory :func:`load_pretrained` reads.

  config.json (``DecoderConfig.to_hf``, transformers' ``LlamaForCausalLM``
  or ``Qwen3ForCausalLM``), model.safetensors in transformers' names and
  layout, and tokenizer.json when a ``tokenizers.Tokenizer`` is given.

  Args:
    model: the decoder.
    path: directory (created).
    tokenizer: optional ``tokenizers.Tokenizer``.
    dtype: optional storage dtype of the weights (default: theirs).
    **hf_fields: extra config.json fields (e.g. ``bos_token_id``).
  """
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  config = model.config
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  tensors = {}
  for name, (keys, how) in _hf_names(config).items():
    array = np.asarray(jax.device_get(_get(pure, keys)))
    if dtype is not None:
      array = array.astype(dtype)
    tensors[name] = np.ascontiguousarray(_to_hf(array, how))
  write_safetensors(path / _SINGLE, tensors, metadata={"format": "pt"})
  dtype_name = str(next(iter(tensors.values())).dtype)
  hf = config.to_hf(dtype=dtype_name, **hf_fields)
  (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
  if tokenizer is not None:
    tokenizer.save(str(path / "tokenizer.json"))
