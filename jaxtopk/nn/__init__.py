"""jaxtopk.nn: Flax layers for certified Top-k attention (DESIGN layer 5).

``CertifiedTopKAttention`` (``nnx.MultiHeadAttention`` with a policy),
``topk_attention_fn`` (an ``attention_fn`` for any Flax attention module),
the Linen bridge, and reading certificates back per layer and head. Models
built from these layers live in ``jaxtopk.models``.
"""

from jaxtopk.nn._attention import CertificateVariable
from jaxtopk.nn._attention import CertifiedTopKAttention
from jaxtopk.nn._attention_fn import certified_attention
from jaxtopk.nn._attention_fn import topk_attention_fn
from jaxtopk.nn._certificates import collect_certificates
from jaxtopk.nn._certificates import init_certificates
from jaxtopk.nn._certificates import per_head_report
from jaxtopk.nn._linen import topk_attention_linen

__all__ = [
  "CertificateVariable",
  "certified_attention",
  "CertifiedTopKAttention",
  "collect_certificates",
  "init_certificates",
  "per_head_report",
  "topk_attention_fn",
  "topk_attention_linen",
]
