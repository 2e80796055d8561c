"""The certificate core: every function against 80-bit / float64 truth.

Adversarial families throughout: magnitudes 1e-45..3e38, subnormal
components and bit patterns (which XLA on CPU reads as 0), huge and tiny
values mixed in one vector, zeros, ties, n = 1, bfloat16 and float16 inputs.
Each finding of the reliability audit about the math has a regression test here.
"""

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import strategies as st

from jaxtopk.selection import core
from jaxtopk.selection import key_codes
from tests import rand

LD = np.longdouble  # 80-bit on x86: exact products of float32 values
F32 = np.finfo(np.float32)
N, D = 7, 5  # keys, head dim (distinct sizes)
DTYPES = {
  "float32": np.float32,
  "bfloat16": ml_dtypes.bfloat16,
  "float16": np.float16,
}


def _ld(x):
  """Exact 80-bit copy of a float array (any dtype, subnormals kept)."""
  return np.asarray(np.asarray(x).astype(np.float64), LD)


@st.composite
def vectors(draw, shape, dtype=np.float32):
  """Adversarial float arrays of ``shape`` in ``dtype`` (finite)."""
  n = int(np.prod(shape))
  kind = draw(
    st.sampled_from(["floats", "magnitudes", "bits", "mixed", "ties", "zeros"])
  )
  if kind == "floats":
    vals = draw(
      st.lists(
        st.floats(-3.4e38, 3.4e38, allow_subnormal=True),
        min_size=n,
        max_size=n,
      )
    )
  elif kind == "magnitudes":
    e = draw(st.lists(st.integers(-45, 38), min_size=n, max_size=n))
    sgn = draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=n, max_size=n))
    m = draw(st.lists(st.floats(1.0, 3.4), min_size=n, max_size=n))
    vals = [s * mm * 10.0**ee for s, mm, ee in zip(sgn, m, e, strict=True)]
  elif kind == "bits":
    bits = draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n))
    vals = np.asarray(bits, np.uint32).view(np.float32).astype(np.float64)
    vals = np.where(np.isfinite(vals), vals, 0.0)
    # Half of the entries forced subnormal (exponent bits cleared).
    sub = np.asarray(bits, np.uint32) & np.uint32(0x807FFFFF)
    sub = sub.view(np.float32).astype(np.float64)
    vals = np.where(np.arange(n) % 2 == 0, sub, vals)
  elif kind == "mixed":
    pool = [3e38, -3e38, 1e-38, -1e-39, 1.4e-45, 1.0, -5.0, 1e20, 1e-20, 0.0]
    vals = draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n))
  elif kind == "ties":
    vals = [draw(st.sampled_from([1.0, -2.5, 1e-30, 7e37]))] * n
  else:
    vals = [0.0] * n
  with np.errstate(over="ignore"):
    x = np.asarray(vals, np.float64).astype(dtype)
  x = np.where(np.isfinite(x.astype(np.float64)), x, np.zeros((), dtype))
  return x.astype(dtype).reshape(shape)


_norms_up = jax.jit(core.norms_up, static_argnames="axis")
_flushed = jax.jit(core.flushed, static_argnames="axis")


