"""Hyperparameters of a BERT encoder, read from a Hugging Face config.json.

Validated on construction with the bad value named; defaults are those of
all-MiniLM-L6-v2 (6 layers, 12 heads of 32, hidden 384, ffn 1536, exact-erf
GELU, LayerNorm eps 1e-12, 512 positions, 2 token types).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax

ACTIVATIONS = {
  "gelu": lambda x: jax.nn.gelu(x, approximate=False),
  "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
  "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """Hyperparameters of a BERT encoder (defaults: all-MiniLM-L6-v2).

  Attributes:
    vocab_size: number of WordPiece tokens.
    hidden_size: model width; a multiple of ``num_heads``.
    num_layers: number of encoder layers.
    num_heads: attention heads per layer.
    intermediate_size: width of the feed-forward block.
    max_position_embeddings: longest sequence the position table covers.
    type_vocab_size: number of token types (segments).
    layer_norm_eps: LayerNorm epsilon.
    hidden_act: feed-forward activation, one of ``gelu`` (exact erf, BERT's),
      ``gelu_new`` (tanh approximation) or ``relu``.
    pad_token_id: id of ``[PAD]``.
  """

  vocab_size: int = 30522
  hidden_size: int = 384
  num_layers: int = 6
  num_heads: int = 12
  intermediate_size: int = 1536
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12
  hidden_act: str = "gelu"
  pad_token_id: int = 0

  def __post_init__(self):
    for name in (
      "vocab_size",
      "hidden_size",
      "num_layers",
      "num_heads",
      "intermediate_size",
      "max_position_embeddings",
      "type_vocab_size",
    ):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    if self.hidden_size % self.num_heads:
      raise ValueError(
        f"hidden_size={self.hidden_size} must be a multiple of "
        f"num_heads={self.num_heads}"
      )
    if self.hidden_act not in ACTIVATIONS:
      raise ValueError(
        f"hidden_act={self.hidden_act!r} must be one of {sorted(ACTIVATIONS)}"
      )
    if not self.layer_norm_eps > 0:
      raise ValueError(f"layer_norm_eps={self.layer_norm_eps} must be > 0")

  @property
  def head_dim(self) -> int:
    """Width of one attention head, ``hidden_size // num_heads``."""
    return self.hidden_size // self.num_heads

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any]) -> BertConfig:
    """Builds a config from a Hugging Face ``config.json`` dictionary.

    Raises:
      ValueError: if the config is not an absolute-position BERT encoder.
    """
    model_type = d.get("model_type", "bert")
    if model_type != "bert":
      raise ValueError(f"{model_type=} must be 'bert'")
    position = d.get("position_embedding_type", "absolute")
    if position != "absolute":
      raise ValueError(f"position_embedding_type={position!r} must be absolute")
    return cls(
      vocab_size=d["vocab_size"],
      hidden_size=d["hidden_size"],
      num_layers=d["num_hidden_layers"],
      num_heads=d["num_attention_heads"],
      intermediate_size=d["intermediate_size"],
      max_position_embeddings=d["max_position_embeddings"],
      type_vocab_size=d["type_vocab_size"],
      layer_norm_eps=d["layer_norm_eps"],
      hidden_act=d["hidden_act"],
      pad_token_id=d.get("pad_token_id", 0),
    )

  @classmethod
  def from_json_file(cls, path) -> BertConfig:
    """Reads a Hugging Face ``config.json``."""
    with open(path, encoding="utf-8") as f:
      return cls.from_hf_dict(json.load(f))
