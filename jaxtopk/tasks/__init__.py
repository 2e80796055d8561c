"""jaxtopk.tasks: seeded synthetic retrieval tasks (THEORY 8), RULER-style."""

from jaxtopk.tasks._retrieval import NUM_SPECIAL
from jaxtopk.tasks._retrieval import PAD
from jaxtopk.tasks._retrieval import QUERY
from jaxtopk.tasks._retrieval import SUM
from jaxtopk.tasks._retrieval import RetrievalBatch
from jaxtopk.tasks._retrieval import Vocab
from jaxtopk.tasks._retrieval import aggregate_recall
from jaxtopk.tasks._retrieval import associative_recall
from jaxtopk.tasks._retrieval import multi_key_lookup
from jaxtopk.tasks._retrieval import needle_in_haystack
from jaxtopk.tasks._ruler import aggregation
from jaxtopk.tasks._ruler import haystack_windows
from jaxtopk.tasks._ruler import needle_task
from jaxtopk.tasks._ruler import variable_tracking

__all__ = [
  "aggregate_recall",
  "aggregation",
  "associative_recall",
  "haystack_windows",
  "multi_key_lookup",
  "needle_in_haystack",
  "needle_task",
  "NUM_SPECIAL",
  "PAD",
  "QUERY",
  "RetrievalBatch",
  "SUM",
  "variable_tracking",
  "Vocab",
]