class NormsTest(parameterized.TestCase):
  @parameterized.named_parameters(*[(k, v) for k, v in DTYPES.items()])
  def test_norms_up_sound_and_tight(self, dtype):
    @given(x=vectors((3, N), dtype))
    def check(x):
      got = np.asarray(_norms_up(x), LD)
      want = np.sqrt(np.sum(_ld(x) ** 2, axis=-1))
      n_sub = np.sum((np.abs(_ld(x)) < F32.tiny) & (x != 0), axis=-1)
      for r in range(3):
        self.assertGreaterEqual(got[r], want[r], (x[r], got[r], want[r]))
        if want[r] > 0:
          self.assertGreater(got[r], 0)
        if want[r] < LD(F32.max) * LD(0.999):
          self.assertTrue(np.isfinite(got[r]), (x[r], got[r]))
          # Tight: a few ulps plus the subnormal floor only.
          slack = want[r] * LD((N + 16) * F32.eps) + LD(
            4 * np.sqrt(N) * F32.tiny * (n_sub[r] > 0)
          )
          self.assertLessEqual(got[r], want[r] + slack, (x[r], got[r]))

    check()

  def test_norms_do_not_collapse_above_2_to_126(self):
    # Audit finding: value_norms divided by max|v|; XLA turned that into a
    # multiply by a subnormal reciprocal, flushed to 0 (norm ~5e-38).
    v = np.array([[1e38, -3e37, 0.0, 1.0]], np.float32)
    got = float(_norms_up(v)[0])
    want = float(np.linalg.norm(v.astype(np.float64)))
    self.assertGreaterEqual(got, want)
    self.assertLess(got, want * 1.0001)

  def test_norms_of_subnormals_and_tiny_values_are_positive(self):
    # Row 0 where subnormals are kept (GPU): max |v| is subnormal, its
    # exponent below the normal range (an H200 gave NaN before the clip).
    v = np.array([[1e-40, 0, 0], [1e-30, 1e-30, 0], [0, 0, 0]], np.float32)
    got = np.asarray(_norms_up(v))
    self.assertGreater(got[0], 1e-40)
    self.assertGreaterEqual(got[1], np.sqrt(2) * 1e-30)
    self.assertEqual(got[2], 0.0)

  def test_norms_axis_and_non_finite(self):
    x = np.array([[3.0, np.inf], [4.0, 1.0]], np.float32)
    got = np.asarray(_norms_up(x, axis=0))
    self.assertGreaterEqual(got[0], 5.0)
    self.assertEqual(got[1], np.inf)
    self.assertTrue(np.isnan(_norms_up(np.array([np.nan, 1.0], np.float32))))

  @parameterized.parameters(0, 1, 5, 777, 2047)
  def test_one_nan_reaches_every_summary_under_jit(self, pos):
    # XLA:CPU's max reduction keeps the other operand of a NaN: a NaN at
    # position 1 of a [2048, 32] array was lost by jnp.max under jit.
    x = np.random.default_rng(pos).standard_normal((1, 2048, 1, 32))
    x = x.astype(np.float32)
    x[0, pos, 0, 1] = np.nan
    summaries = jax.jit(
      lambda x: (
        core.max_nan(x, axis=-1),
        core.max_nan(x, axis=1),
        core.norms_up(x),
        core.max_norm(core.norms_up(x)[..., 0], True),
        key_codes.encode_keys(x)[1],
      )
    )(x)
    row, col, nrm, mx, expo = (np.asarray(a) for a in summaries)
    self.assertTrue(np.isnan(row[0, pos, 0]))
    self.assertEqual(int(np.isnan(row).sum()), 1)
    self.assertTrue(np.isnan(col[0, 0, 1]))
    self.assertTrue(np.isnan(nrm[0, pos, 0]))
    self.assertTrue(np.isnan(mx[0]))
    bad = key_codes.nonfinite_exponent(jnp.float32)
    self.assertEqual(int(expo[0, pos, 0]), bad)
    self.assertEqual(int((expo == bad).sum()), 1)

  def test_value_norms_mark_non_finite_values_nan(self):
    v = np.array([[[1.0, 2.0], [np.inf, 0.0], [3e38, 3e38]]], np.float32)
    got = np.asarray(jax.jit(core.value_norms)(v))
    self.assertGreaterEqual(got[0, 0], np.sqrt(5))
    self.assertTrue(np.isnan(got[0, 1]))
    # A finite value whose norm (4.2e38) overflows: stored compressed,
    # finite, and read back (x tv) at least as large as the norm.
    self.assertTrue(np.isfinite(got[0, 2]))
    back = float(_mul_norm_up(np.float32(1e-3), got[0, 2]))
    self.assertGreaterEqual(back, 1e-3 * np.sqrt(2) * 3e38)
    self.assertLess(back, 1e-3 * np.sqrt(2) * 3e38 * 1.001)

  @parameterized.named_parameters(*[(k, v) for k, v in DTYPES.items()])
  def test_flushed_matches_numpy(self, dtype):
    @given(x=vectors((3, N), dtype))
    def check(x):
      x64 = np.abs(x.astype(np.float64))
      sub = (x64 > 0) & (x64 < F32.tiny)
      want = np.any(sub, -1) if dtype is not np.float16 else np.zeros(3, bool)
      np.testing.assert_array_equal(_flushed(x), want)

    check()


