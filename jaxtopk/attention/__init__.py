"""Attention on the XLA path: Top-k prefill and decode with certificates."""

from jaxtopk.attention import _index_decode  # noqa: F401  (registers the op)
from jaxtopk.attention._cache import KVCache
from jaxtopk.attention._cache import init_kv_cache
from jaxtopk.attention._cache import kv_cache_update
from jaxtopk.attention._decode import DECODE_IMPLEMENTATIONS
from jaxtopk.attention._decode import decode_attention
from jaxtopk.attention._decode import register_decode_implementation
from jaxtopk.attention._decode import topk_indices
from jaxtopk.attention._index import IndexedKVCache
from jaxtopk.attention._index import build_kv_index
from jaxtopk.attention._index import kv_index_from_cache
from jaxtopk.attention._index import kv_index_update
from jaxtopk.attention._index import rebuild_kv_index
from jaxtopk.attention._index_search import group_upper_bounds
from jaxtopk.attention._index_selection import certify_selection
from jaxtopk.attention._index_selection import grow_selection
from jaxtopk.attention._merge import merge_attention
from jaxtopk.attention._paged import PagedKVCache
from jaxtopk.attention._topk import IMPLEMENTATIONS
from jaxtopk.attention._topk import causal_mask
from jaxtopk.attention._topk import register_implementation
from jaxtopk.attention._topk import topk_attention

__all__ = [
  "build_kv_index",
  "causal_mask",
  "certify_selection",
  "decode_attention",
  "DECODE_IMPLEMENTATIONS",
  "group_upper_bounds",
  "grow_selection",
  "IMPLEMENTATIONS",
  "IndexedKVCache",
  "init_kv_cache",
  "kv_cache_update",
  "kv_index_from_cache",
  "kv_index_update",
  "KVCache",
  "merge_attention",
  "PagedKVCache",
  "rebuild_kv_index",
  "register_decode_implementation",
  "register_implementation",
  "topk_attention",
  "topk_indices",
]
