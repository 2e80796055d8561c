"""The Certificate: what a Top-k attention call proves about what it dropped.

THEORY 6.5. Every selection and attention call in jaxtopk returns one, for
every policy (a FixedK user learns what FixedK cost, not only a Certified one).
"""

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Certificate:
  """Per-row (per query and head) guarantee of a Top-k attention call.

  All arrays share one shape ``[...]``: for ``topk_attention`` that is
  ``[batch, q_len, num_heads]``, for ``select`` the leading axes of the
  logits. Computed by ``jaxtopk.selection.core`` on every path.

  What is bounded. For one row, let s_j = scale q.k_j + bias_j be the EXACT
  logits (real arithmetic on the float inputs as stored, subnormals
  included) of the real keys (mask True; a -inf logit is a key of zero
  mass), P = softmax(s), H the kept set and P_hat = P renormalised on H.
  Then tau = P(not H) = TV(P, P_hat) (THEORY 2.1), Attn = sum_j P_j v_j and
  Attn_k = sum_{j in H} P_hat_j v_j, both exact.

  What rounding is covered: the logits' (the d-term dot product, the scale
  multiply and the rounding of ``scale`` itself, the bias add, subnormal
  inputs and products that the CPU reads or flushes to 0; THEORY 3.4 via
  ``core.logit_error_bound``), and every sum, exp and log of the
  certificate's own computation (``core.log_slack``). For ``select``, the
  given logits are taken as exact.

  What is NOT covered: the rounding of the returned output itself once its
  weights are computed: the exps, sums and the weighted sum in the compute
  dtype (at most about (n_kept + 8 + merges) eps_compute max_{j in H}
  ||v_j||, a few ulps of that norm in practice) and the cast to the output
  dtype (half an ulp of each component: 2^-8 relative for bfloat16, 2^-11
  for float16). Bound the full error of a returned output by
  output_error_bound plus that. (How far the logits' own rounding moves
  the weights IS covered: see output_error_bound.)

  Attributes:
    tv_bound: float32 (float64 under x64) upper bound on tau, never below
      the exact value where ``valid`` (deterministic policies), or with
      probability at least ``1 - failure_prob`` (MC-Search). A positive
      bound below the smallest normal float is rounded up to it (CPUs
      flush subnormals); read ``log_tv_bound`` for tiny tails. It is 1 (a
      trivial, sound bound) where the logit rounding cannot be bounded
      (products that may overflow). NaN where not ``valid``.
    log_tv_bound: log of ``tv_bound``, accurate where ``tv_bound``
      underflows; where nothing real was dropped (``tv_bound`` 0) the most
      negative finite float, never -inf (``core.finite_log``: results hold
      no infinity under ``jax.debug_infs``). NaN where not ``valid``.
    k_kept: int32 number of kept real keys (of positive mass); 0 where not
      ``valid``.
    keys_scored: int32 cost of the row in units of one full-precision
      q.k (THEORY 6.4): every product computed, weighted by the share of
      the key's bytes it reads, rounded up. A key scored exactly counts 1
      (MC samples included); a product with a key's 8-bit code (THEORY
      3.5) counts (d + 1) / (d * itemsize) of a key stored in that dtype
      (33/128 at d = 32 in float32; the 32-key sample by which the default
      ``Auto`` chooses its strategy is counted so too); a rank-r projection
      (r + 2) / d; a block box 2 keys, a ball 1, a content group's ball 1
      plus 2 per row for the query's norms. Bytes read are keys_scored
      times d * itemsize. Paths that read nothing but the keys they score
      (the exact search) report the real keys.
    output_error_bound: upper bound on ||Attn - Attn_k||_2 (THEORY 4.2/4.4:
      tv_bound (max_{j in H} ||v_j|| + max_{j dropped} ||v_j||)) plus the
      distance from Attn_k to the attention weighted by the softmax of the
      COMPUTED kept logits (logits off by at most delta: 2 (1 - e^{-2
      delta}) max_{j in H} ||v_j||, ``core.logit_output_error``); rounded
      up, never 0 below a positive truth, +inf only when the bound exceeds
      the largest float or ``tv_bound`` is trivial; None when the call was
      given no values. NaN where not ``valid``.
    valid: bool, the row validity rule of ``core``: True iff the row keeps
      a real key of positive mass, none of its real keys has a NaN or +inf
      logit, the values of its real keys are finite, the output is finite
      and the scale is finite and > 0. A row with no real key (all masked,
      all -inf, kv_len = 0) is invalid. Where False nothing is certified:
      float fields are NaN, ``k_kept`` is 0 and the output is zeros.
    failure_prob: static float, the probability that the certificate fails;
      0.0 for deterministic policies, delta for MC-Search (THEORY 6.3).
  """

  tv_bound: jax.Array
  log_tv_bound: jax.Array
  k_kept: jax.Array
  keys_scored: jax.Array
  output_error_bound: jax.Array | None
  valid: jax.Array
  failure_prob: float = dataclasses.field(
    default=0.0, metadata=dict(static=True)
  )

  @property
  def shape(self) -> tuple[int, ...]:
    return jnp.shape(self.tv_bound)

  def summary(self) -> dict[str, float]:
    """Means and worst cases over valid rows, as Python floats (not jittable).

    Returns:
      dict with mean/max tv_bound, mean k_kept, mean keys_scored, mean/max
      output_error_bound (when present), the fraction of valid rows and
      failure_prob.
    """
    valid = jnp.asarray(self.valid)
    n_valid = jnp.maximum(jnp.sum(valid), 1)

    def mean(x):
      return float(jnp.sum(jnp.where(valid, x, 0)) / n_valid)

    def worst(x):
      return float(jnp.max(jnp.where(valid, x, -jnp.inf), initial=-jnp.inf))

    out = {
      "tv_bound_mean": mean(self.tv_bound),
      "tv_bound_max": worst(self.tv_bound),
      "k_kept_mean": mean(self.k_kept),
      "keys_scored_mean": mean(self.keys_scored),
      "valid_fraction": float(jnp.mean(valid)),
      "failure_prob": float(self.failure_prob),
    }
    if self.output_error_bound is not None:
      out["output_error_bound_mean"] = mean(self.output_error_bound)
      out["output_error_bound_max"] = worst(self.output_error_bound)
    return out