@functools.partial(jax.jit, static_argnames="form")
def _logits_and_bound_jit(q, k, scale, bias, form):
  # scale is traced here: logit_error_bound takes dynamic scales.
  dt = core.compute_dtype(jnp.result_type(q, k))
  s = jnp.einsum("d,nd->n", q.astype(dt), k.astype(dt)) * scale.astype(dt)
  if bias is not None:
    s = s + bias.astype(dt)
  k_absmax = jnp.max(jnp.abs(k), 0)
  abs_dot = core.abs_dot_box(q[None], k_absmax[None])[0, 0]
  bias_abs = None
  if bias is not None:
    b = jnp.abs(bias.astype(dt))
    bias_abs = jnp.max(jnp.where(jnp.isfinite(b), b, 0.0))
  delta = core.logit_error_bound(
    q_norm=core.norms_up(q),
    k_norm=jnp.max(core.norms_up(k)),
    head_dim=q.shape[-1],
    scale=scale,
    abs_dot=abs_dot if form == "box" else None,
    q_flushed=core.flushed(q),
    k_flushed=jnp.any(core.flushed(k)),
    bias_abs=bias_abs,
    q_absmax=jnp.max(jnp.abs(q.astype(dt))),
    k_absmax=jnp.max(k_absmax.astype(dt)),
  )
  return s, delta


def _logits_and_bound(q, k, scale, bias=None, form="box"):
  """Computed logits (as a path computes them) and the core's delta."""
  return _logits_and_bound_jit(q, k, np.float32(scale), bias, form)


class LogitErrorTest(parameterized.TestCase):
  @parameterized.product(
    dtype=list(DTYPES), form=["box", "ball"], with_bias=[False, True]
  )
  def test_logit_error_bound_sound(self, dtype, form, with_bias):
    dt = DTYPES[dtype]

    @given(
      q=vectors((D,), dt),
      k=vectors((N, D), dt),
      scale=st.sampled_from([1.0, D**-0.5, 1e-20, 3.0, 1e-30]),
      bias=vectors((N,), np.float32),
    )
    def check(q, k, scale, bias):
      b = bias if with_bias else None
      s, delta = _logits_and_bound(q, k, scale, b, form)
      s, delta = np.asarray(s, LD), LD(np.asarray(delta))
      exact = _ld(k) @ _ld(q) * LD(scale)
      if with_bias:
        exact = exact + _ld(bias)
      self.assertFalse(np.isnan(delta))
      self.assertGreater(delta, 0)
      for i in range(N):
        if not np.isfinite(delta) or np.isnan(s[i]) or s[i] == np.inf:
          continue  # trivial bound, or a row the validity rule rejects
        if s[i] == -np.inf:
          # A finite delta: no partial sum overflowed, so -inf is exact.
          self.assertLess(exact[i], LD(-1e30), (q, k[i], delta))
          continue
        self.assertLessEqual(
          abs(s[i] - exact[i]), delta, (q, k[i], s[i], exact[i], delta)
        )

    check()

  def test_flushed_query_times_huge_key(self):
    # Audit finding: q_0 = 1e-38 is subnormal, read as 0 by the CPU, so the
    # computed logit of [-3e38, 5, 0, 0] loses -3 (5 instead of 2).
    q = np.array([1e-38, 1.0, 0.0, 0.0], np.float32)
    k = np.array([[-3e38, 5.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0]], np.float32)
    s, delta = _logits_and_bound(q, k, 1.0)
    exact = _ld(k) @ _ld(q)
    err = np.max(np.abs(np.asarray(s, LD) - exact))
    self.assertGreater(float(err), 2.9)  # the CPU really dropped the term
    self.assertGreaterEqual(LD(np.asarray(delta)), err)

  def test_tiny_query_huge_keys_no_nan(self):
    # Audit: q * 1e-20 and k * 1e20 (logits O(1)) gave NaN; ||q|| ~ 9e-20
    # alone gave a slack of 0.
    rng = np.random.default_rng(0)
    q0 = rng.normal(size=D).astype(np.float32)
    k0 = rng.normal(size=(N, D)).astype(np.float32)
    for qs, ks in ((1e-20, 1e20), (9e-20, 1.0), (1.0, 1e-30)):
      q, k = (q0 * qs).astype(np.float32), (k0 * ks).astype(np.float32)
      for form in ("box", "ball"):
        s, delta = _logits_and_bound(q, k, 1.0, form=form)
        exact = _ld(k) @ _ld(q)
        d = LD(np.asarray(delta))
        self.assertTrue(np.isfinite(d))
        self.assertGreater(d, 0)
        self.assertLessEqual(np.max(np.abs(np.asarray(s, LD) - exact)), d)

  def test_overflowing_products_make_the_bound_trivial(self):
    q = np.array([3e38, 3e38, 3e38], np.float32)
    k = np.array([[-2.0, 1.0, 1.0]], np.float32)  # exact logit 0
    _, delta = _logits_and_bound(q, k, 1.0)
    self.assertEqual(float(delta), np.inf)

  def test_query_norm_past_the_largest_float_over_subnormal_keys(self):
    # ||q|| = 4.2e38 overflows; the logits do not (the large components
    # meet subnormal or tiny key components), and the keys' flushed
    # components still cost at most d tiny max|q_c| (~14 here): a finite
    # bound, not +inf.
    q = np.array([3e38, 3e38, 1.0, 0.0], np.float32)
    k = np.array(
      [[1e-39, -3e-39, 2.0, 1.0], [1e-30, 0.0, -1.0, 5.0]], np.float32
    )
    s, delta = _logits_and_bound(q, k, 1.0)
    d = LD(np.asarray(delta))
    self.assertTrue(np.isfinite(d), d)
    err = np.max(np.abs(np.asarray(s, LD) - _ld(k) @ _ld(q)))
    self.assertGreater(float(err), 0.1)  # the CPU dropped the flushed terms
    self.assertGreaterEqual(d, err)

  def test_abs_dot_only(self):
    d = core.logit_error_bound(abs_dot=jnp.float32(2.0), head_dim=4, scale=1)
    self.assertGreaterEqual(float(d), 8 * F32.eps * 2.0)
    with self.assertRaisesRegex(ValueError, "q_norm and k_norm"):
      core.logit_error_bound(q_norm=1.0, head_dim=4, scale=1.0)


