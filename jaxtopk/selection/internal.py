"""The documented internal API of jaxtopk.selection, for the layers above it.

Not for users (they call ``jaxtopk.selection`` or ``jaxtopk``): the pieces
that attention, kernels, parallel and nn need to select and certify the way
the selection layer does, named once here so that no layer imports a
private selection module (``tests/api_test.py`` forbids it). Beside them,
three documented internal modules: ``jaxtopk.selection.core`` (the
certificate core: rounding, logit error, ``PartialSoftmax``, finishing),
``jaxtopk.selection.threshold`` (few-pass Top-k and budget thresholds,
sharded or not, and the compaction of kept keys: the one selection
mechanism every path uses) and ``jaxtopk.selection.key_codes`` (8-bit key
codes and the sound per-key logit bounds they give, THEORY 3.5).

- ``check_policy(policy, backend=None, supports=None)``: the one check that
  ``policy`` is a policy (and that a backend honours its fields).
- ``keep_mask(...)``: the one keep rule of every policy over given logits.
- ``select_rows(...)``: ``select`` on validated logits with a logit error.
- ``search_row_partial(...)``: one row of Delta- / MC-Search, returning a
  ``core.PartialSoftmax``; ``search_row_compact(...)`` and
  ``finish_compact(...)``: its scoring within a capacity of blocks (a
  ``RowSearch``) and the kept set of the scored keys only; ``TableBlocks``: a
  row's key blocks read from a pool of pages; ``mc_log_mass_row``:
  MC-Search's per-block mass bound.
- ``box_abs_dot``, ``box_upper_bound_dot``: block-box bounds written as dot
  products; ``lowrank_upper_bound``: the per-key low-rank bound.
- ``rng_argument(rng, key, where)``: the ``rng=`` argument (``key=`` its
  deprecated name).
- ``FEATURES``, ``capabilities(*names)``: the policy features a path may
  declare (the attention registry's ``supports``).
"""

from jaxtopk.selection._lowrank import lowrank_upper_bound
from jaxtopk.selection._policies import FEATURES
from jaxtopk.selection._policies import capabilities
from jaxtopk.selection._search import RowSearch
from jaxtopk.selection._search import TableBlocks
from jaxtopk.selection._search import box_abs_dot
from jaxtopk.selection._search import box_upper_bound_dot
from jaxtopk.selection._search import finish_compact
from jaxtopk.selection._search import mc_log_mass_row
from jaxtopk.selection._search import search_row_compact
from jaxtopk.selection._search import search_row_partial
from jaxtopk.selection._select import check_policy
from jaxtopk.selection._select import keep_mask
from jaxtopk.selection._select import rng_argument
from jaxtopk.selection._select import select_rows

__all__ = [
  "box_abs_dot",
  "box_upper_bound_dot",
  "capabilities",
  "check_policy",
  "FEATURES",
  "finish_compact",
  "keep_mask",
  "lowrank_upper_bound",
  "mc_log_mass_row",
  "rng_argument",
  "RowSearch",
  "search_row_compact",
  "search_row_partial",
  "select_rows",
  "TableBlocks",
]
