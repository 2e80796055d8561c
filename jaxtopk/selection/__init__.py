"""Which keys are kept: policies, certified search, certificates.

``jaxtopk.selection.core`` is the certificate core, the documented internal
API that the attention, kernel, parallel and nn layers build on. So are
``select_rows`` (select on validated logits with a logit error bound),
``search_row_partial`` (one row of Delta- / MC-Search, returning a
``core.PartialSoftmax``), ``mc_log_mass_row`` (MC-Search's per-block mass
bound),
``box_abs_dot`` and ``box_upper_bound_dot`` (block-box
bounds written as dot products), and ``jaxtopk.selection.threshold``
(few-pass Top-k and budget thresholds, sharded or not, and the compaction of
kept keys: the one selection mechanism every path uses), and
``jaxtopk.selection.key_codes`` (8-bit key codes and the sound per-key logit
bounds they give, THEORY 3.5).
"""

from jaxtopk.selection import core
from jaxtopk.selection import key_codes
from jaxtopk.selection import threshold
from jaxtopk.selection._certificate import Certificate
from jaxtopk.selection._certified import certified_search
from jaxtopk.selection._lowrank import key_projection
from jaxtopk.selection._lowrank import lowrank_upper_bound
from jaxtopk.selection._policies import FEATURES
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
from jaxtopk.selection._policies import capabilities
from jaxtopk.selection._search import box_abs_dot
from jaxtopk.selection._search import box_upper_bound_dot
from jaxtopk.selection._search import mc_log_mass_row
from jaxtopk.selection._search import search_row_partial
from jaxtopk.selection._select import Selection
from jaxtopk.selection._select import check_policy
from jaxtopk.selection._select import keep_mask
from jaxtopk.selection._select import rng_argument
from jaxtopk.selection._select import select
from jaxtopk.selection._select import select_rows
from jaxtopk.selection.threshold import budget_mask
from jaxtopk.selection.threshold import topk_mask

__all__ = [
  "Auto",
  "Box",
  "box_abs_dot",
  "box_upper_bound_dot",
  "budget_mask",
  "capabilities",
  "Certificate",
  "Certified",
  "check_policy",
  "certified_search",
  "Codes",
  "core",
  "DeltaSearch",
  "Dense",
  "Exact",
  "FEATURES",
  "FixedCount",
  "FixedK",
  "keep_mask",
  "key_codes",
  "key_projection",
  "KeyBound",
  "LowRank",
  "lowrank_upper_bound",
  "mc_log_mass_row",
  "MCSearch",
  "Policy",
  "PowerLaw",
  "Ratio",
  "rng_argument",
  "search_row_partial",
  "SearchStrategy",
  "select",
  "select_rows",
  "Selection",
  "threshold",
  "topk_mask",
  "UnsupportedPolicyError",
]
