"""Attention on the XLA path: Top-k prefill and decode with certificates."""

from jaxtopk.attention._topk import IMPLEMENTATIONS
from jaxtopk.attention._topk import causal_mask
from jaxtopk.attention._topk import register_implementation
from jaxtopk.attention._topk import topk_attention
