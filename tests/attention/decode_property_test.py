"""decode_attention certificates vs float64 truth (property tests).

Values are the identity (v_j = e_j), so the output IS the truncated
distribution P_hat: the kept set is the output's support, the dropped mass
tau and ||P_hat - P|| are read against float64 softmax of the same inputs.
Rows are long enough (N = 128) for the bracket / candidate paths of the XLA
decode to run (``CANDIDATE_MIN_KEYS`` lowered to 0 here), not only the
full-row fallbacks.
"""

import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import jaxtopk
from jaxtopk.attention import _decode as decode_impl


@pytest.fixture(autouse=True, scope="module")
def _candidate_path():
  with mock.patch.object(decode_impl, "CANDIDATE_MIN_KEYS", 0):
    yield


# CI draws 20 examples (compile-bound); HYPOTHESIS_PROFILE=soak draws 500.
_CI_EXAMPLES = (
  settings.default.max_examples
  if os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci"
  else 20
)

N, D, H, BS = 128, 4, 2, 16  # cache length, head dim, heads, block size
TINY = float(np.finfo(np.float32).tiny)

POLICIES = (
  jaxtopk.FixedK(3),  # Ratio shares this path (a traced per-row count)
  jaxtopk.Certified(0.05),
  jaxtopk.Certified(0.01, max_topk=4),
  jaxtopk.Certified(0.01, jaxtopk.DeltaSearch(block_size=BS), max_topk=4),
  # A tiny failure probability: the check below may then be deterministic.
  jaxtopk.Certified(0.05, jaxtopk.MCSearch(block_size=BS, failure_prob=1e-9)),
)


@st.composite
def decode_rows(draw):
  """(q [H, D], k [N, D], length): random and adversarial decode rows.

  Kinds: peaked (logit std ~4), flat (std ~0.1), ties (keys from 3 values),
  huge (logits ~1e30 apart), subnormal key components next to normal ones,
  mixed magnitudes (components 1e-20 .. 1e18).
  """
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  kind = draw(
    st.sampled_from(["peaked", "flat", "ties", "huge", "subnormal", "mixed"])
  )
  length = draw(st.sampled_from([1, 2, 5, 37, 100, N]))
  q = rng.normal(size=(H, D))
  k = rng.normal(size=(N, D))
  if kind == "peaked":
    k *= 4.0
  elif kind == "flat":
    k *= 0.05
  elif kind == "ties":
    k = rng.normal(size=(3, D))[rng.integers(0, 3, N)]
  elif kind == "huge":
    q[:, 0] = 1.0
    k[:, 0] = rng.choice([-1e30, 0.0, 1e29, 1e30], N)
  elif kind == "subnormal":
    k[:, 0] = rng.choice([1e-39, -3e-42, 1e-45, 0.0], N)
    q[:, 0] = rng.choice([1e3, 1e-40], H)
  else:
    k = k * 10.0 ** rng.integers(-20, 19, (N, 1))
  return np.float32(q), np.float32(k), length


def _truth(q, k, length, scale):
  """float64 softmax of one head: q [D], k [N, D] -> p [N] (0 past length)."""
  s = np.asarray(k[:length], np.float64) @ np.asarray(q, np.float64) * scale
  p = np.exp(s - s.max())
  out = np.zeros(N)
  out[:length] = p / p.sum()
  return out, s


def _decode(q, k, length, policy, dtype):
  cache = jaxtopk.KVCache.create(
    1, N, 1, D, block_size=BS, dtype=dtype, value_dim=N
  )
  eye = jnp.eye(N, dtype=dtype)[None, :, None, :]
  cache = cache.append(
    jnp.asarray(k, dtype)[None, :, None, :],
    eye,
    num_steps=jnp.array([length]),
  )
  return jaxtopk.decode_attention(
    jnp.asarray(q, dtype)[None, None],
    cache,
    policy=policy,
    rng=jax.random.key(0),
  )


