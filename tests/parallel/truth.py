"""Test helpers: simulated key shards (vmap); the truth is the contract's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtopk import parallel
from tests.contract import reference


def split_kv(x, n_shards, axis=2):
  """Splits ``axis`` into ``n_shards`` contiguous slices, stacked first.

  ``[b, h, n, d]`` -> ``[n_shards, b, h, n / n_shards, d]`` for axis 2.
  """
  shape = x.shape
  x = x.reshape(
    *shape[:axis], n_shards, shape[axis] // n_shards, *shape[axis + 1 :]
  )
  return jnp.moveaxis(x, axis, 0)


@functools.cache
def simulator(policy, n_shards, scale, n):
  def fn(q, k_, v_, m_):
    return parallel.kv_shard_attention(
      q,
      k_,
      v_,
      m_,
      policy=policy,
      scale=scale,
      axis_name="kv",
      n_total=n,
      return_keep=True,
    )

  return jax.jit(jax.vmap(fn, in_axes=(None, 0, 0, 0), axis_name="kv"))


def simulated_kv_attention(q, k, v, valid, *, policy, n_shards, scale=None):
  """kv_shard_attention over ``n_shards`` simulated shards (vmap axis).

  Args are head-major: q ``[b, h, t, d]``, k/v ``[b, h, n, .]``, valid
  ``[b, h, t, n]``. Returns (output, certificate, keep ``[b, h, t, n]``) from
  shard 0, after checking every shard returned the same output and
  certificate.
  """
  n = k.shape[2]
  scale = float(1.0 / np.sqrt(q.shape[-1]) if scale is None else scale)
  valid = jnp.broadcast_to(valid, (*q.shape[:3], n))
  out, cert, keep = simulator(policy, n_shards, scale, n)(
    q,
    split_kv(k, n_shards),
    split_kv(v, n_shards),
    split_kv(valid, n_shards, axis=3),
  )
  for x in jax.tree.leaves((out, cert)):
    x = np.asarray(x)
    np.testing.assert_array_equal(x, np.broadcast_to(x[:1], x.shape))
  keep = jnp.concatenate(list(keep), axis=-1)  # [b, h, t, n]
  return jax.tree.map(lambda x: x[0], (out, cert)) + (keep,)


def dense_truth(q, k, v, valid, keep, scale=None):
  """The float64 truth of a kept set (``tests.contract.reference``).

  Args are head-major numpy-convertible; ``keep`` and ``valid`` are bool
  ``[b, h, t, n]``. Returns tau ``[b, h, t]`` (0 for a row without a real
  key), the exact output error ||Attn - Attn_k|| ``[b, h, t]`` and the
  attention over ``keep`` ``[b, h, t, e]``.
  """
  scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
  t = reference.Truth(q, k, v, scale=scale, mask=valid)
  keep = np.asarray(keep, bool)
  return (
    np.asarray(t.tau(keep), np.float64),
    np.asarray(t.output_error(keep), np.float64),
    np.asarray(t.kept_attention(keep), np.float64),
  )
