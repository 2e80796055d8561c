"""The sparse flash-attention kernel over selected key blocks.

``sparse_flash_attention`` (output) and ``sparse_flash_stats`` (output with
its softmax statistics) over the blocks of a selection, their pure-jnp
references, ``gathered_attention`` (the XLA backward's gathered form) and
``kept_key_mask``. ``BlockSizes`` sets the query and key tiles.
"""

from jaxtopk.kernels._sparse_flash import BlockSizes
from jaxtopk.kernels._sparse_flash import FlashStats
from jaxtopk.kernels._sparse_flash import gathered_attention
from jaxtopk.kernels._sparse_flash import kept_key_mask
from jaxtopk.kernels._sparse_flash import sparse_flash_attention
from jaxtopk.kernels._sparse_flash import sparse_flash_attention_reference
from jaxtopk.kernels._sparse_flash import sparse_flash_stats
from jaxtopk.kernels._sparse_flash import sparse_flash_stats_reference

__all__ = [
  "BlockSizes",
  "FlashStats",
  "gathered_attention",
  "kept_key_mask",
  "sparse_flash_attention",
  "sparse_flash_attention_reference",
  "sparse_flash_stats",
  "sparse_flash_stats_reference",
]