class DecodeSoundnessTest(parameterized.TestCase):
  @pytest.mark.slow  # ~10 compilations (5 policies x 2 dtypes), 60 examples
  @settings(max_examples=_CI_EXAMPLES)
  @given(
    row=decode_rows(),
    which=st.integers(0, len(POLICIES) - 1),
    bf16=st.booleans(),
  )
  def test_certificate_sound_vs_float64(self, row, which, bf16):
    q, k, length = row
    policy = POLICIES[which]
    dt = jnp.bfloat16 if bf16 else jnp.float32
    out, cert = _decode(q, k, length, policy, dt)
    # The inputs as the library saw them (bf16-rounded), in float64.
    q64 = np.asarray(jnp.asarray(q, dt).astype(jnp.float32), np.float64)
    k64 = np.asarray(jnp.asarray(k, dt).astype(jnp.float32), np.float64)
    eps_out = float(jnp.finfo(dt).eps)
    # Normal magnitudes (no subnormal, no huge input): logit errors are then
    # small, and a certified row must meet its eps.
    x = np.abs(np.concatenate([q64.ravel(), k64[:length].ravel()]))
    benign = bool(np.all((x == 0) | ((x >= TINY) & (x < 1e6))))
    for h in range(H):
      p, s = _truth(q64[h], k64, length, 1 / np.sqrt(D))
      o = np.asarray(out[0, 0, h].astype(jnp.float32), np.float64)
      c = jax.tree.map(lambda x, h=h: x[0, 0, h], cert)
      kept = int(c.k_kept)
      self.assertLessEqual(int(np.sum(o > 0)), kept)
      max_topk = getattr(policy, "max_topk", None)
      if max_topk is not None:
        self.assertLessEqual(kept, max_topk)
      if isinstance(policy, jaxtopk.FixedK):
        self.assertEqual(kept, min(3, length))
      normal = np.all(np.isfinite(s)) and np.all(np.abs(s) < 3e38)
      if not bool(c.valid):
        self.assertFalse(normal, f"invalid normal row {s[:6]}")
        continue
      tv = float(c.tv_bound)
      tau = float(np.sum(p[o <= 0]))
      slack = N * TINY
      self.assertGreaterEqual(tv, tau - slack)
      err = float(np.linalg.norm(p - o))
      rnd = 16 * eps_out * max(float(np.linalg.norm(o)), TINY)
      self.assertGreaterEqual(float(c.output_error_bound), err - rnd - slack)
      if isinstance(policy, jaxtopk.Certified) and np.isfinite(tv):
        capped = max_topk is not None and kept >= max_topk
        if not capped and benign:
          self.assertLessEqual(tv, policy.eps)


