"""The documented internal API of jaxtopk.theory, for the layers above it.

Not for users (they call ``jaxtopk.theory``): these are the pieces that
selection, attention, kernels and parallel need to compute certificates the
same way the theory does (THEORY 10), named once here so that no layer
imports a private theory module (``tests/api_test.py`` forbids new ones).

- ``compute_dtype(dtype)``: the dtype every logit, sum and bound is computed
  in: float32, or float64 for float64 inputs (bounds are never stored in
  bf16/f16, which rounds to nearest and could fall below the truth).
- ``log_slack(n_terms, dtype)``: the log-space round-up that keeps a bound
  computed by a reduction of ``n_terms`` float terms above the exact value
  (a few ulps per level of the reduction tree plus ``sqrt(n)`` ulps, since
  XLA CPU reductions are not trees).
- ``exp_up(log_b)``: exp of a log bound, never below it (a positive bound
  is raised to the smallest normal rather than flushed to 0).
- ``up_positive(x, positive)``: ``x`` raised to the smallest normal where
  its exact value is positive.
- ``finish_log_bound(log_u, log_h, err, n_terms, ok)``: the one rounded-up
  log tail bound log(U / (Z_H + U)) from head and tail log masses.
- ``blockwise_log_bound_row(...)``: the log of the THEORY 3.3 bound for ONE
  row (``jaxtopk.theory.blockwise_log_bound`` is its vmapped public form),
  for code that vmaps rows itself.
- ``flushed``, ``subnormal``, ``norms_up``, ``norms_and_finite``,
  ``mul_up``, ``mul_norm_up``, ``dist_up``, ``pow2``, ``max_nan``: the
  float-safe
  primitives of ``_floats`` (norms and products that neither flush nor
  overflow; value norms stored compressed above 2^126).
"""

from jaxtopk.theory._blockwise import blockwise_log_bound_row
from jaxtopk.theory._floats import dist_up
from jaxtopk.theory._floats import flushed
from jaxtopk.theory._floats import max_nan
from jaxtopk.theory._floats import mul_norm_up
from jaxtopk.theory._floats import mul_up
from jaxtopk.theory._floats import norms_and_finite
from jaxtopk.theory._floats import norms_up
from jaxtopk.theory._floats import pow2
from jaxtopk.theory._floats import subnormal
from jaxtopk.theory._rows import compute_dtype
from jaxtopk.theory._rows import exp_up
from jaxtopk.theory._rows import finish_log_bound
from jaxtopk.theory._rows import log_slack
from jaxtopk.theory._rows import up_positive

__all__ = [
  "blockwise_log_bound_row",
  "compute_dtype",
  "dist_up",
  "exp_up",
  "finish_log_bound",
  "flushed",
  "log_slack",
  "max_nan",
  "mul_norm_up",
  "mul_up",
  "norms_and_finite",
  "norms_up",
  "pow2",
  "subnormal",
  "up_positive",
]
