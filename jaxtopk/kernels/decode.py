"""The certified decode kernel: one query per sequence over a KV cache.

Delta-Search over key blocks in a Pallas kernel (TPU grid or GPU loop),
certified through ``jaxtopk.selection.core``; ``certified_decode_reference``
is its pure-jnp twin. ``BlockSizes`` sets the key block and the splits.
"""

from jaxtopk.kernels._decode import BlockSizes
from jaxtopk.kernels._decode import block_value_norms
from jaxtopk.kernels._decode import certified_decode
from jaxtopk.kernels._decode import certified_decode_reference

__all__ = [
  "BlockSizes",
  "block_value_norms",
  "certified_decode",
  "certified_decode_reference",
]
