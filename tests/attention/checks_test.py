"""attention.checks: every bad input of the audit gets a clear error.

Each case is named after the audit's finding and runs eagerly and under
jax.jit (the checks read only shapes, dtypes and Python values).
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

import jaxtopk
from jaxtopk.attention import checks
from jaxtopk.selection.internal import capabilities

B, T, H, HK, D, S, DV = 2, 3, 6, 3, 5, 7, 4  # distinct sizes


def _qkv(dq=np.float32, dk=np.float32, dv=np.float32):
  rng = np.random.default_rng(0)
  q = rng.normal(size=(B, T, H, D)).astype(dq)
  k = rng.normal(size=(B, S, HK, D)).astype(dk)
  v = rng.normal(size=(B, S, HK, DV)).astype(dv)
  return q, k, v


def _both(fn, *args):
  """Runs ``fn(*args)`` eagerly and under jit (errors at trace time)."""
  fn(*args)
  jax.jit(lambda *a: (fn(*a), jnp.zeros(()))[1])(*args)


class QKVTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("int32_query", dict(dq=np.int32), "query.dtype=int32"),
    ("int32_key", dict(dk=np.int32), "key.dtype=int32"),
    ("bool_value", dict(dv=np.bool_), "value.dtype=bool"),
    ("complex_query", dict(dq=np.complex64), "complex"),
  )
  def test_non_floating_inputs_refused(self, dtypes, fragment):
    q, k, v = _qkv(**dtypes)
    with self.assertRaisesRegex(TypeError, fragment):
      checks.check_qkv(q, k, v)
    if np.dtype(dtypes.get("dq", np.float32)).kind != "c":
      with self.assertRaisesRegex(TypeError, fragment):
        _both(lambda *a: checks.check_qkv(*a)[0], q, k, v)

  @parameterized.named_parameters(
    ("rank", lambda q, k, v: (q[0], k, v), "query must be"),
    ("batch", lambda q, k, v: (q, k[:1], v[:1]), "batch sizes differ"),
    ("kv_len", lambda q, k, v: (q, k, v[:, :2]), "share"),
    ("head_dim", lambda q, k, v: (q, k[..., :2], v), "head_dim differs"),
    ("gqa", lambda q, k, v: (q[:, :, :4], k, v), "multiple of num_kv_heads"),
    ("zero_head_dim", lambda q, k, v: (q[..., :0], k[..., :0], v), ">= 1"),
  )
  def test_shape_mismatches_named(self, cut, fragment):
    args = cut(*_qkv())
    with self.assertRaisesRegex(ValueError, fragment):
      checks.check_qkv(*args)
    with self.assertRaisesRegex(ValueError, fragment):
      _both(lambda *a: checks.check_qkv(*a)[0], *args)

  def test_dims(self):
    *_, dims = checks.check_qkv(*_qkv())
    self.assertEqual(
      (dims.batch, dims.q_len, dims.num_heads, dims.head_dim), (B, T, H, D)
    )
    self.assertEqual((dims.kv_len, dims.num_kv_heads, dims.v_dim), (S, HK, DV))
    self.assertEqual(dims.group, H // HK)
    self.assertEqual(dims.logits_shape, (B, H, T, S))
    self.assertFalse(dims.empty)

  @parameterized.named_parameters(
    ("q_len_0", lambda q, k, v: (q[:, :0], k, v), (B, 0, H)),
    ("kv_len_0", lambda q, k, v: (q, k[:, :0], v[:, :0]), (B, T, H)),
  )
  def test_empty_lengths_have_a_defined_result(self, cut, cert_shape):
    q, k, v, dims = checks.check_qkv(*cut(*_qkv()))
    self.assertTrue(dims.empty)
    for values_bound in (True, False):
      out, cert = checks.empty_result(dims, q.dtype, values_bound=values_bound)
      self.assertEqual(out.shape, (*cert_shape, DV))
      self.assertEqual(out.dtype, q.dtype)
      np.testing.assert_array_equal(out, 0)
      self.assertEqual(cert.shape, cert_shape)
      self.assertFalse(np.any(cert.valid))
      np.testing.assert_array_equal(cert.k_kept, 0)
      self.assertTrue(np.all(np.isnan(cert.tv_bound)))
      self.assertEqual(cert.output_error_bound is None, not values_bound)


class ArgumentTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("is_causal_no", "no"),
    ("is_causal_int", 1),
    ("is_causal_none", None),
  )
  def test_is_causal_not_bool_refused(self, value):
    with self.assertRaisesRegex(TypeError, f"is_causal={value!r}"):
      checks.check_is_causal(value)

  def test_is_causal_bools(self):
    self.assertIs(checks.check_is_causal(True), True)
    self.assertIs(checks.check_is_causal(np.bool_(False)), False)

  @parameterized.named_parameters(
    ("scale_inf", float("inf"), ValueError, "scale=inf"),
    ("scale_nan", float("nan"), ValueError, "scale=nan"),
    ("scale_zero", 0.0, ValueError, "scale=0.0"),
    ("scale_negative", -1.0, ValueError, "scale=-1.0"),
    # Subnormal: a CPU reads it as 0 (every logit 0, exact ones ~0.88).
    ("scale_subnormal", 1.1e-38, ValueError, "scale=1.1e-38 is below"),
    ("scale_numpy_subnormal", np.float32(1e-40), ValueError, "smallest normal"),
    ("scale_numpy_inf", np.float32("inf"), ValueError, "scale=inf"),
    ("scale_bool", True, TypeError, "scale=True"),
    ("scale_string", "0.5", TypeError, "scale='0.5'"),
    ("scale_vector", np.ones(2), TypeError, "scalar"),
    ("scale_int_array", jnp.int32(2), TypeError, "scale.dtype=int32"),
  )
  def test_bad_static_scale_refused(self, scale, exc, fragment):
    with self.assertRaisesRegex(exc, fragment):
      checks.check_scale(scale, D)

  def test_scales_accepted(self):
    self.assertAlmostEqual(checks.check_scale(None, 4), 0.5)
    self.assertEqual(checks.check_scale(np.float32(0.25), 4), 0.25)
    self.assertIsInstance(checks.check_scale(np.float32(0.25), 4), float)
    self.assertEqual(checks.check_scale(2, 4), 2.0)
    self.assertIs(checks.scale_ok(0.5), True)

  def test_traced_scale_works(self):
    # Audit finding: a traced scale was refused with "non-hashable static
    # argument"; it is returned as a dynamic 0-d array.
    @jax.jit
    def f(scale):
      s = checks.check_scale(scale, D)
      return s * 2.0, checks.scale_ok(s)

    for value, ok in ((0.5, True), (np.inf, False), (-1.0, False)):
      twice, good = f(jnp.float32(value))
      self.assertEqual(float(twice), 2 * value)
      self.assertEqual(bool(good), ok)
    # A traced subnormal scale: its rows are invalid (it reads 0 on a CPU).
    self.assertFalse(bool(f(jnp.float32(1.1e-38))[1]))
    self.assertTrue(bool(f(jnp.float32(1.2e-38))[1]))

  @parameterized.named_parameters(
    ("mask_float", np.ones((B, 1, 1, S), np.float32), TypeError, "bias="),
    ("mask_int", np.ones((B, 1, 1, S), np.int32), TypeError, "mask.dtype"),
    ("mask_shape", np.ones((B, 1, 1, S + 1), bool), ValueError, "mask shape"),
    ("mask_rank", np.ones((1, B, 1, 1, S), bool), ValueError, "rank"),
  )
  def test_bad_mask_refused(self, mask, exc, fragment):
    shape = (B, H, T, S)
    with self.assertRaisesRegex(exc, fragment):
      checks.check_mask(mask, shape)
    with self.assertRaisesRegex(exc, fragment):
      _both(lambda m: checks.check_mask(m, shape), mask)

  @parameterized.named_parameters(
    ("bias_int", np.ones((B, 1, 1, S), np.int32), TypeError, "bias.dtype"),
    ("bias_shape", np.ones((B, 1, 2, S), np.float32), ValueError, "bias"),
  )
  def test_bad_bias_refused(self, bias, exc, fragment):
    with self.assertRaisesRegex(exc, fragment):
      checks.check_bias(bias, (B, H, T, S))

  def test_minus_inf_bias_and_none_accepted(self):
    bias = np.zeros((1, 1, T, S), np.float32)
    bias[..., 0] = -np.inf
    self.assertIsNotNone(checks.check_bias(bias, (B, H, T, S)))
    self.assertIsNone(checks.check_bias(None, (B, H, T, S)))
    self.assertIsNone(checks.check_mask(None, (B, H, T, S)))

  def test_policy_refused_by_name(self):
    with self.assertRaisesRegex(TypeError, "not a selection policy"):
      checks.check_policy("topk", "topk_attention", capabilities())
    caps = capabilities("policy=Certified", "search=exact")
    backend = "decode_attention(implementation='pallas')"
    with self.assertRaisesRegex(
      jaxtopk.UnsupportedPolicyError,
      r"Certified.max_topk=4 is not supported by decode_attention\("
      r"implementation='pallas'\)",
    ):
      checks.check_policy(jaxtopk.Certified(0.01, max_topk=4), backend, caps)
    checks.check_policy(jaxtopk.Certified(0.01), backend, caps)

  def test_rng_needed_by_mc(self):
    mc = jaxtopk.Certified(0.1, "mc")
    with self.assertRaisesRegex(ValueError, "needs a PRNG key"):
      checks.check_rng(mc, None)
    key = jax.random.key(3)
    self.assertIs(checks.check_rng(mc, key), key)
    checks.check_rng(jaxtopk.FixedK(2), None)


if __name__ == "__main__":
  absltest.main()