def _tau_ld(s, keep, real):
  """(log tau, tau) of one row in 80-bit, -inf logits of zero mass."""
  s = _ld(s)
  pos = real & np.isfinite(s)
  if not pos.any():
    return None
  m = np.max(s[pos])
  e = np.exp(np.where(pos, s, m) - m)
  z = np.sum(e[pos])
  zt = np.sum(e[pos & ~keep])
  if zt == 0:
    return -np.inf, LD(0)
  return np.log(zt) - np.log(z), zt / z


@st.composite
def logit_rows(draw, n=N):
  kind = draw(st.sampled_from(["normal", "huge", "far", "ties", "inf", "one"]))
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  if kind == "normal":
    s = rng.normal(size=n) * draw(st.sampled_from([0.1, 3.0, 30.0]))
  elif kind == "huge":
    s = rng.choice([1e4, -1e4, 5e3, 0.0, 3e38, -3e38], size=n)
  elif kind == "far":  # tails 60..1000 logits below the head
    s = -rng.choice([0.0, 60.0, 98.0, 103.0, 150.0, 745.0, 1000.0], size=n)
  elif kind == "ties":
    s = np.full(n, draw(st.sampled_from([0.0, 2.5, -88.0])))
  elif kind == "inf":
    s = rng.normal(size=n)
    s[rng.random(n) < 0.5] = -np.inf
  else:
    s = np.full(n, -np.inf)
    s[rng.integers(n)] = rng.normal()
  keep = np.asarray(draw(hnp.arrays(np.bool_, (n,))))
  real = np.asarray(draw(hnp.arrays(np.bool_, (n,))))
  return s.astype(np.float32), keep, real


