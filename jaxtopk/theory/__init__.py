"""Bound theory for one attention row, vmapped over leading axes.

THEORY.md (repository root) is the math; every function cites its section.
"""

from jaxtopk.theory._blockwise import BallSummary
from jaxtopk.theory._blockwise import BoxSummary
from jaxtopk.theory._blockwise import ball_summary
from jaxtopk.theory._blockwise import ball_upper_bound
from jaxtopk.theory._blockwise import blockwise_bound
from jaxtopk.theory._blockwise import blockwise_log_bound
from jaxtopk.theory._blockwise import box_summary
from jaxtopk.theory._blockwise import box_upper_bound
from jaxtopk.theory._entropy import attention_entropy
from jaxtopk.theory._gaps import multi_gap_bound
from jaxtopk.theory._gaps import multi_gap_log_bound
from jaxtopk.theory._gaps import single_gap_bound
from jaxtopk.theory._gaps import single_gap_certifies
from jaxtopk.theory._gaps import single_gap_log_bound
from jaxtopk.theory._gaussian import KEpsEstimate
from jaxtopk.theory._gaussian import gaussian_k_eps_finite_n
from jaxtopk.theory._gaussian import gaussian_k_eps_rule
from jaxtopk.theory._gaussian import gaussian_sigma_limit
from jaxtopk.theory._gaussian import gaussian_tail_mass
from jaxtopk.theory._output import HeadTail
from jaxtopk.theory._output import diameter_bound
from jaxtopk.theory._output import head_tail_error
from jaxtopk.theory._output import head_tail_means
from jaxtopk.theory._output import value_norm_bound
from jaxtopk.theory._output import variance_bound
from jaxtopk.theory._sparsity import effective_entries
from jaxtopk.theory._sparsity import ineffective_fraction
from jaxtopk.theory._sparsity import powerlaw_sigma
from jaxtopk.theory._sparsity import powerlaw_window
from jaxtopk.theory._sparsity import row_l2_error
from jaxtopk.theory._sparsity import weight_scale_R
from jaxtopk.theory._tail import kl_truncated
from jaxtopk.theory._tail import log_tail_mass
from jaxtopk.theory._tail import tail_mass
from jaxtopk.theory._topk import k_eps
from jaxtopk.theory._topk import topk_mask

__all__ = [
  "attention_entropy",
  "ball_summary",
  "ball_upper_bound",
  "BallSummary",
  "blockwise_bound",
  "blockwise_log_bound",
  "box_summary",
  "box_upper_bound",
  "BoxSummary",
  "diameter_bound",
  "effective_entries",
  "gaussian_k_eps_finite_n",
  "gaussian_k_eps_rule",
  "gaussian_sigma_limit",
  "gaussian_tail_mass",
  "head_tail_error",
  "head_tail_means",
  "HeadTail",
  "ineffective_fraction",
  "k_eps",
  "KEpsEstimate",
  "kl_truncated",
  "log_tail_mass",
  "multi_gap_bound",
  "multi_gap_log_bound",
  "powerlaw_sigma",
  "powerlaw_window",
  "row_l2_error",
  "single_gap_bound",
  "single_gap_certifies",
  "single_gap_log_bound",
  "tail_mass",
  "topk_mask",
  "value_norm_bound",
  "variance_bound",
  "weight_scale_R",
]