class DecodeRegressionTest(parameterized.TestCase):
  # The policies, shapes, scale and key of test_huge_values_do_not_overflow:
  # its compiled programs.
  @parameterized.parameters(
    jaxtopk.FixedK(3),
    jaxtopk.Ratio(1 / 64),
    jaxtopk.Certified(0.05),
  )
  def test_tiny_tail_is_not_zero(self, policy):
    # tau = e^-97 ~ 7.5e-43 (subnormal in float32): a float32 tail sum read
    # 0; the bound must stay >= tau.
    n = 256
    s = np.full(n, -97.0, np.float32)
    s[:2] = 0.0
    k = np.zeros((n, D), np.float32)
    k[:, 0] = 2 * s  # logits s at the default scale 1/sqrt(D) = 1/2
    cache = jaxtopk.KVCache.create(1, n, 1, D, block_size=BS)
    cache = cache.append(
      jnp.asarray(k)[None, :, None], jnp.asarray(k)[None, :, None]
    )
    q = jnp.asarray([1.0, 0.0, 0.0, 0.0])[None, None, None]
    _, cert = jaxtopk.decode_attention(
      q, cache, policy=policy, rng=jax.random.key(0)
    )
    kept = int(cert.k_kept[0, 0, 0])
    want = {jaxtopk.Ratio: 4, jaxtopk.FixedK: 3}.get(type(policy), 2)
    self.assertEqual(kept, want)
    e = np.exp(-97.0)
    tau = (n - kept) * e / (2 + (n - 2) * e)
    self.assertTrue(bool(cert.valid[0, 0, 0]))
    self.assertGreaterEqual(float(cert.tv_bound[0, 0, 0]), tau)

  @parameterized.parameters(
    jaxtopk.FixedK(3),
    jaxtopk.Ratio(1 / 64),
    jaxtopk.Dense(),
    jaxtopk.Certified(0.05),
    jaxtopk.Certified(0.05, jaxtopk.DeltaSearch(block_size=BS)),
  )
  def test_huge_values_do_not_overflow(self, policy):
    n = 256
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.normal(size=(1, n, 1, D)), jnp.float32)
    v = jnp.full((1, n, 1, D), 3e37, jnp.float32)
    cache = jaxtopk.KVCache.create(1, n, 1, D, block_size=BS)
    cache = cache.append(k, v)
    out, cert = jaxtopk.decode_attention(
      jnp.ones((1, 1, 1, D)), cache, policy=policy, rng=jax.random.key(0)
    )
    self.assertTrue(bool(cert.valid[0, 0, 0]))
    np.testing.assert_allclose(out[0, 0, 0], 3e37, rtol=1e-5)
    self.assertTrue(np.isfinite(float(cert.output_error_bound[0, 0, 0])))

  @parameterized.parameters(jaxtopk.Dense(), jaxtopk.Certified(0.05))
  def test_flushed_query_moves_kept_logits(self, policy):
    # Where the backend flushes subnormals (CPU, TPU), q_0 = 1e-38 is read
    # as 0: the logits 2 and 3 are computed as 5 and 3. Every key is kept
    # (tv 0), yet the output is ~0.87 off: the output bound must cover the
    # kept keys' logit error. A GPU keeps subnormals in float32: its logits
    # are right and the output is close; the bound must hold there too.
    q = np.array([1e-38, 1, 0, 0], np.float32)
    k = np.zeros((8, D), np.float32)
    k[0, :2], k[1, 1] = (-3e38, 5), 3
    dot = jax.jit(lambda a, b: jnp.dot(a, b, precision="highest"))
    flushes = float(dot(jnp.asarray(q), jnp.asarray(k[0]))) == 5.0
    cache = jaxtopk.KVCache.create(1, 8, 1, D, block_size=8, value_dim=2)
    cache = cache.append(
      jnp.asarray(k[:2])[None, :, None],
      jnp.eye(2)[None, :, None],
    )
    out, cert = jaxtopk.decode_attention(
      jnp.asarray(q)[None, None, None], cache, policy=policy, scale=1.0
    )
    p = np.exp([2.0, 3.0]) / np.exp([2.0, 3.0]).sum()
    err = np.linalg.norm(np.asarray(out[0, 0, 0], np.float64) - p)
    if flushes:
      self.assertGreater(err, 0.5)
    else:
      self.assertLess(err, 1e-5)
    self.assertGreaterEqual(float(cert.output_error_bound[0, 0, 0]), err)

  @parameterized.parameters("exact", "delta", "mc")
  def test_max_topk_caps_every_strategy(self, search):
    # Rows of ``_decode`` (delta: the program of POLICIES[3]).
    rng = np.random.default_rng(1)
    strategy = dict(
      exact="exact",
      delta=jaxtopk.DeltaSearch(block_size=BS),
      mc=jaxtopk.MCSearch(block_size=BS),
    )[search]
    policy = jaxtopk.Certified(0.01, strategy, max_topk=4)
    for _ in range(2):
      k = np.float32(0.1 * rng.normal(size=(N, D)))
      q = np.float32(rng.normal(size=(H, D)))
      _, cert = _decode(q, k, N, policy, jnp.float32)
      self.assertTrue(np.all(np.asarray(cert.k_kept) <= 4))
      self.assertTrue(np.all(np.asarray(cert.k_kept) >= 1))
      # Flat rows: 4 keys cannot meet eps; the row reports its true bound.
      self.assertTrue(np.all(np.asarray(cert.tv_bound) > 0.01))
      self.assertTrue(np.all(np.asarray(cert.valid)))


if __name__ == "__main__":
  absltest.main()
