"""Test helpers: simulated key shards (vmap) and float64 dense truth."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from scipy.special import logsumexp

from jaxtopk import parallel


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
  """float64 truth for a kept set: (tau, output error, top-k output).

  Args are head-major numpy-convertible; ``keep`` and ``valid`` are bool
  ``[b, h, t, n]``. Returns tau ``[b, h, t]`` (NaN for a row without a real
  key), the exact output error ||Attn - Attn_k|| ``[b, h, t]`` and the
  attention over ``keep`` ``[b, h, t, e]``. The error is computed from
  THEORY 4.1, tau * ||mu_tail - mu_head||, which stays accurate where
  subtracting two float64 attention outputs would not (large logits).
  """
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
  s = np.einsum("bhtd,bhsd->bhts", q, k) * scale
  valid = np.broadcast_to(np.asarray(valid, bool), s.shape)
  keep = np.asarray(keep, bool) & valid
  tail = valid & ~keep

  def softmax_mean(where):
    lse = logsumexp(np.where(where, s, -np.inf), axis=-1, keepdims=True)
    p = np.where(where, np.exp(np.where(where, s - lse, -np.inf)), 0.0)
    return lse[..., 0], np.einsum("bhts,bhse->bhte", p, v)

  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    lse_all, _ = softmax_mean(valid)
    lse_tail, mu_tail = softmax_mean(tail)
    _, mu_head = softmax_mean(keep)
    tau = np.exp(lse_tail - lse_all)
  err = np.where(tau > 0, tau * np.linalg.norm(mu_tail - mu_head, axis=-1), 0.0)
  return tau, err, mu_head
