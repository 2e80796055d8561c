"""The decode kernel on a GPU grid: (query head, split).

Each program loops over its split's live positions (``fori_loop`` with a
dynamic trip count, lowered to ``scf.for``), slicing K/V with ``pl.ds`` from
the whole head's refs (Triton). Once the Delta-Search rule holds, a
``lax.cond`` skips the remaining positions: no block is read after the stop
(a position then costs one scalar compare). A ``while_loop`` whose condition
reads the stop flag (``scf.while`` with tensor carries) lowered but crashed
the XLA Triton compiler on an H100, hence this form.

Head and value dims reach the kernel padded to a power of 2 (``_decode``,
``_common.pad_last_for_triton``).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxtopk.kernels import _common
from jaxtopk.kernels import _decode_step


def _kernel(
  order_ref,
  live_ref,
  rest_ref,
  logc_ref,
  logf_ref,
  q_ref,
  k_ref,
  v_ref,
  kvm_ref,
  o_out,
  m_out,
  l_out,
  e_out,
  n_out,
  *,
  bk,
  scale,
):
  q = q_ref[...]
  dv = v_ref.shape[-1]
  n_live = live_ref[0]
  log_c, log_f = logc_ref[0], logf_ref[0]

  def body(j, c):
    def score(c):
      _, n, *carry = c
      start = pl.multiple_of(order_ref[j] * bk, bk)
      m, ell, o, err = _decode_step.score_block(
        q,
        k_ref[pl.ds(start, bk), :],
        v_ref[pl.ds(start, bk), :],
        kvm_ref[pl.ds(start, bk), :],
        tuple(carry),
        scale,
      )
      stop = _decode_step.stop(
        rest_ref[j], jnp.max(m), jnp.max(ell), log_c, log_f
      )
      return stop.astype(jnp.int32), n + 1, m, ell, o, err

    return lax.cond(c[0] == 0, score, lambda c: c, c)

  # (stopped, positions scored, m, denom, o, err)
  init = (jnp.int32(0), jnp.int32(0), *_decode_step.init(dv))
  _, n, m, ell, o, err = lax.fori_loop(0, n_live, body, init)
  o_out[...] = o
  m_out[...] = m
  l_out[...] = ell
  e_out[...] = err
  n_out[...] = jnp.full(n_out.shape, n, jnp.int32)


def run(
  q,
  kp,
  vp,
  kvm,
  order,
  live,
  rest,
  log_c,
  log_f,
  *,
  heads,
  kv_heads,
  block_k,
  scale,
  interpret,
):
  """Runs the GPU-grid kernel; arguments and results as ``_decode_tpu.run``."""
  bh, ns, bps = order.shape
  d, dv = q.shape[-1], vp.shape[-1]
  n_p = kp.shape[1]

  def kv_row(i):
    return _common.kv_row(i, heads, kv_heads)

  def out_map(i, s):
    return (i, s, 0, 0)

  stat = jax.ShapeDtypeStruct((bh, ns, 1, 1), jnp.float32)
  out_shape = [
    jax.ShapeDtypeStruct((bh, ns, 1, dv), jnp.float32),
    stat,
    stat,
    stat,
    jax.ShapeDtypeStruct((bh, ns, 1, 1), jnp.int32),
  ]
  kernel = functools.partial(_kernel, bk=block_k, scale=scale)
  return pl.pallas_call(
    kernel,
    grid=(bh, ns),
    in_specs=[
      pl.BlockSpec((None, None, bps), lambda i, s: (i, s, 0)),
      pl.BlockSpec((None, 1), lambda i, s: (i, s)),
      pl.BlockSpec((None, None, bps), lambda i, s: (i, s, 0)),
      pl.BlockSpec((None, 1), lambda i, s: (i, s)),
      pl.BlockSpec((None, 1), lambda i, s: (i, s)),
      pl.BlockSpec((None, 1, d), lambda i, s: (i, 0, 0)),
      pl.BlockSpec((None, n_p, d), lambda i, s: (kv_row(i), 0, 0)),
      pl.BlockSpec((None, n_p, dv), lambda i, s: (kv_row(i), 0, 0)),
      pl.BlockSpec((None, n_p, 1), lambda i, s: (lax.div(i, heads), 0, 0)),
    ],
    out_specs=[pl.BlockSpec((None, None, 1, dv), out_map)]
    + [pl.BlockSpec((None, None, 1, 1), out_map)] * 4,
    out_shape=out_shape,
    compiler_params=_common.compiler_params("gpu", ()),
    interpret=interpret,
    name="jaxtopk_certified_decode",
  )(order, live, rest, log_c, log_f, q, kp, vp, kvm)
