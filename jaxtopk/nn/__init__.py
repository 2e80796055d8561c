"""jaxtopk.nn: Flax layers and models."""

from jaxtopk.nn._attention_rows import minilm_attention_rows
from jaxtopk.nn._attention_rows import minilm_qk_weights
from jaxtopk.nn._bert import AttentionTrace
from jaxtopk.nn._bert import BertEncoder
from jaxtopk.nn._bert import MiniLM
from jaxtopk.nn._bert_config import BertConfig
from jaxtopk.nn._minilm import load_bert_weights
from jaxtopk.nn._minilm import load_minilm
from jaxtopk.nn._minilm import minilm_model_dir
from jaxtopk.nn._minilm import minilm_tokenize
from jaxtopk.nn._pooling import l2_normalize
from jaxtopk.nn._pooling import mean_pool
from jaxtopk.nn._pooling import sentence_embedding
from jaxtopk.nn._real_text import REAL_TEXT_FILES
from jaxtopk.nn._real_text import real_text_passages
