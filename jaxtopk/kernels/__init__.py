"""jaxtopk.kernels: Pallas kernels for blockwise certified Top-k attention.

Every kernel has a public wrapper (``interpret=`` for CPU), a frozen
``BlockSizes`` and a pure-jnp ``*_reference``.
"""

from jaxtopk.kernels._backend import DECODE_SUPPORTS
from jaxtopk.kernels._backend import PREFILL_SUPPORTS
from jaxtopk.kernels._backend import pallas_decode_attention
from jaxtopk.kernels._backend import pallas_topk_attention
from jaxtopk.kernels._backend import register as _register
from jaxtopk.kernels._block_stats import BlockSizes as BlockStatsSizes
from jaxtopk.kernels._block_stats import BlockStats
from jaxtopk.kernels._block_stats import block_stats
from jaxtopk.kernels._block_stats import block_stats_reference
from jaxtopk.kernels._block_stats import (
  visible_mask as sparse_flash_visible_mask,
)
from jaxtopk.kernels._decode import BlockSizes as DecodeSizes
from jaxtopk.kernels._decode import block_value_norms
from jaxtopk.kernels._decode import certified_decode
from jaxtopk.kernels._decode import certified_decode_reference
from jaxtopk.kernels._prefill import certified_sparse_attention
from jaxtopk.kernels._prefill import certified_sparse_attention_reference
from jaxtopk.kernels._prefill import prefill_certificate
from jaxtopk.kernels._select import BlockSelection
from jaxtopk.kernels._select import per_query_kept
from jaxtopk.kernels._select import select_blocks
from jaxtopk.kernels._sparse_flash import BlockSizes as SparseFlashSizes
from jaxtopk.kernels._sparse_flash import FlashStats
from jaxtopk.kernels._sparse_flash import (
  gathered_attention as sparse_flash_gathered_attention,
)
from jaxtopk.kernels._sparse_flash import (
  kept_key_mask as sparse_flash_kept_key_mask,
)
from jaxtopk.kernels._sparse_flash import sparse_flash_attention
from jaxtopk.kernels._sparse_flash import sparse_flash_attention_reference
from jaxtopk.kernels._sparse_flash import sparse_flash_stats
from jaxtopk.kernels._sparse_flash import sparse_flash_stats_reference

_register()

__all__ = [
  "block_stats",
  "block_stats_reference",
  "block_value_norms",
  "BlockSelection",
  "BlockStats",
  "BlockStatsSizes",
  "certified_decode",
  "certified_decode_reference",
  "certified_sparse_attention",
  "certified_sparse_attention_reference",
  "DECODE_SUPPORTS",
  "DecodeSizes",
  "FlashStats",
  "pallas_decode_attention",
  "pallas_topk_attention",
  "per_query_kept",
  "prefill_certificate",
  "PREFILL_SUPPORTS",
  "select_blocks",
  "sparse_flash_attention",
  "sparse_flash_attention_reference",
  "sparse_flash_gathered_attention",
  "sparse_flash_kept_key_mask",
  "sparse_flash_stats",
  "sparse_flash_stats_reference",
  "sparse_flash_visible_mask",
  "SparseFlashSizes",
]
