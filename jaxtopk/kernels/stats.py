"""The block-statistics kernel: per query and key block, the softmax
statistics of the block's logits (max, mass, log-mass, counts) that block
selection and the certificate read.

``block_stats`` and its pure-jnp reference, ``BlockStats`` (the result),
``BlockSizes`` (query and key tiles) and ``visible_mask`` (which keys a
padding mask and causality let each query see).
"""

from jaxtopk.kernels._block_stats import BlockSizes
from jaxtopk.kernels._block_stats import BlockStats
from jaxtopk.kernels._block_stats import block_stats
from jaxtopk.kernels._block_stats import block_stats_reference
from jaxtopk.kernels._block_stats import visible_mask

__all__ = [
  "BlockSizes",
  "BlockStats",
  "block_stats",
  "block_stats_reference",
  "visible_mask",
]
