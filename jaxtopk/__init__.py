"""jaxtopk: certified Top-k sparse attention for JAX and Flax.

Attention that looks at a fraction of the keys and returns, with every call,
a certificate bounding the softmax mass (total variation) it dropped.
"""

from jaxtopk import kernels
from jaxtopk import models
from jaxtopk import nn
from jaxtopk import parallel
from jaxtopk import theory
from jaxtopk.attention import IndexedKVCache
from jaxtopk.attention import KVCache
from jaxtopk.attention import PagedKVCache
from jaxtopk.attention import build_kv_index
from jaxtopk.attention import certify_selection
from jaxtopk.attention import decode_attention
from jaxtopk.attention import grow_selection
from jaxtopk.attention import init_kv_cache
from jaxtopk.attention import kv_cache_update
from jaxtopk.attention import kv_index_from_cache
from jaxtopk.attention import kv_index_update
from jaxtopk.attention import merge_attention
from jaxtopk.attention import rebuild_kv_index
from jaxtopk.attention import topk_attention
from jaxtopk.selection import Auto
from jaxtopk.selection import Box
from jaxtopk.selection import Certificate
from jaxtopk.selection import Certified
from jaxtopk.selection import Codes
from jaxtopk.selection import DeltaSearch
from jaxtopk.selection import Dense
from jaxtopk.selection import Exact
from jaxtopk.selection import FixedK
from jaxtopk.selection import LowRank
from jaxtopk.selection import MCSearch
from jaxtopk.selection import Policy
from jaxtopk.selection import PowerLaw
from jaxtopk.selection import Ratio
from jaxtopk.selection import Selection
from jaxtopk.selection import UnsupportedPolicyError
from jaxtopk.selection import certified_search
from jaxtopk.selection import select

__version__ = "0.2.0"

__all__ = [
  "Auto",
  "Box",
  "build_kv_index",
  "Certificate",
  "Certified",
  "certified_search",
  "certify_selection",
  "Codes",
  "decode_attention",
  "DeltaSearch",
  "Dense",
  "Exact",
  "FixedK",
  "grow_selection",
  "IndexedKVCache",
  "init_kv_cache",
  "kernels",
  "kv_cache_update",
  "kv_index_from_cache",
  "kv_index_update",
  "KVCache",
  "PagedKVCache",
  "LowRank",
  "MCSearch",
  "merge_attention",
  "models",
  "nn",
  "parallel",
  "Policy",
  "PowerLaw",
  "Ratio",
  "rebuild_kv_index",
  "select",
  "Selection",
  "theory",
  "topk_attention",
  "UnsupportedPolicyError",
]