class CertificateTest(parameterized.TestCase):
  @given(rows=st.lists(logit_rows(), min_size=3, max_size=3))
  def test_certificate_from_logits_sound(self, rows):
    s = np.stack([r[0] for r in rows])
    keep = np.stack([r[1] for r in rows])
    real = np.stack([r[2] for r in rows])
    cert = jax.jit(core.certificate_from_logits)(s, keep, real)
    for r in range(3):
      truth = _tau_ld(s[r], keep[r], real[r])
      has_head = np.any(keep[r] & real[r] & np.isfinite(s[r]))
      self.assertEqual(bool(cert.valid[r]), truth is not None and has_head)
      if not cert.valid[r]:
        self.assertTrue(np.isnan(cert.tv_bound[r]))
        continue
      log_tau, tau = truth
      self.assertGreaterEqual(LD(float(cert.log_tv_bound[r])), log_tau)
      self.assertGreaterEqual(LD(float(cert.tv_bound[r])), tau)
      if tau > 0:
        self.assertGreater(float(cert.tv_bound[r]), 0.0)
      # Tight: within 1e-4 in log space, plus ulps of |log tau| itself.
      if np.isfinite(log_tau):
        tol = 1e-4 + 32 * F32.eps * abs(float(log_tau))
        self.assertLess(float(cert.log_tv_bound[r]) - float(log_tau), tol)

  def test_tail_far_below_the_head_is_not_zero(self):
    # Audit: decode summed e^{s - row max} and returned tv 0 where tau is
    # 5.6e-43; the core uses the tail's own max.
    s = np.array([[0.0, -97.0, -98.0, -1e4]], np.float32)
    keep = np.array([[True, False, False, False]])
    cert = core.certificate_from_logits(s, keep, np.ones_like(keep))
    log_tau, _ = _tau_ld(s[0], keep[0], np.ones(4, bool))
    self.assertGreaterEqual(float(cert.log_tv_bound[0]), float(log_tau))
    self.assertEqual(float(cert.tv_bound[0]), F32.tiny)

  def test_logit_error_widens_and_inf_is_trivial(self):
    s = np.array([[2.0, 0.0, -1.0]], np.float32)
    keep = np.array([[True, False, False]])
    real = np.ones_like(keep)
    c0 = core.certificate_from_logits(s, keep, real)
    c1 = core.certificate_from_logits(s, keep, real, logit_error=0.5)
    ratio = float(c1.log_tv_bound[0] - c0.log_tv_bound[0])
    self.assertAlmostEqual(ratio, 1.0, delta=1e-5)  # 2 delta
    c2 = core.certificate_from_logits(
      s, np.ones_like(keep), real, logit_error=np.inf, value_norms=np.ones(3)
    )
    self.assertTrue(bool(c2.valid[0]))  # trivial but sound
    self.assertEqual(float(c2.tv_bound[0]), 1.0)
    self.assertEqual(float(c2.output_error_bound[0]), np.inf)

  @parameterized.named_parameters(
    ("nan_logit", [1.0, np.nan, 0.0], [1, 1, 1], False),
    ("pos_inf_logit", [1.0, np.inf, 0.0], [1, 1, 1], False),
    ("all_minus_inf", [-np.inf, -np.inf, -np.inf], [1, 1, 1], False),
    ("minus_inf_is_zero_mass", [1.0, -np.inf, 0.0], [1, 1, 1], True),
    ("masked_nan_ignored", [1.0, np.nan, 0.0], [1, 0, 1], True),
    ("no_real_key", [1.0, 2.0, 0.0], [0, 0, 0], False),
  )
  def test_row_validity_rule(self, logits, real, valid):
    s = np.array([logits], np.float32)
    real = np.array([real], bool)
    keep = np.array([[True, True, False]])
    cert = core.certificate_from_logits(s, keep, real)
    self.assertEqual(bool(cert.valid[0]), valid)
    if valid:
      self.assertEqual(
        int(cert.k_kept[0]), int(np.sum(keep & real & (s > -1e38)))
      )

  def test_nan_value_makes_row_invalid(self):
    s = np.zeros((2, 3), np.float32)
    keep = np.array([[True, False, False]] * 2)
    vn = jax.jit(core.value_norms)(
      np.array([[[1.0], [np.nan], [1.0]], [[1.0], [2.0], [1.0]]], np.float32)
    )
    cert = core.certificate_from_logits(
      s, keep, np.ones_like(keep), value_norms=vn
    )
    np.testing.assert_array_equal(cert.valid, [False, True])


class OutputErrorTest(parameterized.TestCase):
  @given(
    tv=st.one_of(
      st.floats(0, 1, width=32), st.sampled_from([0.0, 1.0, 1.2e-38, 1e-30])
    ),
    h=st.one_of(
      st.floats(0, float(F32.max), width=32), st.sampled_from([3e38, 1e-38])
    ),
    t=st.one_of(
      st.floats(0, float(F32.max), width=32), st.sampled_from([3e38, 0.0])
    ),
  )
  def test_output_error_bound_sound(self, tv, h, t):
    # Norms as stored by value_norms (of the one-component values [h], [t]).
    hs, ts = _value_norms(np.array([[h], [t]], np.float32))
    got = float(core.output_error_bound(np.float32(tv), hs, ts))
    want = LD(np.float32(tv)) * (LD(np.float32(h)) + LD(np.float32(t)))
    self.assertGreaterEqual(LD(got), want)
    if want > 0:
      self.assertGreater(got, 0.0)
    if want < LD(F32.max) / 2:
      self.assertTrue(np.isfinite(got))  # never a spurious overflow

  def test_exp_up_never_zero_above_minus_inf(self):
    x = np.array([-1e4, -104.0, -87.5, -10.0, 0.0, -np.inf], np.float32)
    got = np.asarray(jax.jit(core.exp_up)(x), LD)
    want = np.exp(_ld(x))
    self.assertTrue(np.all(got >= want))
    self.assertTrue(np.all(got[:-1] > 0))
    self.assertEqual(got[-1], 0)


