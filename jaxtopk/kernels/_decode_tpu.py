"""The decode kernel on a TPU grid: (query head, split, position).

Ordered block indices, live counts, remaining bounds and stopping levels are
scalar-prefetched (``PrefetchScalarGridSpec``) and drive the K/V index maps,
so each grid step DMAs the split's next block; the running statistics live
in VMEM scratch across the position axis (splash attention's pattern). Once
a split has stopped, its remaining steps skip all compute, but the pipeline
still fetches their blocks (a manual-DMA version would not).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

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
  m_sc,
  l_sc,
  o_sc,
  e_sc,
  st_sc,
  *,
  num_splits,
  bps,
  scale,
):
  i, s, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  row = i * num_splits + s

  @pl.when(j == 0)
  def _init():
    m0, l0, o0, e0 = _decode_step.init(o_sc.shape[1])
    m_sc[...] = m0
    l_sc[...] = l0
    o_sc[...] = o0
    e_sc[...] = e0
    st_sc[0] = 0  # positions scored
    st_sc[1] = 0  # stopped

  @pl.when((st_sc[1] == 0) & (j < live_ref[row]))
  def _step():
    m, ell, o, err = _decode_step.score_block(
      q_ref[...],
      k_ref[...],
      v_ref[...],
      kvm_ref[...],
      (m_sc[...], l_sc[...], o_sc[...], e_sc[...]),
      scale,
    )
    m_sc[...] = m
    l_sc[...] = ell
    o_sc[...] = o
    e_sc[...] = err
    st_sc[0] = j + 1
    stop = _decode_step.stop(
      rest_ref[row * bps + j], m[0, 0], ell[0, 0], logc_ref[row], logf_ref[row]
    )
    st_sc[1] = stop.astype(jnp.int32)

  @pl.when(j == bps - 1)
  def _out():
    o_out[...] = o_sc[...]
    m_out[...] = m_sc[...]
    l_out[...] = l_sc[...]
    e_out[...] = e_sc[...]
    n_out[...] = jnp.full(n_out.shape, st_sc[0], jnp.int32)


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
  """Runs the TPU-grid kernel; arguments as ``_decode._run_kernel``.

  Returns per (query head, split) ``(o [bh, S, 1, dv], m, denom, err
  [bh, S, 1, 1] float32, scored positions [bh, S, 1, 1] int32)``.
  """
  bh, ns, bps = order.shape
  d, dv = q.shape[-1], vp.shape[-1]
  bk = block_k

  def kv_row(i):
    return _common.kv_row(i, heads, kv_heads)

  def kv_map(i, s, j, order_ref, *_):
    return (kv_row(i), order_ref[(i * ns + s) * bps + j], 0)

  def kvm_map(i, s, j, order_ref, *_):
    return (lax.div(i, heads), order_ref[(i * ns + s) * bps + j], 0)

  def out_map(i, s, j, *_):
    return (i, s, 0, 0)

  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=5,
    grid=(bh, ns, bps),
    in_specs=[
      pl.BlockSpec((None, 1, d), lambda i, s, j, *_: (i, 0, 0)),
      pl.BlockSpec((None, bk, d), kv_map),
      pl.BlockSpec((None, bk, dv), kv_map),
      pl.BlockSpec((None, bk, 1), kvm_map),
    ],
    out_specs=[pl.BlockSpec((None, None, 1, dv), out_map)]
    + [pl.BlockSpec((None, None, 1, 1), out_map)] * 4,
    scratch_shapes=[
      pltpu.VMEM((1, 1), jnp.float32),
      pltpu.VMEM((1, 1), jnp.float32),
      pltpu.VMEM((1, dv), jnp.float32),
      pltpu.VMEM((1, 1), jnp.float32),
      pltpu.SMEM((2,), jnp.int32),
    ],
  )
  stat = jax.ShapeDtypeStruct((bh, ns, 1, 1), jnp.float32)
  out_shape = [
    jax.ShapeDtypeStruct((bh, ns, 1, dv), jnp.float32),
    stat,
    stat,
    stat,
    jax.ShapeDtypeStruct((bh, ns, 1, 1), jnp.int32),
  ]
  kernel = functools.partial(_kernel, num_splits=ns, bps=bps, scale=scale)
  return pl.pallas_call(
    kernel,
    grid_spec=grid_spec,
    out_shape=out_shape,
    compiler_params=_common.compiler_params(
      "tpu", ("parallel", "parallel", "arbitrary")
    ),
    interpret=interpret,
    name="jaxtopk_certified_decode",
  )(
    order.reshape(-1),
    live.reshape(-1),
    rest.reshape(-1),
    log_c.reshape(-1),
    log_f.reshape(-1),
    q,
    kp,
    vp,
    kvm,
  )
