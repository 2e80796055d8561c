"""The certificate core: the one place where certificate math is computed.

A documented internal API (a package by concept: ``_numerics``,
``_logit_error``, ``_finish``, ``_softmax``) for every layer above
``jaxtopk.selection``
(attention, kernels, parallel, nn, models): ``from jaxtopk.selection import
core``. Each formula lives here once; a path that needs a rounding bound, a
norm, a tail mass, a Certificate or a merge of partial softmax statistics
calls it instead of writing its own.

Contract (every function):

- Math in ``compute_dtype`` (float32; float64 for float64 input under x64);
  jit-, vmap- and grad-safe (bounds are computed on stop-gradient values by
  the callers); shape-polymorphic over leading axes ``[...]``.
- SOUND: a bound is never below the value it bounds computed in exact
  (float64 / 80-bit) arithmetic from the float inputs, for every input from
  subnormal to near overflow. XLA on CPU reads subnormal inputs as 0 and
  flushes subnormal results to 0; every bound here accounts for both: a
  positive bound never reads 0 (it is raised to the smallest normal), a
  product of bounds never overflows to a wrong finite value nor loses a
  large value to a flushed intermediate (a product whose partial product
  may be subnormal while the next factor is large, like the ball term scale
  ||q|| r, is formed by ``mul_up``; elsewhere a flushed product is below
  tiny times a scale, which the bounds' tiny terms cover), and norms scale
  by exact powers of two (never by a reciprocal that could be subnormal).
  Every product of the inputs a certificate rests on runs at
  ``PRECISION`` (full float32 passes), on CPU, GPU and TPU alike.
- An honest bound that overflows is +inf. A +inf logit error makes the
  certificate TRIVIAL (tv_bound = 1, output_error_bound = +inf), which is
  sound; it is still ``valid``.

Row validity (``row_valid``), the rule every path uses:

- A key is REAL when its mask is True (padding and causal masks False).
- A real key whose logit is -inf (e.g. ``bias=-inf``) has zero mass: it is
  neither kept nor dropped, as in ``jax.nn.dot_product_attention``.
- A row is valid iff it keeps at least one real key of positive mass
  (finite logit), none of its real keys has a NaN or +inf logit, the values
  of its real keys are finite (when values enter), the computed output is
  finite, and the logit scale is finite and >= ``MIN_SCALE``. On an invalid
  row the certificate's float fields are NaN, ``k_kept`` is 0, and the
  output is undefined (paths return zeros).

Names (one line each):

- ``compute_dtype(dtype)``: float32, or float64 for float64.
- ``log_slack(n_terms, dtype)``: log-space round-up for a reduction of n
  nonnegative terms (THEORY 3.4; the one definition lives in theory).
- ``exp_up(log_b)``: exp of a log bound, never below it (>= tiny if > -inf).
- ``up_positive(x, positive)``: ``x`` raised to the smallest normal where
  its exact value is positive.
- ``round_up(x)`` / ``round_down(x)``: past the rounding of the one float
  operation that made ``x`` (2 eps relative plus the smallest normal, for
  a flushed result); the rule every per-key bound applies per operation.
- ``pow2(e, dtype)``: 2**e exactly (no exp2 rounding, no reciprocal).
- ``max_nan(x, axis)``: a max reduction that keeps NaN (XLA:CPU's does
  not): every summary that must carry a broken input uses it.
- ``flushed(x, axis)``: whether a vector holds subnormal components that a
  CPU reads as 0.
- ``norms_up(x, axis)``: ||x||_2 rounded up, no underflow, no spurious
  overflow.
- ``value_norms(v)``: ``norms_up`` over the last axis with NaN marking a
  non-finite value (that row is invalid); stored compressed above 2^126,
  so never +inf for a finite value (``mul_norm_up(t, y)``: t times a
  stored norm, rounded up).
- ``max_norm(norms, where)``: the largest norm over a set (0 if empty).
- ``abs_dot_box(q, k_absmax)``: sum_c |q_c| max_i |k_ic| rounded up (the
  box form of the dot-product magnitude).
- ``logit_error_bound(...)``: |computed scale q.k (+ bias) - exact| for
  every key of a row.
- ``PartialSoftmax``: partial softmax statistics (normalised output, head and
tail
  masses, counts, norms); ``merge``, ``PartialSoftmax.reduce``, ``finalize``;
  ``PartialSoftmax.from_stats`` for masses summed elsewhere (a kernel).
- ``online_step(...)``: one block of a flash loop, elementwise (the form of
  ``merge`` a Pallas kernel body runs).
- ``tail_log_bound(...)``: log tau from head and tail log masses, rounded up.
- ``output_error_bound(tv, head_norm, tail_norm)``: THEORY 4.2 + 4.4.
- ``logit_output_error(logit_error, head_norm)``: how far logits off by
  delta move the computed output from Attn_k (added by
  ``finish_certificate``).
- ``logit_error_of(q, k, real, *, scale)``: that bound from the inputs.
- ``finite_log(log_x)``: -inf (the log of 0) as the most negative finite
  float, for logs that leave the library (no inf under jax.debug_infs).
- ``finish_certificate(...)``: log tv + validity + counts -> Certificate.
- ``certificate_from_logits(...)``: the Certificate of a kept set when every
  logit of the row is known.
- ``search_log_margin(...)``: how far below log eps a search must aim so
  that the finished certificate is <= eps.
- ``row_valid(...)``, ``logits_ok(...)``: the validity rule above;
  ``scale_ok(scale)``: its scale condition; ``mark_invalid(cert, bad)``: a
  finished Certificate's rows made invalid by it.
- ``PRECISION``: the matmul precision of every product a certificate is
  computed from (full float32 passes on GPU and TPU).
- ``MIN_SCALE``: the smallest logit scale covered (float32's smallest
  normal).
- ``mul_up(*factors)``: a product of nonnegative factors rounded up, no
  intermediate flush or overflow (for products whose partial product may
  flush while the next factor is large); ``dist_up(x, c)``: ||x - c||
  rounded up (ball radii). Both, with ``flushed``, ``norms_up`` and
  ``mul_norm_up``, are defined in ``jaxtopk.theory`` (its ``_floats``),
  below both layers.
"""