def _split_points(draw, n):
  cuts = sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=3))))
  return [0, *cuts, n]


def _attn_ld(s, keep, real, v):
  """(exact kept-set output, exact full output) of one row, 80-bit."""
  s, v = _ld(s), _ld(v)
  pos = real & np.isfinite(s)
  kp = keep & pos
  m = np.max(s[pos])
  mk = np.max(s[kp])  # the kept set's own max: its output never underflows
  e = np.where(pos, np.exp(np.where(pos, s, m) - m), 0)
  ek = np.where(kp, np.exp(np.where(kp, s, mk) - mk), 0)
  return (ek @ v) / ek.sum(), (e @ v) / e.sum()


class PartialTest(parameterized.TestCase):
  @given(data=st.data())
  def test_merged_partials_sound_and_normalised(self, data):
    s, keep, real = data.draw(logit_rows(n=9))
    scale_v = data.draw(st.sampled_from([1.0, 3e37, 1e-30]))
    v = np.random.default_rng(data.draw(st.integers(0, 99))).normal(size=(9, 3))
    v = (v * scale_v).astype(np.float32)
    cuts = _split_points(data.draw, 9)
    tree = data.draw(st.sampled_from(["chain", "reduce"]))
    vn = core.value_norms(v)
    parts = []
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
      vb = jnp.asarray(v[a:b])
      parts.append(
        core.PartialSoftmax.from_logits(
          s[a:b],
          keep[a:b],
          real[a:b],
          value_fn=lambda p, vb=vb: p @ vb,
          value_norms=vn[a:b],
        )
      )
    if tree == "chain":
      acc = core.PartialSoftmax.empty((), d_v=3, norms=True)
      for p in parts:
        acc = core.merge(acc, p)
    else:
      acc = core.PartialSoftmax.reduce(
        jax.tree.map(lambda *x: jnp.stack(x), *parts), 0
      )
    o, cert = acc.finalize(n_terms=9)
    pos = real & np.isfinite(s)
    valid = bool(np.any(keep & pos))
    self.assertEqual(bool(cert.valid), valid)
    if not valid:
      return
    ok, full = _attn_ld(s, keep, real, v)
    o = np.asarray(o, LD)
    vmax = np.max(np.linalg.norm(_ld(v)[keep & pos], axis=-1))
    # The returned output's own rounding (not covered by the certificate):
    # a few ulps of the largest kept value norm.
    self.assertLessEqual(np.linalg.norm(o - ok), vmax * LD(64 * F32.eps))
    _, tau = _tau_ld(s, keep, real)
    self.assertGreaterEqual(LD(float(cert.tv_bound)), tau)
    err = np.linalg.norm(full - ok)
    self.assertGreaterEqual(LD(float(cert.output_error_bound)), err)
    self.assertEqual(int(cert.k_kept), int(np.sum(keep & pos)))

  def test_huge_values_do_not_overflow(self):
    # Audit finding: decode and Pallas outputs overflowed to inf with valid =
    # True for values ~3e37; a normalised o stays 3e37.
    s = np.zeros(12, np.float32)
    v = np.full((12, 2), 3e37, np.float32)
    parts = [
      core.PartialSoftmax.from_logits(
        s[i : i + 4],
        np.ones(4, bool),
        np.ones(4, bool),
        value_fn=lambda p, vb=v[i : i + 4]: p @ vb,
      )
      for i in (0, 4, 8)
    ]
    acc = core.merge(core.merge(parts[0], parts[1]), parts[2])
    o, cert = acc.finalize(n_terms=12)
    self.assertTrue(bool(cert.valid))
    np.testing.assert_allclose(o, 3e37, rtol=1e-6)

  def test_add_tail_and_empty(self):
    p = core.PartialSoftmax.from_logits(
      np.array([0.0, -1.0], np.float32), np.array([True, False]), np.ones(2)
    )
    p = p.add_tail(np.array([-2.0, 5.0], np.float32), np.array([True, False]))
    _, cert = p.finalize(n_terms=4)
    want = (np.exp(-1.0) + np.exp(-2.0)) / (1 + np.exp(-1.0) + np.exp(-2.0))
    self.assertGreaterEqual(float(cert.tv_bound), want)
    self.assertLess(float(cert.tv_bound), want * 1.0001)
    _, c0 = core.PartialSoftmax.empty((2,)).finalize(n_terms=1)
    np.testing.assert_array_equal(c0.valid, [False, False])
    with self.assertRaisesRegex(ValueError, "both Partials"):
      core.merge(
        core.PartialSoftmax.empty(()), core.PartialSoftmax.empty((), d_v=2)
      )

  def test_partial_under_jit_vmap_and_grad(self):
    s = rand.normal(0, (3, 5, 7))
    v = rand.normal(1, (7, 2))
    keep = s > 0

    def out(s, keep):
      p = core.PartialSoftmax.from_logits(
        s, keep, jnp.ones_like(keep), value_fn=lambda p: p @ v
      )
      return p.finalize(n_terms=7)[0]

    def dense(s, keep):
      return jax.nn.softmax(jnp.where(keep, s, -jnp.inf), -1) @ v

    any_kept = keep.any(-1)[..., None]
    o = jax.jit(jax.vmap(out))(s, keep)
    want = jnp.where(any_kept, dense(s, keep), 0)
    np.testing.assert_allclose(o, want, atol=1e-6)
    g = jax.grad(lambda s: jnp.sum(out(s, keep[0])))(s[0])
    gw = jax.grad(lambda s: jnp.sum(dense(s, keep[0])))(s[0])
    gw = jnp.where(any_kept[0], gw, 0)
    np.testing.assert_allclose(g, gw, atol=1e-5)


