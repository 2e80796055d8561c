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
  logits.

  Attributes:
    tv_bound: float32 upper bound on TV(P, P_hat) = tau, the softmax mass of
      the real (unmasked) keys that were dropped (THEORY 2.1). Never below the
      float64 truth where ``valid`` (deterministic policies), or with
      probability at least ``1 - failure_prob`` (MC-Search). NaN where not
      ``valid``.
    log_tv_bound: float32 log of ``tv_bound`` (-inf when nothing was dropped),
      accurate where ``tv_bound`` underflows.
    k_kept: int32 number of keys kept (attended to).
    keys_scored: int32 number of full q.k products computed for the row (block
      summaries are not counted; THEORY 6.4).
    output_error_bound: float32 upper bound on ||Attn - Attn_k||_2 (THEORY
      4.2/4.4), or None when the call was given no values.
    valid: bool; False where nothing can be certified (the row has no real
      key, or its logits are not finite). Other fields are then undefined.
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
