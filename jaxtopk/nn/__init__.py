"""jaxtopk.nn."""

from jaxtopk.nn._attention import CertificateVariable
from jaxtopk.nn._attention import CertifiedTopKAttention
from jaxtopk.nn._attention_fn import certified_attention
from jaxtopk.nn._attention_fn import topk_attention_fn
from jaxtopk.nn._certificates import collect_certificates
from jaxtopk.nn._certificates import per_head_report
from jaxtopk.nn._linen import topk_attention_linen
