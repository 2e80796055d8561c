"""jax's dot_product_attention tests, run against jaxtopk.topk_attention.

The cases of ``tests/nn_test.py`` of jax (jax-ml/jax; Apache-2.0, (c) The
JAX Authors): ``testDotProductAttention``, ``testDotProductAttentionMask``
and ``testDotProductAttentionBiasGradient``, with their parameter grids,
inputs (shapes sized down), reference (``jax.nn.dot_product_attention``,
``implementation=None``), comparisons and tolerances, written anew here to
call ``jaxtopk.topk_attention`` where jax calls the implementation under
test. jax runs its 'cudnn' cases only on a CUDA GPU with cuDNN and skips them
elsewhere; so do these ('cudnn' is jaxtopk's 'pallas' there). The certified
policy runs where outputs are compared, within the certificate. Each
forward and backward pass is one jitted program (jax calls ``jax.vjp``
eagerly: the same values, fewer compilations).
"""

import functools
import unittest

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

import jaxtopk
from tests.upstream.common import CERTIFIED
from tests.upstream.common import DENSE
from tests.upstream.common import assert_matches

# jax: B, S, T, N, H = 2, 128, 128, 4, 32.
B, S, T, N, H = 2, 16, 16, 4, 8


def _skip_unless_cudnn():
  """jax's 'cudnn' cases need a CUDA GPU (with cuDNN); skipped elsewhere."""
  if jax.default_backend() != "gpu":
    raise unittest.SkipTest("CUDA or cuDNN versions are not compatible.")


def _topk(policy, implementation=None, **kw):
  """``jax.nn.dot_product_attention`` as jaxtopk runs it (output only)."""

  def fn(*args, **call_kw):
    out, _ = jaxtopk.topk_attention(
      *args, policy=policy, implementation=implementation, **kw, **call_kw
    )
    return out

  return fn


def _vjp(fn, grad, *args, jit=True):
  """``fn(*args)`` and its vjp at ``grad``, as one compiled program.

  ``jit=False`` for jax's reference: it picks its dot precision by trying
  (float16 falls back on CPU), which works eagerly only.
  """

  def run(grad, *args):
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(grad)

  return (jax.jit(run) if jit else run)(grad, *args)