from jaxtopk.selection.core._finish import finish_certificate
from jaxtopk.selection.core._finish import log_sum_exp_residual
from jaxtopk.selection.core._finish import logits_ok
from jaxtopk.selection.core._finish import mark_invalid
from jaxtopk.selection.core._finish import output_error_bound
from jaxtopk.selection.core._finish import row_valid
from jaxtopk.selection.core._finish import scale_ok
from jaxtopk.selection.core._finish import tail_log_bound
from jaxtopk.selection.core._logit_error import abs_dot_box
from jaxtopk.selection.core._logit_error import logit_error_bound
from jaxtopk.selection.core._logit_error import logit_error_of
from jaxtopk.selection.core._logit_error import logit_output_error
from jaxtopk.selection.core._logit_error import search_log_margin
from jaxtopk.selection.core._numerics import MIN_SCALE
from jaxtopk.selection.core._numerics import PRECISION
from jaxtopk.selection.core._numerics import compute_dtype
from jaxtopk.selection.core._numerics import dist_up
from jaxtopk.selection.core._numerics import exp_up
from jaxtopk.selection.core._numerics import finite_log
from jaxtopk.selection.core._numerics import flushed
from jaxtopk.selection.core._numerics import log_slack
from jaxtopk.selection.core._numerics import max_nan
from jaxtopk.selection.core._numerics import max_norm
from jaxtopk.selection.core._numerics import mul_norm_up
from jaxtopk.selection.core._numerics import mul_up
from jaxtopk.selection.core._numerics import norms_up
from jaxtopk.selection.core._numerics import pow2
from jaxtopk.selection.core._numerics import round_down
from jaxtopk.selection.core._numerics import round_up
from jaxtopk.selection.core._numerics import up_positive
from jaxtopk.selection.core._numerics import value_norms
from jaxtopk.selection.core._softmax import PartialSoftmax
from jaxtopk.selection.core._softmax import certificate_from_logits
from jaxtopk.selection.core._softmax import merge
from jaxtopk.selection.core._softmax import online_step

__all__ = [
  "abs_dot_box",
  "certificate_from_logits",
  "compute_dtype",
  "dist_up",
  "exp_up",
  "finish_certificate",
  "finite_log",
  "flushed",
  "log_slack",
  "log_sum_exp_residual",
  "logit_error_bound",
  "logit_error_of",
  "logit_output_error",
  "logits_ok",
  "mark_invalid",
  "max_nan",
  "max_norm",
  "merge",
  "MIN_SCALE",
  "mul_norm_up",
  "mul_up",
  "norms_up",
  "online_step",
  "output_error_bound",
  "PartialSoftmax",
  "pow2",
  "PRECISION",
  "round_down",
  "round_up",
  "row_valid",
  "scale_ok",
  "search_log_margin",
  "tail_log_bound",
  "up_positive",
  "value_norms",
]
