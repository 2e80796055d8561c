"""topk_attention: dense agreement, Top-k reference, soundness, grads."""

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import strategies as st
from jax.test_util import check_grads

import jaxtopk
from jaxtopk.attention import _topk
from tests import rand
from tests.tolerances import tol

B, T, H, HKV, S, D = 3, 5, 4, 2, 11, 7  # every axis a different size


def _qkv(dtype=jnp.float32, h_kv=HKV, s=S, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = rand.normal(kq, (B, T, H, D), dtype)
  k = rand.normal(kk, (B, s, h_kv, D), dtype)
  v = rand.normal(kv, (B, s, h_kv, D + 6), dtype)
  return q, k, v


def _reference(q, k, v, topk, mask=None, scale=None):
  """float64 numpy Top-k attention, the dense softmax and tau per row."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, h, d = q.shape
  g = h // k.shape[2]
  k = np.repeat(k, g, axis=2)
  v = np.repeat(v, g, axis=2)
  scale = 1 / np.sqrt(d) if scale is None else scale
  s = np.einsum("bthd,bshd->bhts", q, k) * scale
  valid = np.ones(s.shape, bool)
  if mask is not None:
    valid = np.broadcast_to(mask, s.shape)
  s = np.where(valid, s, -np.inf)
  order = np.argsort(-s, axis=-1, kind="stable")
  keep = np.zeros(s.shape, bool)
  np.put_along_axis(keep, order[..., :topk], True, axis=-1)
  keep &= valid
  e = np.exp(s - s.max(-1, keepdims=True))
  ek = np.where(keep, e, 0)
  out = np.einsum("bhts,bshd->bthd", ek / ek.sum(-1, keepdims=True), v)
  tau = 1 - ek.sum(-1) / e.sum(-1)
  return out, tau.transpose(0, 2, 1)


class DenseAgreementTest(parameterized.TestCase):
  @parameterized.product(
    dtype=(jnp.float32, jnp.bfloat16),
    causal=(False, True),
    masked=(False, True),
  )
  def test_matches_jax_nn(self, dtype, causal, masked, policy=None):
    # Dense, and a FixedK that keeps every key (one case each way).
    policy = jaxtopk.FixedK(S) if masked and causal else jaxtopk.Dense()
    q, k, v = _qkv(dtype)
    v = v[..., :D]  # jax.nn needs head_dim_v == head_dim
    mask = None
    if masked:
      mask = rand.bernoulli(3, 0.7, (B, 1, T, S))
      mask = mask.at[..., 0].set(True)  # no fully masked row for jax.nn
    out, cert = jaxtopk.topk_attention(
      q, k, v, policy=policy, mask=mask, is_causal=causal
    )
    # jax.nn at full float32 products, as jaxtopk computes (core.PRECISION):
    # at the default precision a GPU multiplies in TF32 (errors ~1e-3 here).
    with jax.default_matmul_precision("highest"):
      ref = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal)
    self.assertEqual(out.dtype, dtype)
    np.testing.assert_allclose(
      np.asarray(out, np.float32), np.asarray(ref, np.float32), **tol(dtype)
    )
    np.testing.assert_array_equal(cert.tv_bound, 0.0)
    self.assertEqual(cert.tv_bound.shape, (B, T, H))

  def test_bias_matches_jax_nn(self):
    q, k, v = _qkv()
    v = v[..., :D]
    bias = rand.normal(4, (1, H, T, S))
    out, _ = jaxtopk.topk_attention(q, k, v, policy=jaxtopk.Dense(), bias=bias)
    with jax.default_matmul_precision("highest"):  # as above: no TF32
      ref = jax.nn.dot_product_attention(q, k, v, bias=bias)
    np.testing.assert_allclose(out, ref, **tol(jnp.float32))


class TopkTest(parameterized.TestCase):
  @parameterized.parameters(1, 3, 5)
  def test_matches_float64_reference_gqa(self, topk):
    q, k, v = _qkv()
    out, cert = jaxtopk.topk_attention(q, k, v, policy=jaxtopk.FixedK(topk))
    ref, tau = _reference(q, k, v, topk)
    np.testing.assert_allclose(out, ref, **tol(jnp.float32))
    np.testing.assert_array_equal(cert.k_kept, topk)
    self.assertTrue(np.all(cert.tv_bound >= tau))
    np.testing.assert_allclose(cert.tv_bound, tau, rtol=1e-4, atol=1e-6)

  def test_certified_budget_holds(self):
    q, k, v = _qkv()
    q = 3 * q  # peaked rows, so the budget is met with fewer keys
    _, cert = jaxtopk.topk_attention(q, k, v, policy=jaxtopk.Certified(0.1))
    self.assertTrue(np.all(cert.tv_bound <= 0.1))
    self.assertLess(float(cert.k_kept.mean()), S)

  def test_fully_masked_row_returns_zeros_invalid(self):
    q, k, v = _qkv()
    mask = jnp.ones((B, H, T, S), bool).at[1, 2, 3].set(False)
    out, cert = jaxtopk.topk_attention(
      q, k, v, policy=jaxtopk.FixedK(3), mask=mask
    )
    np.testing.assert_array_equal(out[1, 3, 2], 0.0)
    self.assertFalse(bool(cert.valid[1, 3, 2]))
    self.assertEqual(int(jnp.sum(~cert.valid)), 1)
    self.assertTrue(np.all(np.isfinite(out)))

  def test_grad_matches_finite_differences(self):
    q, k, v = _qkv()

    def f(q, k, v):
      return jaxtopk.topk_attention(q, k, v, policy=jaxtopk.FixedK(4))[0]

    # Random normal inputs: no ties, so the kept set is locally constant.
    check_grads(f, (q, k, v), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)

  def test_grad_is_dense_grad_when_all_kept(self):
    q, k, v = _qkv()
    v = v[..., :D]

    def loss(fn):
      return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), (0, 1, 2))

    g1 = loss(
      lambda q, k, v: jaxtopk.topk_attention(
        q, k, v, policy=jaxtopk.Dense(), is_causal=True
      )[0]
    )(q, k, v)
    with jax.default_matmul_precision("highest"):  # no TF32 on a GPU
      g2 = loss(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
      )(q, k, v)
    for a, b in zip(g1, g2, strict=True):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)

  def test_vmap_and_jit(self):
    q, k, v = _qkv()
    pol = jaxtopk.FixedK(3)
    f = lambda q, k, v: jaxtopk.topk_attention(q, k, v, policy=pol)[0]
    a = f(q, k, v)
    b = jax.jit(f)(q, k, v)
    c = jax.vmap(lambda q, k, v: f(q[None], k[None], v[None])[0])(q, k, v)
    np.testing.assert_allclose(a, b, **tol(jnp.float32))
    np.testing.assert_allclose(a, c, **tol(jnp.float32))

  @parameterized.named_parameters(
    ("rank", lambda q, k, v: (q[0], k, v), {}, ValueError, "query"),
    ("heads", lambda q, k, v: (q[:, :, :3], k, v), {}, ValueError, "multiple"),
    ("dim", lambda q, k, v: (q[..., :3], k, v), {}, ValueError, "head_dim"),
    (
      "kv",
      lambda q, k, v: (q, k, v[:, :3]),
      {},
      ValueError,
      "key and value",
    ),
    (
      "mask",
      lambda q, k, v: (q, k, v),
      dict(mask=np.ones((2, 2, 2), bool)),
      ValueError,
      "mask",
    ),
    (
      "pallas",
      lambda q, k, v: (q, k, v),
      dict(implementation="pallas"),
      NotImplementedError,
      "pallas",
    ),
    (
      "impl",
      lambda q, k, v: (q, k, v),
      dict(implementation="cuda"),
      ValueError,
      "cuda",
    ),
    (
      "scale",
      lambda q, k, v: (q, k, v),
      dict(scale=-1.0),
      ValueError,
      "scale",
    ),
  )
  def test_bad_input(self, mangle, kwargs, exc, fragment):
    q, k, v = mangle(*_qkv())
    with self.assertRaisesRegex(exc, fragment):
      jaxtopk.topk_attention(q, k, v, policy=jaxtopk.FixedK(2), **kwargs)


_vals = st.one_of(
  st.floats(-4, 4, width=32),
  st.sampled_from([0.0, 1.0, -1.0, 30.0, -30.0, 1e3]),
)


SOUND_POLICIES = (
  jaxtopk.FixedK(1),
  jaxtopk.FixedK(4),
  jaxtopk.Certified(0.05),
  jaxtopk.Certified(0.3),
)


class SoundnessTest(parameterized.TestCase):
  @given(
    q=hnp.arrays(np.float32, (1, 2, 2, 3), elements=_vals),
    k=hnp.arrays(np.float32, (1, 9, 1, 3), elements=_vals),
    mask=hnp.arrays(np.bool_, (1, 1, 2, 9)),
    which=st.integers(0, len(SOUND_POLICIES) - 1),
    bf16=st.booleans(),
  )
  def test_certificate_sound_vs_float64(self, q, k, mask, which, bf16):
    policy = SOUND_POLICIES[which]
    dt = jnp.bfloat16 if bf16 else jnp.float32
    q, k = jnp.asarray(q, dt), jnp.asarray(k, dt)
    v = k[..., ::-1] + 1.0
    out, cert, keep = _topk.xla_topk_attention_with_keep(
      q, k, v, policy=policy, mask=mask
    )
    # float64 logits of the same (possibly bf16) inputs; truth of the kept
    # set the call returned (THEORY 3.4: a bound is sound for ITS set).
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    k64, v64 = np.repeat(k64, 2, 2), np.repeat(v64, 2, 2)
    s = np.einsum("bthd,bshd->bhts", q64, k64) / np.sqrt(3)
    for t in range(2):
      for h in range(2):
        real = mask[0, 0, t]
        c = jax.tree.map(lambda x, t=t, h=h: x[0, t, h], cert)
        if not real.any():
          self.assertFalse(bool(c.valid))
          np.testing.assert_array_equal(out[0, t, h], 0.0)
          continue
        self.assertTrue(bool(c.valid))
        kp = np.asarray(keep[0, h, t])
        self.assertFalse(np.any(kp & ~real))
        row = s[0, h, t]
        e = np.exp(np.where(real, row - row[real].max(), -np.inf))
        tau = e[~kp].sum() / e.sum()
        self.assertGreaterEqual(float(c.tv_bound), tau)
        attn = e @ v64[0, :, h] / e.sum()
        attn_k = (e * kp) @ v64[0, :, h] / (e * kp).sum()
        err = np.linalg.norm(attn - attn_k)
        self.assertGreaterEqual(float(c.output_error_bound), err)
        if isinstance(policy, jaxtopk.Certified):
          self.assertLessEqual(float(c.tv_bound), policy.eps)


if __name__ == "__main__":
  absltest.main()
