"""Certified block selection from block statistics.

``per_query_kept``: per query, the fewest key blocks by mass whose dropped
mass fits eps; ``select_blocks``: their union per query tile as block lists
(``BlockSelection``) for the sparse kernels.
"""

from jaxtopk.kernels._select import BlockSelection
from jaxtopk.kernels._select import per_query_kept
from jaxtopk.kernels._select import select_blocks

__all__ = [
  "BlockSelection",
  "per_query_kept",
  "select_blocks",
]
