"""The in-kernel pieces shared by both grid styles of the decode kernel.

One query (per head and split) scores one cache block with the certificate
core's ``online_step`` (normalised output, rounding tracked), and the
Delta-Search stopping rule decides whether the split may stop (THEORY 6.2).
Written for refs of shape ``[bk, d]`` (keys), ``[bk, dv]`` (values) and
``[bk, 1]`` (key validity), as both ``_decode_tpu`` and ``_decode_gpu``
load them.
"""

import jax.numpy as jnp

from jaxtopk.kernels import _common
from jaxtopk.selection import core


def init(dv: int):
  """Empty running statistics (m, denom, o, err) of one query."""
  return (
    jnp.full((1, 1), _common.MASK_VALUE, jnp.float32),
    jnp.zeros((1, 1), jnp.float32),
    jnp.zeros((1, dv), jnp.float32),
    jnp.zeros((1, 1), jnp.float32),
  )


def score_block(q, k, v, kvm, carry, scale):
  """One block for one query: q ``[1, d]``, k ``[bk, d]``, v ``[bk, dv]``.

  Full float32 products (an elementwise multiply and a sum: no matmul unit
  precision to choose), then ``core.online_step`` over the block's keys.
  """
  s = (
    jnp.sum(
      k.astype(jnp.float32) * q.astype(jnp.float32), axis=1, keepdims=True
    )
    * scale
  )  # [bk, 1]
  valid = kvm != 0  # [bk, 1]
  vf = v.astype(jnp.float32)

  def pv(p):  # [bk, 1] -> [1, dv]
    return jnp.sum(p * vf, axis=0, keepdims=True)

  return core.online_step(
    *carry, s, valid, pv, mask_value=_common.MASK_VALUE, axis=0
  )


def stop(rest_j, m, denom, log_c, log_f):
  """Delta-Search rule of one split: remaining bound <= c (Z_s + F_s) (logs).

  ``rest_j`` bounds the mass of the split's blocks after this one (their
  EXACT logits), m + log(denom) is log Z_s of the scored keys, log F_s the
  split's share of the floor (``_decode.split_levels``; -inf for none), and
  c = e^t / (1 - e^t) with t = log eps minus the certificate's margin: if
  every split stops this way, the shares sum to at most Z and tau <= U /
  (Z + U) <= e^t.
  """
  log_z = m + jnp.log(jnp.maximum(denom, jnp.finfo(jnp.float32).tiny))
  return rest_j <= log_c + jnp.logaddexp(log_z, log_f)
