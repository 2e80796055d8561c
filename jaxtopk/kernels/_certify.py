"""Merge kernel statistics into a ``jaxtopk.Certificate`` (THEORY 3.3, 4, 6.5).

The kernels emit softmax statistics of what they scored (log Z_H of the kept
keys, exact block masses, or partial (o, l, m)) and the wrappers know which
blocks were dropped. The certificate is

  tau <= U / (Z_H + U),   U = sum_{dropped blocks b} M_b     (THEORY 2.4, 3.3)

where M_b is an upper bound on the block's mass: its exact mass e^{lse_b}
(prefill, from ``block_stats``) or |B_b| e^{u_b} with u_b a sound box bound
(decode, unscored blocks). Because logits computed from q and k in float32
may be off by up to ``slack_b`` = (d + 3) eps32 scale sum_c |q_c| max|k_c|
(``_common.logit_slack``), tail masses are raised by e^{slack_b} and the head
mass lowered by e^{-max slack} (tail up, head down); a log-space slack for
the float32 reductions is added last (``theory._tail.log_slack``).

The output-error bound is THEORY 4.2 with 4.4:
||Attn - Attn_k|| <= tau_bound (||mu_head|| + max_{j dropped} ||v_j||).
"""

import jax
import jax.numpy as jnp
from jax.scipy.special import logsumexp

from jaxtopk.selection import Certificate
from jaxtopk.selection import _certify as _select_certify
from jaxtopk.theory import _tail


def block_value_norms(value, *, block_size: int, mask=None) -> jax.Array:
  """``[b, h_kv, n_blocks]`` max ||v_j|| over a block's real keys, rounded up.

  Args:
    value: ``[b, h_kv, kv_len, v_dim]``.
    block_size: keys per block.
    mask: optional ``[b, kv_len]`` bool, True for a real key.
  """
  b, hkv, n, _ = value.shape
  nb = -(-n // block_size)
  pad = nb * block_size - n
  v = jnp.pad(value.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0)))
  norms = _select_certify.value_norms(v)  # [b, hkv, n_p], rounded up
  if mask is not None:
    m = jnp.pad(jnp.asarray(mask, bool), ((0, 0), (0, pad)))
    norms = jnp.where(m[:, None, :], norms, 0.0)
  return norms.reshape(b, hkv, nb, block_size).max(axis=-1)


def certificate(
  *,
  log_head,
  head_slack,
  log_tail_terms,
  tail_present,
  k_kept,
  keys_scored,
  n_terms: int,
  out_norm=None,
  tail_value_norm=None,
  out_dtype=jnp.float32,
) -> Certificate:
  """Builds a Certificate from head and tail log masses, shape ``[...]``.

  Args:
    log_head: ``[...]`` float32 log Z_H as computed (may be -inf).
    head_slack: ``[...]`` float32 >= 0 logit slack of the kept keys.
    log_tail_terms: ``[..., n_blocks]`` float32 log upper bounds on the mass
      of each dropped block, slack included.
    tail_present: ``[..., n_blocks]`` bool, the block is dropped and holds
      real keys (only these enter U).
    k_kept: ``[...]`` int32 kept real keys.
    keys_scored: ``[...]`` int32 q.k products computed.
    n_terms: number of float terms reduced (for the rounding slack).
    out_norm: optional ``[...]`` ||o|| of the computed output.
    tail_value_norm: optional ``[...]`` max ||v_j|| over dropped keys.
    out_dtype: dtype the output was rounded to (inflates ``out_norm``).

  Returns:
    Certificate with fields of shape ``[...]``; valid where some real key
    was kept and Z_H is finite.
  """
  log_u = logsumexp(
    jnp.where(tail_present, log_tail_terms, 0.0), axis=-1, where=tail_present
  )
  log_h = log_head - head_slack
  log_tau = log_u - jnp.logaddexp(log_h, log_u)
  log_tau = log_tau + _tail.log_slack(n_terms, jnp.float32)
  log_tau = jnp.where(jnp.any(tail_present, axis=-1), log_tau, -jnp.inf)
  log_tau = jnp.minimum(log_tau, 0.0)
  valid = (k_kept > 0) & jnp.isfinite(log_head)
  nan = jnp.full_like(log_tau, jnp.nan)
  # exp underflows (and XLA CPU flushes subnormals) far below the float32
  # range: round such a bound up to the smallest normal float, not to 0.
  tiny = float(jnp.finfo(jnp.float32).tiny)
  tv = jnp.where(jnp.isfinite(log_tau), jnp.maximum(jnp.exp(log_tau), tiny), 0)
  tv = jnp.where(valid, tv, nan)
  log_tau = jnp.where(valid, log_tau, nan)
  err = None
  if out_norm is not None:
    rel = 4 * float(jnp.finfo(out_dtype).eps) + 1e-6
    spread = out_norm * (1 + rel) + tail_value_norm
    err = jnp.where(tv > 0, tv * spread * (1 + 1e-6), 0.0)
    err = jnp.where(valid, err, nan)
  return Certificate(
    tv_bound=tv,
    log_tv_bound=log_tau,
    k_kept=k_kept.astype(jnp.int32),
    keys_scored=keys_scored.astype(jnp.int32),
    output_error_bound=err,
    valid=valid,
  )
