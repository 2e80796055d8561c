"""Bound theory for one attention row, vmapped over leading axes.

See ../shared/THEORY.md; every function cites its section.
"""

from jaxtopk.theory._blockwise import BallSummary
from jaxtopk.theory._blockwise import BoxSummary
from jaxtopk.theory._blockwise import ball_summary
from jaxtopk.theory._blockwise import ball_upper_bound
from jaxtopk.theory._blockwise import blockwise_bound
from jaxtopk.theory._blockwise import blockwise_log_bound
from jaxtopk.theory._blockwise import box_summary
from jaxtopk.theory._blockwise import box_upper_bound
from jaxtopk.theory._tail import kl_truncated
from jaxtopk.theory._tail import log_tail_mass
from jaxtopk.theory._tail import tail_mass
