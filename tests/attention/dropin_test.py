"""topk_attention as a drop-in for jax.nn.dot_product_attention.

Positional bias and mask, unbatched inputs and vmap, sequence lengths and
local windows (masks, in the output and the certificate alike), the
log-sum-exp residual, and the two jax configurations a drop-in must survive:
rank promotion 'raise' and ``jax.debug_infs``.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

import jaxtopk
from jaxtopk.attention import _topk
from tests import rand
from tests.tolerances import tol

B, T, H, HKV, S, D = 2, 5, 4, 2, 11, 3  # every axis a different size
DENSE = ("dense", jaxtopk.Dense())
FIXED_K = ("fixed_k", jaxtopk.FixedK(3))
CERTIFIED = ("certified", jaxtopk.Certified(0.1))
# The block-search engine (the others score every key).
DELTA = ("delta", jaxtopk.Certified(0.1, jaxtopk.DeltaSearch(block_size=4)))
Q_LENS = np.array([3, 5], np.int32)
KV_LENS = np.array([11, 6], np.int32)
WINDOW = (2, 1)


def _qkv(seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = rand.normal(kq, (B, T, H, D))
  k = rand.normal(kk, (B, S, HKV, D))
  v = rand.normal(kv, (B, S, HKV, D))
  return q, k, v


def _structure_mask(causal=True):
  """``[b, 1, t, s]`` bool: Q_LENS, KV_LENS, WINDOW (and causal) as a mask."""
  i = np.arange(T)[:, None]
  j = np.arange(S)[None, :]
  m = (j >= i - WINDOW[0]) & (j <= i + WINDOW[1])
  if causal:
    m &= j <= i
  m = m[None] & (i < Q_LENS[:, None, None]) & (j < KV_LENS[:, None, None])
  return jnp.asarray(m[:, None])


class DropInTest(parameterized.TestCase):
  def test_bias_and_mask_are_positional(self):
    q, k, v = _qkv()
    bias = rand.normal(5, (1, H, T, S))
    mask = _structure_mask()
    pol = jaxtopk.Dense()
    a = jaxtopk.topk_attention(q, k, v, bias, mask, policy=pol)
    b = jaxtopk.topk_attention(q, k, v, mask=mask, bias=bias, policy=pol)
    jax.tree.map(np.testing.assert_array_equal, a, b)

  def test_unbatched_inputs_and_vmap(self):
    q, k, v = _qkv()
    pol = jaxtopk.Dense()
    kw = dict(policy=pol, is_causal=True, return_residual=True)
    out, lse, cert = jaxtopk.topk_attention(
      q, k, v, query_seq_lengths=Q_LENS, **kw
    )
    one = jaxtopk.topk_attention(
      q[1], k[1], v[1], query_seq_lengths=Q_LENS[1], **kw
    )
    self.assertEqual(one[0].shape, (T, H, D))
    self.assertEqual(one[1].shape, (T, H))
    self.assertEqual(one[2].k_kept.shape, (T, H))
    mapped = jax.vmap(
      lambda q, k, v, n: jaxtopk.topk_attention(
        q, k, v, query_seq_lengths=n, **kw
      )
    )(q, k, v, Q_LENS)
    for got, want in zip(
      jax.tree.leaves(mapped), jax.tree.leaves((out, lse, cert)), strict=True
    ):
      np.testing.assert_allclose(got, want, **tol(jnp.float32))
    for got, want in zip(
      jax.tree.leaves(one),
      jax.tree.leaves(jax.tree.map(lambda x: x[1], (out, lse, cert))),
      strict=True,
    ):
      np.testing.assert_allclose(got, want, **tol(jnp.float32))

  @parameterized.named_parameters(FIXED_K, DELTA)
  def test_lengths_and_window_are_masks(self, policy):
    # The same real keys given as arguments or as a mask: the same output,
    # the same certificate (the hidden keys are not keys of the row).
    q, k, v = _qkv(1)
    out, lse, cert = jaxtopk.topk_attention(
      q,
      k,
      v,
      is_causal=True,
      query_seq_lengths=Q_LENS,
      key_value_seq_lengths=KV_LENS,
      local_window_size=WINDOW,
      return_residual=True,
      policy=policy,
    )
    out2, lse2, cert2 = jaxtopk.topk_attention(
      q, k, v, None, _structure_mask(), return_residual=True, policy=policy
    )
    np.testing.assert_allclose(out, out2, **tol(jnp.float32))
    np.testing.assert_allclose(lse, lse2, **tol(jnp.float32))
    for name in ("k_kept", "keys_scored", "valid"):
      np.testing.assert_array_equal(
        getattr(cert, name), getattr(cert2, name), err_msg=name
      )
    for name in ("tv_bound", "output_error_bound"):
      np.testing.assert_allclose(
        getattr(cert, name), getattr(cert2, name), rtol=1e-6, err_msg=name
      )
    # Rows past their query length attend to nothing.
    past = np.arange(T)[None, :] >= Q_LENS[:, None]  # [b, t]
    self.assertFalse(bool(jnp.any(cert.valid[past])))
    np.testing.assert_array_equal(out[past], 0.0)

  def test_dense_matches_jax_nn_with_every_argument(self):
    q, k, v = _qkv(2)
    kv = [jnp.repeat(x, H // HKV, axis=2) for x in (k, v)]
    bias = rand.normal(6, (1, H, T, S))
    kw = dict(
      is_causal=True,
      key_value_seq_lengths=KV_LENS,
      local_window_size=WINDOW,
      return_residual=True,
      scale=0.7,
    )
    out, lse, cert = jaxtopk.topk_attention(
      q, k, v, bias, policy=jaxtopk.Dense(), **kw
    )
    ref, ref_lse = jax.nn.dot_product_attention(q, *kv, bias, **kw)
    np.testing.assert_allclose(out, ref, **tol(jnp.float32))
    np.testing.assert_allclose(lse, ref_lse, **tol(jnp.float32))
    np.testing.assert_array_equal(cert.tv_bound, 0.0)

  @parameterized.named_parameters(CERTIFIED)
  def test_lse_is_that_of_the_kept_logits(self, policy):
    q, k, v = _qkv(3)
    mask = _structure_mask(causal=False)
    _, lse, _ = jaxtopk.topk_attention(
      q, k, v, None, mask, return_residual=True, policy=policy
    )
    _, _, keep = _topk.xla_topk_attention_with_keep(
      q, k, v, mask=mask, policy=policy
    )
    q64, k64 = (np.asarray(x, np.float64) for x in (q, k))
    k64 = np.repeat(k64, H // HKV, axis=2)
    s = np.einsum("bthd,bshd->bhts", q64, k64) / np.sqrt(D)
    s = np.where(np.asarray(keep), s, -np.inf)
    m = s.max(-1, keepdims=True)
    with np.errstate(invalid="ignore"):
      want = (m[..., 0] + np.log(np.exp(s - m).sum(-1))).transpose(0, 2, 1)
    has = np.isfinite(want)
    np.testing.assert_allclose(np.asarray(lse)[has], want[has], rtol=1e-5)
    # A row that keeps nothing: the most negative float, never -inf.
    np.testing.assert_array_equal(
      np.asarray(lse)[~has], np.finfo(np.float32).min
    )
    self.assertTrue((~has).any())

  @parameterized.named_parameters(
    ("window_negative", dict(local_window_size=(-1, 2)), ValueError, ">= 0"),
    ("window_float", dict(local_window_size=1.5), TypeError, "window"),
    ("window_bool", dict(local_window_size=True), TypeError, "window"),
    ("lengths_float", dict(query_seq_lengths=[1.0, 2.0]), TypeError, "query"),
    (
      "lengths_shape",
      dict(key_value_seq_lengths=np.ones((2, 1), np.int32)),
      ValueError,
      "key_value_seq_lengths",
    ),
    ("residual", dict(return_residual=1), TypeError, "return_residual"),
  )
  def test_bad_arguments_named(self, kwargs, exc, fragment):
    q, k, v = _qkv()
    with self.assertRaisesRegex(exc, fragment):
      jaxtopk.topk_attention(q, k, v, policy=jaxtopk.Dense(), **kwargs)

  def test_mixed_ranks_refused(self):
    q, k, v = _qkv()
    with self.assertRaisesRegex(ValueError, "unbatched"):
      jaxtopk.topk_attention(q[0], k, v, policy=jaxtopk.Dense())


class JaxConfigTest(parameterized.TestCase):
  """jax configurations a drop-in must run under (jax.nn does)."""

  @parameterized.named_parameters(FIXED_K, DELTA)
  def test_rank_promotion_raise(self, policy):
    # Rank promotion is checked while tracing: forward and backward are
    # traced (jax.eval_shape), not compiled.
    q, k, v = _qkv(4)
    kw = dict(
      is_causal=True,
      query_seq_lengths=Q_LENS,
      key_value_seq_lengths=KV_LENS,
      local_window_size=WINDOW,
      return_residual=True,
      policy=policy,
    )
    mask = jnp.ones((B, 1, T, S), bool)  # a boolean mask: `m & see`
    bias = jnp.zeros((B, 1, T, 1))
    fwd = lambda q: jaxtopk.topk_attention(q, k, v, bias, mask, **kw)  # noqa: E731
    with jax.numpy_rank_promotion("raise"):
      out, _, _ = jax.eval_shape(fwd, q)
      g = jax.eval_shape(jax.grad(lambda q: fwd(q)[0].sum()), q)
    self.assertEqual((out.shape, g.shape), (q.shape, q.shape))

  @parameterized.named_parameters(DENSE, DELTA)
  def test_debug_infs(self, policy):
    # Dense drops nothing (log tv = log 0) and the rows past Q_LENS keep
    # nothing (lse = log 0): neither may surface as an inf.
    q, k, v = _qkv(5)
    mask = _structure_mask()
    with jax.debug_infs(True):
      out, lse, cert = jaxtopk.topk_attention(
        q,
        k,
        v,
        None,
        mask,
        query_seq_lengths=Q_LENS,
        return_residual=True,
        policy=policy,
      )
      if isinstance(policy, jaxtopk.Dense):  # the backward pass too
        jax.grad(
          lambda q: jnp.sum(
            jaxtopk.topk_attention(q, k, v, None, mask, policy=policy)[0]
          )
        )(q)
    for x in (out, lse, cert.log_tv_bound, cert.tv_bound):
      self.assertFalse(bool(jnp.any(jnp.isinf(x))))


if __name__ == "__main__":
  absltest.main()