class DotProductAttentionTest(parameterized.TestCase):
  @parameterized.product(
    dtype=[jnp.bfloat16, jnp.float16],
    group_num=[1, 2, 4],
    use_vmap=[False, True],
    impl=["cudnn", "xla"],
  )
  def test_dot_product_attention(self, dtype, group_num, use_vmap, impl):
    if impl == "cudnn":
      _skip_unless_cudnn()
    impl = "pallas" if impl == "cudnn" else impl
    g = group_num
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (B, T, N, H), dtype)
    k = jax.random.normal(ks[1], (B, S, N // g, H), dtype)
    v = jax.random.normal(ks[2], (B, S, N // g, H), dtype)
    grad = jax.random.normal(ks[3], (B, T, N, H), dtype)

    ref_fn = functools.partial(
      jax.nn.dot_product_attention, implementation=None
    )
    ans_fn = _topk(DENSE, impl)
    if use_vmap:
      ans_fn = jax.vmap(ans_fn, in_axes=(0, 0, 0, None, None), out_axes=0)
    # The reference is jax's MHA on repeated key/value heads (as jax's).
    k_ref, v_ref = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    out_ref, d_ref = _vjp(ref_fn, grad, q, k_ref, v_ref, None, None, jit=False)
    out, d = _vjp(ans_fn, grad, q, k, v, None, None)
    dq_ref, dk_ref, dv_ref = d_ref[:3]
    dq, dk, dv = d[:3]
    dk_ref = dk_ref.reshape(B, S, N // g, g, H).sum(axis=3)
    dv_ref = dv_ref.reshape(B, S, N // g, g, H).sum(axis=3)

    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(out), f32(out_ref), atol=0.01, rtol=0.01)
    np.testing.assert_allclose(f32(dq), f32(dq_ref), atol=0.01, rtol=0.01)
    np.testing.assert_allclose(f32(dk), f32(dk_ref), atol=0.01, rtol=0.01)
    np.testing.assert_allclose(f32(dv), f32(dv_ref), atol=0.01, rtol=0.01)

  @parameterized.parameters(jnp.bfloat16, jnp.float16)
  def test_dot_product_attention_certified(self, dtype):
    # The certified policy on the same inputs (grouped, vmapped): within
    # the certificate of each row.
    g = 2
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (B, T, N, H), dtype)
    k = jax.random.normal(ks[1], (B, S, N // g, H), dtype)
    v = jax.random.normal(ks[2], (B, S, N // g, H), dtype)
    ref = jax.nn.dot_product_attention(
      q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    )
    out, cert = jax.jit(
      jax.vmap(
        lambda q, k, v: jaxtopk.topk_attention(q, k, v, policy=CERTIFIED)
      )
    )(q, k, v)
    assert_matches(out, ref, cert, CERTIFIED, atol=0.01, rtol=0.01)

  @parameterized.product(
    mask_mode=[
      "bias",
      "causal",
      "padding",
      "custom",
      ("causal", "padding"),
      ("custom", "padding"),
      ("bias", "causal"),
      ("causal", "sliding_window"),
    ],
    policy=["dense", "certified"],
  )
  def test_dot_product_attention_mask(self, mask_mode, policy):
    # jax runs this case only against cuDNN (GPU); here jaxtopk (XLA) is
    # compared with jax's XLA reference on any backend.
    if isinstance(mask_mode, str):
      mask_mode = (mask_mode,)
    policy = DENSE if policy == "dense" else CERTIFIED
    dtype = jnp.bfloat16
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (B, T, N, H), dtype)
    k = jax.random.normal(ks[1], (B, S, N, H), dtype)
    v = jax.random.normal(ks[2], (B, S, N, H), dtype)
    grad = jax.random.normal(ks[3], (B, T, N, H), dtype)
    bias, mask = None, None
    q_seqlen, kv_seqlen = None, None
    window_size = None

    is_causal = "causal" in mask_mode
    if "padding" in mask_mode:
      q_seqlen = jnp.array([T // 2, T // 4], dtype=jnp.int32)
      kv_seqlen = jnp.array([S // 4, S // 2], dtype=jnp.int32)
    if "custom" in mask_mode:
      # A generated causal mask as the custom mask.
      mask = jnp.tril(jnp.ones((T, S), dtype=jnp.bool_))[None, None, :, :]
    if "bias" in mask_mode:
      bias = jax.random.normal(ks[4], (1, N, T, S), dtype)
    if "sliding_window" in mask_mode:
      window_size = (3, 2) if is_causal else (3, 0)

    kw = dict(is_causal=is_causal, local_window_size=window_size)

    def ref_fn(q, k, v, b, m, qs, kvs):
      return jax.nn.dot_product_attention(
        q, k, v, b, m, query_seq_lengths=qs, key_value_seq_lengths=kvs, **kw
      )

    def ans_fn(q, k, v, b, m, qs, kvs):
      return jaxtopk.topk_attention(
        q,
        k,
        v,
        b,
        m,
        query_seq_lengths=qs,
        key_value_seq_lengths=kvs,
        policy=policy,
        **kw,
      )[0]

    args = (q, k, v, bias, mask, q_seqlen, kv_seqlen)
    if policy is CERTIFIED:
      # The output within the certificate (the gradients of a Top-k softmax
      # are not the dense ones).
      out_ref = ref_fn(*args)
      out, cert = jax.jit(
        lambda q, k, v, b, m, qs, kvs: jaxtopk.topk_attention(
          q,
          k,
          v,
          b,
          m,
          query_seq_lengths=qs,
          key_value_seq_lengths=kvs,
          policy=policy,
          **kw,
        )
      )(*args)
      assert_matches(out, out_ref, cert, policy, atol=0.01, rtol=0.01)
      return
    out_ref, d_ref = _vjp(ref_fn, grad, *args, jit=False)
    out, d = _vjp(ans_fn, grad, *args)
    dq_ref, dk_ref, dv_ref, dbias_ref = d_ref[:4]
    dq, dk, dv, dbias = d[:4]

    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(out), f32(out_ref), atol=0.01, rtol=0.01)
    np.testing.assert_allclose(f32(dq), f32(dq_ref), atol=0.02, rtol=0.02)
    np.testing.assert_allclose(f32(dk), f32(dk_ref), atol=0.02, rtol=0.02)
    np.testing.assert_allclose(f32(dv), f32(dv_ref), atol=0.01, rtol=0.01)
    if bias is not None:
      np.testing.assert_allclose(
        f32(dbias), f32(dbias_ref), atol=0.02, rtol=0.02
      )

  @parameterized.product(batch_size=[1, 16], use_vmap=[False, True])
  def test_dot_product_attention_bias_gradient(self, batch_size, use_vmap):
    # jax compares cuDNN with XLA here (and expects cuDNN to refuse a bias
    # gradient for batch_size > 1); jaxtopk takes any batch size.
    dtype = jnp.bfloat16
    ks = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(ks[0], (batch_size, S, N, H), dtype)
    bias = jax.random.normal(ks[1], (batch_size, N, S, S), dtype=dtype)
    mask = jnp.ones((1, 1, S), dtype=jnp.bool_)

    def ref(x, bias, mask):
      return jax.nn.dot_product_attention(
        query=x, key=x, value=x, bias=bias, mask=mask, is_causal=False
      )

    def ans(x, bias, mask):
      return jaxtopk.topk_attention(
        query=x, key=x, value=x, bias=bias, mask=mask, policy=DENSE
      )[0]

    if use_vmap:
      ref = jax.vmap(ref, in_axes=(0, 0, None))
      ans = jax.vmap(ans, in_axes=(0, 0, None))
    y_ref = jax.jit(ref)(x, bias, mask)
    y = jax.jit(ans)(x, bias, mask)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    # jax's default tolerance for bfloat16 (assertAllClose).
    np.testing.assert_allclose(f32(y), f32(y_ref), atol=1e-2, rtol=1e-2)

    def dbias(fn):
      return jax.jit(lambda x, b, m: jax.vjp(fn, x, b, m)[1](x)[1])

    np.testing.assert_allclose(
      f32(dbias(ans)(x, bias, mask)),
      f32(dbias(ref)(x, bias, mask)),
      atol=0.1,
      rtol=0.1,
    )


if __name__ == "__main__":
  absltest.main()
