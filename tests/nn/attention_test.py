"""CertifiedTopKAttention against nnx.MultiHeadAttention, decode, errors."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx

import jaxtopk
from jaxtopk import nn as topk_nn
from tests import rand
from tests.nn.common import BATCH
from tests.nn.common import FEATURES
from tests.nn.common import KV_LEN
from tests.nn.common import Q_LEN
from tests.tolerances import tol


def _inputs(dtype=jnp.float32, kv_len=KV_LEN, batch=(BATCH,)):
  xq = rand.normal(0, (*batch, Q_LEN, FEATURES), dtype)
  xk = rand.normal(1, (*batch, kv_len, FEATURES), dtype)
  return xq, xk


def _pair(policy, *, seed_ref=1, **kwargs):
  """A CertifiedTopKAttention and an nnx.MultiHeadAttention, same weights.

  They are initialised from different seeds, then the reference's parameters
  are loaded into the Top-k layer, so equal outputs prove that the parameter
  layout is the same.
  """
  kwargs = dict(num_heads=4, in_features=FEATURES, qkv_features=12) | kwargs
  layer = topk_nn.CertifiedTopKAttention(
    policy=policy, decode=False, rngs=nnx.Rngs(0), **kwargs
  )
  ref = nnx.MultiHeadAttention(decode=False, rngs=nnx.Rngs(seed_ref), **kwargs)
  nnx.update(layer, nnx.state(ref, nnx.Param))
  return layer, ref


def _padding_mask(batch=BATCH, kv_len=KV_LEN):
  """[batch, 1, 1, kv_len]: row b sees its first kv_len - b keys."""
  lengths = kv_len - jnp.arange(batch)
  return (jnp.arange(kv_len) < lengths[:, None])[:, None, None, :]


class ParityTest(parameterized.TestCase):
  """A policy that keeps every key reproduces nnx.MultiHeadAttention."""

  @parameterized.named_parameters(
    [
      (f"{case}_float32", jnp.float32, case)
      for case in ("plain", "mask", "causal", "gqa", "normalize_qk")
    ]
    + [(f"{case}_bfloat16", jnp.bfloat16, case) for case in ("mask", "gqa")]
  )
  def test_same_outputs_as_multi_head_attention(self, dtype, case):
    extra = {}
    call = {}
    self_attention = case == "causal"
    if case == "gqa":
      extra["num_kv_heads"] = 2
    if case == "normalize_qk":
      extra["normalize_qk"] = True
    if case == "mask":
      call["mask"] = _padding_mask()
    if case == "causal":
      call["is_causal"] = True
    # Every policy that keeps every key, spread over the cases.
    policy = {
      "mask": jaxtopk.FixedK(KV_LEN),
      "gqa": jaxtopk.Ratio(1.0),
      "causal": jaxtopk.PowerLaw(1.0, 1.0),
    }.get(case, jaxtopk.Dense())
    layer, ref = _pair(policy, dtype=dtype, **extra)
    xq, xk = _inputs(dtype)
    args = (xq,) if self_attention else (xq, xk)
    got = layer(*args, **call)
    want = ref(*args, **call)
    self.assertEqual(got.shape, want.shape)
    self.assertEqual(got.dtype, want.dtype)
    np.testing.assert_allclose(
      np.asarray(got, np.float32), np.asarray(want, np.float32), **tol(dtype)
    )
    cert = layer.last_certificate.get_value()
    q_len = xq.shape[-2]
    self.assertEqual(cert.tv_bound.shape, (BATCH, q_len, 4))
    self.assertTrue(bool(jnp.all(cert.valid)))

  def test_weights_load_both_ways(self):
    layer, ref = _pair(jaxtopk.Dense())
    other = nnx.MultiHeadAttention(
      num_heads=4,
      in_features=FEATURES,
      qkv_features=12,
      decode=False,
      rngs=nnx.Rngs(5),
    )
    nnx.update(other, nnx.state(layer, nnx.Param))
    xq, xk = _inputs()
    np.testing.assert_allclose(other(xq, xk), ref(xq, xk), **tol(jnp.float32))
    self.assertEqual(
      jax.tree.map(jnp.shape, nnx.state(layer, nnx.Param)),
      jax.tree.map(jnp.shape, nnx.state(ref, nnx.Param)),
    )

  def test_state_is_multi_head_attentions_until_called(self):
    # Flax's filter patterns: a fresh layer holds only what
    # nnx.MultiHeadAttention holds, so an exhaustive Param split works.
    layer, ref = _pair(jaxtopk.Dense())
    _, params = nnx.split(layer, nnx.Param)
    self.assertEqual(
      jax.tree.map(jnp.shape, params),
      jax.tree.map(jnp.shape, nnx.split(ref, nnx.Param)[1]),
    )
    self.assertIsNone(layer.last_certificate)
    layer(*_inputs())
    # After a call the certificate is an nnx.Intermediate (documented).
    _, params, rest = nnx.split(layer, nnx.Param, ...)
    self.assertEqual(list(rest), ["last_certificate"])
    nnx.pop(layer, nnx.Intermediate)
    nnx.split(layer, nnx.Param)

  def test_several_batch_axes_and_none(self):
    layer, ref = _pair(jaxtopk.Dense())
    xq, xk = _inputs(batch=(2, 3))
    np.testing.assert_allclose(layer(xq, xk), ref(xq, xk), **tol(jnp.float32))
    self.assertEqual(
      layer.last_certificate.get_value().k_kept.shape, (2, 3, Q_LEN, 4)
    )
    np.testing.assert_allclose(
      layer(xq[0, 0], xk[0, 0]), ref(xq[0, 0], xk[0, 0]), **tol(jnp.float32)
    )

  def test_jit_matches_eager_and_records_certificate(self):
    layer, ref = _pair(jaxtopk.Dense())
    xq, xk = _inputs()
    eager = layer(xq, xk)
    layer.last_certificate.set_value(None)
    jitted = nnx.jit(lambda m, a, b: m(a, b))(layer, xq, xk)
    np.testing.assert_allclose(jitted, eager, **tol(jnp.float32))
    cert = layer.last_certificate.get_value()
    self.assertIsInstance(cert, jaxtopk.Certificate)
    np.testing.assert_array_equal(cert.k_kept, KV_LEN)

  def test_equal_layers_built_apart_share_their_graph(self):
    """Equal layers have equal graphs: a jitted function over a new model
    instance reuses the programs compiled for an equal one."""
    make = lambda: topk_nn.CertifiedTopKAttention(  # noqa: E731
      num_heads=4,
      in_features=FEATURES,
      qkv_features=12,
      policy=jaxtopk.Certified(0.1),
      decode=False,
      rngs=nnx.Rngs(0),
    )
    a, b = make(), make()
    self.assertIs(a.attention_fn, b.attention_fn)
    self.assertEqual(nnx.graphdef(a), nnx.graphdef(b))
    other = topk_nn.topk_attention_fn(jaxtopk.Certified(0.2))
    self.assertIsNot(a.attention_fn, other)

  def test_deterministic_dropout_layer_matches(self):
    layer, ref = _pair(jaxtopk.Dense(), dropout_rate=0.3)
    xq, xk = _inputs()
    np.testing.assert_allclose(
      layer(xq, xk, deterministic=True),
      ref(xq, xk, deterministic=True),
      **tol(jnp.float32),
    )

  def test_row_without_real_key_gives_zeros_and_invalid_certificate(self):
    # Documented difference from Flax (which averages all values there).
    layer, _ = _pair(jaxtopk.FixedK(3))
    xq, xk = _inputs()
    mask = jnp.ones((BATCH, 1, Q_LEN, KV_LEN), bool).at[0, :, 1].set(False)
    y = layer(xq, xk, mask=mask)
    cert = layer.last_certificate.get_value()  # [b, q, heads]
    empty_out = layer.out(jnp.zeros((4, 3)))  # zero core: the out bias
    np.testing.assert_allclose(y[0, 1], empty_out, **tol(jnp.float32))
    self.assertFalse(bool(jnp.any(cert.valid[0, 1])))
    others = jnp.ones(cert.valid.shape, bool).at[0, 1].set(False)
    self.assertTrue(bool(jnp.all(cert.valid | ~others)))


class DecodeTest(parameterized.TestCase):
  """Decode step by step equals a causal full-sequence forward."""

  @parameterized.named_parameters(
    ("dense_mha_f32", jaxtopk.Dense(), None, jnp.float32),
    ("dense_gqa_f32", jaxtopk.Dense(), 2, jnp.float32),
    ("dense_mha_bf16", jaxtopk.Dense(), None, jnp.bfloat16),
    ("fixed_k_gqa_f32", jaxtopk.FixedK(3), 2, jnp.float32),
  )
  def test_decode_matches_causal_forward(self, policy, num_kv_heads, dtype):
    layer, ref = _pair(policy, num_kv_heads=num_kv_heads, dtype=dtype)
    x, _ = _inputs(dtype)
    full = layer(x, is_causal=True)
    if isinstance(policy, jaxtopk.Dense):
      want = ref(x, is_causal=True)
      np.testing.assert_allclose(
        np.asarray(full, np.float32), np.asarray(want, np.float32), **tol(dtype)
      )
    layer.init_cache(x.shape, dtype=dtype)
    steps = []
    for t in range(Q_LEN):
      steps.append(layer(x[:, t : t + 1], decode=True))
      cert = layer.last_certificate.get_value()
      np.testing.assert_array_equal(cert.k_kept, policy.num_kept(t + 1))
    np.testing.assert_allclose(
      np.asarray(jnp.concatenate(steps, axis=1), np.float32),
      np.asarray(full, np.float32),
      **tol(dtype),
    )

  def test_flax_cache_views(self):
    # cached_key / cached_value / cache_index read the KVCache in Flax's
    # layout [*batch, max_length, kv_heads, head_dim].
    layer, _ = _pair(jaxtopk.Dense(), num_kv_heads=2)
    x, _ = _inputs()
    self.assertIsNone(layer.cached_key)
    layer.init_cache(x.shape)
    self.assertEqual(layer.cached_key.shape, (BATCH, Q_LEN, 2, 3))
    for t in range(2):
      layer(x[:, t : t + 1], decode=True)
    self.assertEqual(int(layer.cache_index), 2)
    key = layer.key(x[:, :2])  # [b, 2, kv_heads, head_dim]
    np.testing.assert_allclose(layer.cached_key[:, :2], key, **tol(jnp.float32))
    np.testing.assert_array_equal(layer.cached_value[:, 2:], 0.0)
    with self.assertRaisesRegex(AttributeError, "read-only"):
      layer.cached_key = key
    # Flax >= 0.12.10's constructor hands the setter nnx.data(None) itself.
    type(layer).cached_key.fset(layer, nnx.data(None))
    with self.assertRaisesRegex(AttributeError, "read-only"):
      type(layer).cached_value.fset(layer, nnx.data(key))

  def test_decode_with_padding_mask_matches_forward(self):
    layer, _ = _pair(jaxtopk.FixedK(3))
    x, _ = _inputs()
    mask = _padding_mask(kv_len=Q_LEN)  # [batch, 1, 1, q_len]
    full = layer(x, mask=mask, is_causal=True)
    layer.init_cache(x.shape)
    steps = [
      layer(x[:, t : t + 1], mask=mask, decode=True) for t in range(Q_LEN)
    ]
    np.testing.assert_allclose(
      jnp.concatenate(steps, axis=1), full, **tol(jnp.float32)
    )

  def test_nnx_view_allocates_cache(self):
    layer, _ = _pair(jaxtopk.Dense())
    x, _ = _inputs()
    full = layer(x, is_causal=True)
    decoder = nnx.view(layer, decode=True, batch_size=BATCH, max_length=Q_LEN)
    steps = [decoder(x[:, t : t + 1]) for t in range(Q_LEN)]
    np.testing.assert_allclose(
      jnp.concatenate(steps, axis=1), full, **tol(jnp.float32)
    )


class ErrorTest(parameterized.TestCase):
  """Bad configuration fails at construction or first call, naming it."""

  def _make(self, **kwargs):
    kwargs = (
      dict(num_heads=2, in_features=6, policy=jaxtopk.Dense(), decode=False)
      | kwargs
    )
    return topk_nn.CertifiedTopKAttention(rngs=nnx.Rngs(0), **kwargs)

  def test_heads_must_divide_features(self):
    with self.assertRaisesRegex(ValueError, r"\(7\).*\(2\)"):
      self._make(qkv_features=7)

  def test_kv_heads_must_divide_heads(self):
    with self.assertRaisesRegex(ValueError, "num_kv_heads"):
      self._make(num_heads=3, qkv_features=6, num_kv_heads=2)

  @parameterized.parameters(0, -1)
  def test_num_heads_positive(self, num_heads):
    with self.assertRaisesRegex(ValueError, f"num_heads={num_heads}"):
      self._make(num_heads=num_heads)

  @parameterized.parameters(0.5, "dense", None)
  def test_policy_must_be_a_policy(self, policy):
    with self.assertRaisesRegex(TypeError, "policy="):
      self._make(policy=policy)
    with self.assertRaisesRegex(TypeError, "policy="):
      topk_nn.topk_attention_fn(policy)

  def test_policy_out_of_range(self):
    with self.assertRaisesRegex(ValueError, "topk=0"):
      self._make(policy=jaxtopk.FixedK(0))
    with self.assertRaisesRegex(ValueError, "rho=1.5"):
      self._make(policy=jaxtopk.Ratio(1.5))
    with self.assertRaisesRegex(ValueError, "eps=0"):
      self._make(policy=jaxtopk.Certified(eps=0.0))

  def test_unknown_implementation(self):
    with self.assertRaisesRegex(ValueError, "implementation='cuda'"):
      self._make(implementation="cuda")

  def test_attention_fn_is_fixed(self):
    with self.assertRaisesRegex(TypeError, "attention_fn"):
      self._make(attention_fn=nnx.dot_product_attention)

  def test_decode_without_cache(self):
    layer = self._make()
    with self.assertRaisesRegex(ValueError, "init_cache"):
      layer(jnp.ones((3, 1, 6)), decode=True)

  def test_decode_past_max_length(self):
    # A step past init_cache's max_length dropped its key and value and
    # attended over stale keys without a word.
    layer = self._make()
    layer.init_cache((3, 2, 6))
    x = jnp.ones((3, 1, 6))
    layer(x, decode=True)
    layer(x, decode=True)
    with self.assertRaisesRegex(ValueError, "max_length=2"):
      layer(x, decode=True)
    cache = layer.kv_cache.get_value()
    np.testing.assert_array_equal(cache.length, 2)  # nothing written

  def test_decode_past_max_length_under_jit(self):
    # The cache length is traced: the step writes nothing and its rows are
    # invalid (valid False, NaN fields, zero output).
    layer = self._make()
    layer.init_cache((3, 2, 6))

    @nnx.jit
    def step(m, x):
      return m(x, decode=True), m.last_certificate.get_value()

    x = jnp.ones((3, 1, 6))
    for _ in range(2):
      _, cert = step(layer, x)
      np.testing.assert_array_equal(cert.valid, True)
    y, cert = step(layer, 2 * x)
    np.testing.assert_array_equal(cert.valid, False)
    self.assertTrue(np.all(np.isnan(cert.tv_bound)))
    np.testing.assert_array_equal(cert.k_kept, 0)
    np.testing.assert_array_equal(layer.kv_cache.get_value().length, 2)
    # The output projection of a zero attention output (no bias here).
    np.testing.assert_array_equal(y, layer.out(jnp.zeros((3, 1, 2, 3))))

  def test_decode_more_than_one_token(self):
    layer = self._make()
    layer.init_cache((3, 5, 6))
    with self.assertRaisesRegex(ValueError, r"key.shape=\(3, 2, 2, 3\)"):
      layer(jnp.ones((3, 2, 6)), decode=True)

  def test_wrong_input_features(self):
    with self.assertRaisesRegex(ValueError, "in_features=6"):
      self._make()(jnp.ones((3, 5, 7)))

  def test_sow_weights_sows_the_certificate(self):
    layer = self._make()
    x = jnp.ones((3, 5, 6))
    _, inter = nnx.capture(layer, nnx.Intermediate)(x)
    self.assertEqual(dict(inter), {})  # nothing sown, as Flax
    _, inter = nnx.capture(layer, nnx.Intermediate)(x, sow_weights=True)
    (sown,) = inter["certificate"]
    self.assertEqual(sown.k_kept.shape, (3, 5, 2))
    np.testing.assert_array_equal(
      sown.k_kept, layer.last_certificate.get_value().k_kept
    )

  def test_active_dropout_refused(self):
    layer = self._make(dropout_rate=0.1)
    with self.assertRaisesRegex(NotImplementedError, "dropout_rate=0.1"):
      layer(jnp.ones((3, 5, 6)), deterministic=False)


if __name__ == "__main__":
  absltest.main()
