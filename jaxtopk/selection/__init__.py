"""Which keys are kept: policies, certified search, certificates."""

from jaxtopk.selection._certificate import Certificate
from jaxtopk.selection._certified import certified_search
from jaxtopk.selection._lowrank import key_projection
from jaxtopk.selection._lowrank import lowrank_upper_bound
from jaxtopk.selection._policies import Certified
from jaxtopk.selection._policies import Dense
from jaxtopk.selection._policies import FixedK
from jaxtopk.selection._policies import Policy
from jaxtopk.selection._policies import PowerLaw
from jaxtopk.selection._policies import Ratio
from jaxtopk.selection._select import Selection
from jaxtopk.selection._select import select
from jaxtopk.selection._threshold import budget_mask
from jaxtopk.selection._threshold import topk_mask
