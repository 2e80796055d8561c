"""Which keys are kept: policies, certified search, certificates.

What users call: the policies (``Dense``, ``FixedK``, ``Ratio``,
``PowerLaw``, ``Certified`` with its strategies and key bounds),
``select`` (a policy over given logits), ``certified_search`` (from
queries and keys, scoring only the blocks it needs), ``Certificate``,
``Selection``, ``topk_mask`` and ``budget_mask``. The layers above build on
the documented internal API, ``jaxtopk.selection.internal`` (and its
modules ``core``, ``threshold``, ``key_codes``), which users need not
import.
"""

from jaxtopk.selection import core
from jaxtopk.selection import internal
from jaxtopk.selection import key_codes
from jaxtopk.selection import threshold
from jaxtopk.selection._certificate import Certificate
from jaxtopk.selection._certified import certified_search
from jaxtopk.selection._lowrank import key_projection
from jaxtopk.selection._policies import Auto
from jaxtopk.selection._policies import Box
from jaxtopk.selection._policies import Certified
from jaxtopk.selection._policies import Codes
from jaxtopk.selection._policies import DeltaSearch
from jaxtopk.selection._policies import Dense
from jaxtopk.selection._policies import Exact
from jaxtopk.selection._policies import FixedCount
from jaxtopk.selection._policies import FixedK
from jaxtopk.selection._policies import KeyBound
from jaxtopk.selection._policies import LowRank
from jaxtopk.selection._policies import MCSearch
from jaxtopk.selection._policies import Policy
from jaxtopk.selection._policies import PowerLaw
from jaxtopk.selection._policies import Ratio
from jaxtopk.selection._policies import SearchStrategy
from jaxtopk.selection._policies import UnsupportedPolicyError
from jaxtopk.selection._select import Selection
from jaxtopk.selection._select import select
from jaxtopk.selection.threshold import budget_mask
from jaxtopk.selection.threshold import topk_mask

__all__ = [
  "Auto",
  "Box",
  "budget_mask",
  "Certificate",
  "Certified",
  "certified_search",
  "Codes",
  "DeltaSearch",
  "Dense",
  "Exact",
  "FixedCount",
  "FixedK",
  "key_projection",
  "KeyBound",
  "LowRank",
  "MCSearch",
  "Policy",
  "PowerLaw",
  "Ratio",
  "SearchStrategy",
  "select",
  "Selection",
  "topk_mask",
  "UnsupportedPolicyError",
]
