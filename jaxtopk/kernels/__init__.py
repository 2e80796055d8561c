"""jaxtopk.kernels: Pallas kernels for blockwise certified Top-k attention.

Every kernel has a module (``decode``, ``prefill``, ``sparse_flash``,
``stats``, ``select``) with its public wrapper (``interpret=`` for CPU), its
frozen ``BlockSizes`` and a pure-jnp ``*_reference``; the wrappers are also
here at the top. ``pallas_topk_attention`` / ``pallas_decode_attention``
are the ops behind ``implementation='pallas'``.
"""

from jaxtopk import _deprecation
from jaxtopk.kernels import decode
from jaxtopk.kernels import prefill
from jaxtopk.kernels import select
from jaxtopk.kernels import sparse_flash
from jaxtopk.kernels import stats
from jaxtopk.kernels._backend import DECODE_SUPPORTS
from jaxtopk.kernels._backend import PREFILL_SUPPORTS
from jaxtopk.kernels._backend import pallas_decode_attention
from jaxtopk.kernels._backend import pallas_topk_attention
from jaxtopk.kernels._backend import register as _register
from jaxtopk.kernels._block_stats import BlockStats
from jaxtopk.kernels._block_stats import block_stats
from jaxtopk.kernels._block_stats import block_stats_reference
from jaxtopk.kernels._decode import block_value_norms
from jaxtopk.kernels._decode import certified_decode
from jaxtopk.kernels._decode import certified_decode_reference
from jaxtopk.kernels._prefill import certified_sparse_attention
from jaxtopk.kernels._prefill import certified_sparse_attention_reference
from jaxtopk.kernels._prefill import prefill_certificate
from jaxtopk.kernels._select import BlockSelection
from jaxtopk.kernels._select import per_query_kept
from jaxtopk.kernels._select import select_blocks
from jaxtopk.kernels._sparse_flash import FlashStats
from jaxtopk.kernels._sparse_flash import sparse_flash_attention
from jaxtopk.kernels._sparse_flash import sparse_flash_attention_reference
from jaxtopk.kernels._sparse_flash import sparse_flash_stats
from jaxtopk.kernels._sparse_flash import sparse_flash_stats_reference

_register()

__all__ = [
  "decode",
  "prefill",
  "select",
  "sparse_flash",
  "stats",
  "block_stats",
  "block_stats_reference",
  "block_value_norms",
  "BlockSelection",
  "BlockStats",
  "certified_decode",
  "certified_decode_reference",
  "certified_sparse_attention",
  "certified_sparse_attention_reference",
  "DECODE_SUPPORTS",
  "FlashStats",
  "pallas_decode_attention",
  "pallas_topk_attention",
  "per_query_kept",
  "prefill_certificate",
  "PREFILL_SUPPORTS",
  "select_blocks",
  "sparse_flash_attention",
  "sparse_flash_attention_reference",
  "sparse_flash_stats",
  "sparse_flash_stats_reference",
]

# Old top-level aliases (one release, then removed): the kernel modules
# name these without a prefix.
__getattr__ = _deprecation.moved(
  "jaxtopk.kernels",
  {
    "BlockStatsSizes": "stats.BlockSizes",
    "DecodeSizes": "decode.BlockSizes",
    "SparseFlashSizes": "sparse_flash.BlockSizes",
    "sparse_flash_gathered_attention": "sparse_flash.gathered_attention",
    "sparse_flash_kept_key_mask": "sparse_flash.kept_key_mask",
    "sparse_flash_visible_mask": "stats.visible_mask",
  },
)