class MarginTest(absltest.TestCase):
  def test_search_log_margin(self):
    m0 = float(core.search_log_margin(100, 0.0, jnp.float32))
    m1 = float(core.search_log_margin(100, 0.25, jnp.float32))
    self.assertGreater(m0, 0.0)
    self.assertAlmostEqual(m1 - m0, 1.0, places=6)
    self.assertEqual(
      float(core.search_log_margin(3, np.inf, jnp.float32)), np.inf
    )


class FloatSafeProductTest(parameterized.TestCase):
  """``mul_up``: products of norms and scales neither flush nor overflow."""

  def test_mul_up_sound_and_tight(self):
    @given(x=vectors((3, 4), np.float32))
    def check(x):
      x = np.abs(x)
      got = np.asarray(_mul_up(x[0], x[1], x[2]), LD)
      xs = np.where(np.abs(_ld(x)) < LD(F32.tiny), LD(F32.tiny), _ld(x))
      xs = np.where(_ld(x) == 0, LD(0), xs)  # subnormals read as tiny
      want = xs[0] * xs[1] * xs[2]
      for i in range(4):
        if want[i] == 0:
          self.assertEqual(got[i], 0)
        elif want[i] > LD(F32.max):
          self.assertEqual(got[i], np.inf)
        else:
          self.assertGreaterEqual(got[i], want[i], (x[:, i], got[i]))
          self.assertGreaterEqual(got[i], LD(F32.tiny))
          lim = max(want[i] * LD(1 + 8 * F32.eps), LD(F32.tiny))
          self.assertLessEqual(got[i], lim, (x[:, i], got[i], want[i]))

    check()

  def test_mul_up_products_that_flush_or_overflow_midway(self):
    # (scale ||q||) is subnormal, the product with r is ~1.3: the index's
    # ball term of the second audit; and ||q|| ||k|| overflows while
    # ||q|| ||k|| scale does not.
    got = float(_mul_up(np.float32(0.35), np.float32(1.5e-38), 2.5e38))
    self.assertGreaterEqual(got, 0.35 * 1.5e-38 * 2.5e38)
    self.assertLess(got, 1.32)
    got = float(_mul_up(np.float32(1e30), np.float32(1e30), 1e-30))
    self.assertGreaterEqual(got, 1e30)
    self.assertLess(got, 1.0001e30)
    self.assertEqual(float(_mul_up(np.float32(1e-30), 1e-30)), F32.tiny)
    self.assertEqual(float(_mul_up(np.float32(0.0), 1e30)), 0.0)
    self.assertEqual(float(_mul_up(np.float32(np.inf), 2.0)), np.inf)
    self.assertTrue(np.isnan(_mul_up(np.float32(np.inf), 0.0)))
    self.assertTrue(np.isnan(_mul_up(np.float32(np.nan), 1.0)))

  def test_logit_error_keeps_tiny_query_times_huge_key(self):
    # ||q|| = 1.5e-38 (normal) against ||k|| = 2.5e38 with q flushed: the
    # subnormal-input term F = scale sqrt(d) tiny ||k|| is ~1e-38 * 1e38.
    delta = float(
      core.logit_error_bound(
        q_norm=np.float32(1.5e-38),
        k_norm=np.float32(2.5e38),
        head_dim=4,
        scale=0.5,
        q_flushed=True,
      )
    )
    want = 0.5 * 2 * F32.tiny * 2.5e38  # scale sqrt(d) tiny ||k||
    self.assertGreaterEqual(delta, want)
    self.assertLess(delta, want * 1.01)  # F itself, finite

  def test_compressed_value_norms_sound_and_monotone(self):
    # Norms above 2^126 are stored compressed so that a finite value never
    # gets an infinite norm (output_error_bound was +inf for values near
    # the largest float whatever tv was). Stored norms must keep the order
    # of the true ones (maxima are taken on them) and read back above them.
    rng = np.random.default_rng(0)
    mags = 10.0 ** rng.uniform(-45, 38.53, size=(400, 1))
    v = np.clip(rng.normal(size=(400, 6)) * mags, -F32.max, F32.max)
    v = v.astype(np.float32)
    got = np.asarray(jax.jit(core.value_norms)(v), np.float64)
    want = np.sqrt(np.sum(_ld(v) ** 2, -1))
    self.assertTrue(np.all(np.isfinite(got)))
    # Monotone (up to rounding): the order of clearly different norms is
    # kept, so a maximum of stored norms bounds every norm it covers.
    order = np.argsort(want)
    w, g = want[order], got[order]
    # (above 1e-30: vectors with subnormal components get a floor added)
    apart = (w[1:] > w[:-1] * LD(1.001)) & (w[:-1] > LD(1e-30))
    self.assertTrue(np.all((g[1:] >= g[:-1])[apart]))
    for t in (1.0, 0.3, 1e-6, 1e-30):
      back = np.asarray(_mul_norm_up(np.float32(t), got.astype(np.float32)))
      back = back.astype(LD)
      exact = want * LD(t)
      ok = (back >= exact) | (exact < LD(F32.tiny)) & (back >= LD(F32.tiny))
      self.assertTrue(np.all(ok | (exact == 0)), (t, back[~ok], exact[~ok]))
      fin = exact < LD(F32.max) * LD(0.999)
      self.assertTrue(np.all(np.isfinite(back[fin])), t)

  def test_output_error_bound_finite_for_values_near_max(self):
    # Values [3e38, -3e38, 3e38]: norm 5.2e38 > the largest float.
    vn = core.value_norms(np.full((1, 3), 3e38, np.float32))
    got = float(core.output_error_bound(np.float32(0.01), vn[0], vn[0]))
    want = 0.01 * 2 * np.sqrt(3) * 3e38
    self.assertGreaterEqual(got, want)
    self.assertLess(got, want * 1.001)
    got = float(core.logit_output_error(np.float32(1e-6), vn[0]))
    self.assertTrue(np.isfinite(got))
    self.assertGreaterEqual(got, 2 * (1 - np.exp(-2e-6)) * np.sqrt(3) * 3e38)

  def test_scale_rule(self):
    self.assertTrue(core.scale_ok(1e-38))  # a float: checked at the boundary
    got = jax.jit(core.scale_ok)(
      jnp.array([1.1e-38, 1.2e-38, 0.0, -1.0, np.inf, np.nan, 0.5])
    )
    np.testing.assert_array_equal(
      got, [False, True, False, False, False, False, True]
    )
    self.assertEqual(core.MIN_SCALE, float(F32.tiny))

  def test_mark_invalid_follows_the_rule(self):
    s = np.array([[2.0, 0.0, -1.0], [1.0, 1.0, 0.0]], np.float32)
    keep = np.array([[True, False, False]] * 2)
    cert = core.certificate_from_logits(
      s, keep, np.ones_like(keep), value_norms=np.ones(3, np.float32)
    )
    got = core.mark_invalid(cert, np.array([False, True]))
    np.testing.assert_array_equal(got.valid, [True, False])
    self.assertEqual(float(got.tv_bound[0]), float(cert.tv_bound[0]))
    self.assertTrue(np.isnan(got.tv_bound[1]))
    self.assertTrue(np.isnan(got.log_tv_bound[1]))
    self.assertTrue(np.isnan(got.output_error_bound[1]))
    np.testing.assert_array_equal(got.k_kept, [1, 0])
    np.testing.assert_array_equal(got.keys_scored, cert.keys_scored)


_mul_up = jax.jit(core.mul_up)
_mul_norm_up = jax.jit(core.mul_norm_up)
_value_norms = jax.jit(core.value_norms)


if __name__ == "__main__":
  absltest.main()
