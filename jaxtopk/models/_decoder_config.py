"""The decoder's architecture: one config for Llama 3.x, Qwen3 and tiny ones.

:class:`DecoderConfig` names the sizes and switches of
``jaxtopk.models.TopKDecoder``; :meth:`DecoderConfig.from_hf` reads the
``config.json`` of a Hugging Face Llama or Qwen3 checkpoint (both the form
published checkpoints carry, ``rope_theta`` and ``rope_scaling``, and the
form transformers 5 writes, ``rope_parameters``) and :meth:`DecoderConfig.
to_hf` writes one back. A field a checkpoint sets that this architecture
cannot honour (sliding-window layers, partial rotary dimensions, another
activation, a rope type other than default/linear/llama3) is refused by
name, never dropped.
"""

import dataclasses
import math
from typing import Any

from jaxtopk.models._rope import ROPE_TYPES
from jaxtopk.models._rope import RopeScaling

MODEL_TYPES = ("llama", "qwen3")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Sizes and switches of a :class:`jaxtopk.models.TopKDecoder`.

  Llama 3.x is ``qk_norm=False``; Qwen3 is ``qk_norm=True`` (an RMSNorm over
  each head's query and key before the rotation). Defaults give a tiny
  Llama-style model.

  Attributes:
    vocab_size: number of token ids.
    num_layers: transformer blocks.
    num_heads: query heads per block.
    model_dim: residual width (``hidden_size``).
    mlp_dim: SwiGLU hidden width (``intermediate_size``).
    num_kv_heads: key/value heads (grouped-query attention); None means
      ``num_heads``. ``num_heads`` must be a multiple of it.
    head_dim: width of one head; None means ``model_dim // num_heads``.
    rope_theta: rotary base.
    rope_scaling: optional frequency scaling (``jaxtopk.models.RopeScaling``,
      'linear' or 'llama3').
    norm_eps: RMSNorm epsilon (``rms_norm_eps``).
    qk_norm: Qwen3's per-head RMSNorm of queries and keys.
    attention_bias: biases on the q, k, v and output projections.
    mlp_bias: biases on the SwiGLU projections.
    tie_embeddings: the output projection is the token embedding
      (``tie_word_embeddings``).
    max_position_embeddings: the context the checkpoint declares (kept for
      the round trip to config.json; not enforced).
  """

  vocab_size: int
  num_layers: int = 2
  num_heads: int = 4
  model_dim: int = 64
  mlp_dim: int = 256
  # None at construction means "derive"; __post_init__ sets an int.
  num_kv_heads: int = None  # type: ignore[assignment]
  head_dim: int = None  # type: ignore[assignment]
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  norm_eps: float = 1e-6
  qk_norm: bool = False
  attention_bias: bool = False
  mlp_bias: bool = False
  tie_embeddings: bool = False
  max_position_embeddings: int = 8192

  def __post_init__(self):
    for name in ("vocab_size", "num_layers", "num_heads", "model_dim"):
      value = getattr(self, name)
      if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"DecoderConfig.{name}={value!r} must be >= 1")
    if not (isinstance(self.mlp_dim, int) and self.mlp_dim >= 1):
      raise ValueError(f"DecoderConfig.mlp_dim={self.mlp_dim!r} must be >= 1")
    if self.head_dim is None:
      if self.model_dim % self.num_heads:
        raise ValueError(
          f"model_dim={self.model_dim} must be a multiple of "
          f"num_heads={self.num_heads} (or set head_dim)"
        )
      object.__setattr__(self, "head_dim", self.model_dim // self.num_heads)
    if self.num_kv_heads is None:
      object.__setattr__(self, "num_kv_heads", self.num_heads)
    for name in ("head_dim", "num_kv_heads"):
      value = getattr(self, name)
      if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"DecoderConfig.{name}={value!r} must be >= 1")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even (rotary)")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_heads={self.num_heads} must be a multiple of "
        f"num_kv_heads={self.num_kv_heads}"
      )
    if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
      raise ValueError(f"rope_theta={self.rope_theta!r} must be > 0")
    if not (math.isfinite(self.norm_eps) and self.norm_eps > 0):
      raise ValueError(f"norm_eps={self.norm_eps!r} must be > 0")
    if self.rope_scaling is not None and not isinstance(
      self.rope_scaling, RopeScaling
    ):
      raise TypeError(
        f"rope_scaling={self.rope_scaling!r} must be a RopeScaling or None"
      )

  @property
  def num_params(self) -> int:
    """Number of parameters (embedding counted once when tied)."""
    d, h, hd = self.model_dim, self.num_heads, self.head_dim
    hk = self.num_kv_heads
    attn = d * (h + 2 * hk) * hd + h * hd * d
    if self.attention_bias:
      attn += (h + 2 * hk) * hd + d
    mlp = 3 * d * self.mlp_dim
    if self.mlp_bias:
      mlp += 2 * self.mlp_dim + d
    norms = 2 * d + (2 * hd if self.qk_norm else 0)
    head = 0 if self.tie_embeddings else d * self.vocab_size
    total = self.num_layers * (attn + mlp + norms)
    return total + self.vocab_size * d + d + head

  @classmethod
  def from_hf(cls, hf: dict[str, Any]) -> "DecoderConfig":
    """The config of a Hugging Face Llama or Qwen3 ``config.json``.

    Args:
      hf: the parsed ``config.json``.

    Returns:
      The DecoderConfig.

    Raises:
      ValueError: a ``model_type`` other than 'llama' or 'qwen3', a missing
        size, or a field this architecture cannot honour (named).
    """
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
      raise ValueError(
        f"config.json model_type={model_type!r} is not supported; expected"
        f" one of {MODEL_TYPES}"
      )
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
      raise ValueError(f"config.json hidden_act={act!r}: only 'silu' (SwiGLU)")
    if hf.get("use_sliding_window"):
      raise ValueError(
        "config.json use_sliding_window=True: sliding-window attention is"
        " not supported"
      )
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
      raise ValueError(
        f"config.json layer_types={layer_types!r}: only 'full_attention'"
      )
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
      raise ValueError(
        "config.json partial_rotary_factor="
        f"{hf['partial_rotary_factor']!r}: only 1.0"
      )
    theta, scaling = _rope_of(hf)
    try:
      num_heads = int(hf["num_attention_heads"])
      kwargs = dict(
        vocab_size=int(hf["vocab_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        model_dim=int(hf["hidden_size"]),
        mlp_dim=int(hf["intermediate_size"]),
      )
    except KeyError as e:
      raise ValueError(f"config.json lacks {e.args[0]!r}") from None
    kv = hf.get("num_key_value_heads")
    # transformers: head_dim, or hidden_size // num_attention_heads.
    head_dim = hf.get("head_dim") or kwargs["model_dim"] // num_heads
    return cls(
      **kwargs,
      num_kv_heads=num_heads if kv is None else int(kv),
      head_dim=int(head_dim),
      rope_theta=theta,
      rope_scaling=scaling,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      qk_norm=model_type == "qwen3",
      attention_bias=bool(hf.get("attention_bias", False)),
      mlp_bias=bool(hf.get("mlp_bias", False)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
    )

  def to_hf(self, **extra: Any) -> dict[str, Any]:
    """This config as a transformers ``config.json`` dict.

    Written in the published form (``rope_theta`` and ``rope_scaling``),
    which transformers 4 and 5 both read. ``model_type`` is 'qwen3' when
    ``qk_norm`` is set, else 'llama'.

    Args:
      **extra: further fields (e.g. ``bos_token_id``), written as given.

    Raises:
      ValueError: Qwen3 with ``mlp_bias`` (transformers' Qwen3 has none).
    """
    qwen = self.qk_norm
    if qwen and self.mlp_bias:
      raise ValueError("qk_norm=True (Qwen3) with mlp_bias=True has no HF form")
    out: dict[str, Any] = dict(
      architectures=["Qwen3ForCausalLM" if qwen else "LlamaForCausalLM"],
      model_type="qwen3" if qwen else "llama",
      vocab_size=self.vocab_size,
      hidden_size=self.model_dim,
      intermediate_size=self.mlp_dim,
      num_hidden_layers=self.num_layers,
      num_attention_heads=self.num_heads,
      num_key_value_heads=self.num_kv_heads,
      head_dim=self.head_dim,
      hidden_act="silu",
      max_position_embeddings=self.max_position_embeddings,
      rms_norm_eps=self.norm_eps,
      rope_theta=self.rope_theta,
      rope_scaling=(
        None
        if self.rope_scaling is None
        else dict(dataclasses.asdict(self.rope_scaling))
      ),
      attention_bias=self.attention_bias,
      tie_word_embeddings=self.tie_embeddings,
    )
    if not qwen:
      out["mlp_bias"] = self.mlp_bias
    out.update(extra)
    return out


def _rope_of(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
  """``(rope_theta, scaling)`` from either config.json form."""
  params = hf.get("rope_parameters")
  if params is not None:
    if not isinstance(params, dict) or "rope_theta" not in params:
      raise ValueError(
        f"config.json rope_parameters={params!r}: expected one flat dict"
        " with rope_theta (per-layer-type rope is not supported)"
      )
    theta = params["rope_theta"]
  else:
    params = hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta", 10000.0)
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in ROPE_TYPES:
    raise ValueError(
      f"config.json rope type {rope_type!r} is not supported; expected one"
      f" of {ROPE_TYPES}"
    )
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError("config.json partial_rotary_factor: only 1.0")
  if rope_type == "default":
    return float(theta), None
  if rope_type == "linear":
    return float(theta), RopeScaling("linear", float(params["factor"]))
  try:
    scaling = RopeScaling(
      "llama3",
      float(params["factor"]),
      low_freq_factor=float(params["low_freq_factor"]),
      high_freq_factor=float(params["high_freq_factor"]),
      original_max_position_embeddings=int(
        params.get(
          "original_max_position_embeddings",
          hf.get("max_position_embeddings", 8192),
        )
      ),
    )
  except KeyError as e:
    raise ValueError(f"config.json llama3 rope lacks {e.args[0]!r}") from None
  return float(theta), scaling
