"""Certificates read back from a model are sound against its dense attention.

For every certified layer of a small model, the read-back certificate is
compared with float64 truth computed from the SAME q, k, v the layer used
(its own projections): (1) tv_bound >= the float64 tail mass of the best
possible kept set of that size (any real kept set drops at least as much),
(2) output_error_bound >= ||dense float64 attention - Top-k output||_2, which
checks the real kept set, and (3) Certified(eps) rows certify <= eps.
"""

import chex
import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx

import jaxtopk
from jaxtopk import nn as topk_nn
from tests import rand
from tests.nn.common import BATCH

# Causal self-attention over SEQ tokens; 2 query heads share 1 kv head.
SEQ, FEATURES, HEADS, KV_HEADS = 13, 10, 2, 1
POLICIES = (
  ("fixed_k", jaxtopk.FixedK(3)),
  ("ratio", jaxtopk.Ratio(0.4)),
  ("power_law", jaxtopk.PowerLaw(1.0, 0.5)),
  ("certified_exact", jaxtopk.Certified(0.1)),
  (
    "certified_delta",
    jaxtopk.Certified(0.05, jaxtopk.DeltaSearch(block_size=3)),
  ),
  ("dense", jaxtopk.Dense()),
)


class Model(nnx.Module):
  """Embedding, then two residual causal Top-k attention layers (GQA)."""

  def __init__(self, policy, *, dtype=jnp.float32, rngs):
    self.embed = nnx.Linear(FEATURES, FEATURES, dtype=dtype, rngs=rngs)
    self.blocks = nnx.List(
      [
        topk_nn.CertifiedTopKAttention(
          num_heads=HEADS,
          in_features=FEATURES,
          num_kv_heads=KV_HEADS,
          policy=policy,
          dtype=dtype,
          decode=False,
          rngs=rngs,
        )
        for _ in range(2)
      ]
    )

  def __call__(self, x, mask=None, sow_weights=False):
    h = self.embed(x)
    inputs = []
    for block in self.blocks:
      inputs.append(h)
      h = h + block(h, mask=mask, is_causal=True, sow_weights=sow_weights)
    return h, inputs


def _dense_truth(q, k, v, real):
  """float64 dense attention and its logits from float32/bf16 q, k, v.

  Args:
    q: [b, t, h, d]; k, v: [b, s, hk, d]; real: [b, h, t, s] bool.

  Returns:
    logits [b, h, t, s] (-inf where not real) and output [b, t, h, d].
  """
  q, k, v = (
    np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q, k, v)
  )
  group = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
  logits = np.where(real, logits, -np.inf)
  m = logits.max(-1, keepdims=True)
  p = np.exp(logits - m)
  p /= p.sum(-1, keepdims=True)
  return logits, np.einsum("bhts,bshd->bthd", p, v)


def _best_tail_mass(logits, k_kept):
  """float64 tail mass of the k_kept largest logits per row [b, h, t].

  The tail is summed directly (never 1 - head, which cancels when tiny).
  """
  s = -np.sort(-logits, axis=-1)  # descending, -inf last
  w = np.exp(s - s[..., :1])  # [b, h, t, s]
  rank = np.arange(s.shape[-1])
  tail = np.sum(np.where(rank >= k_kept[..., None], w, 0.0), -1)
  return tail / np.sum(w, -1)


def _check_model(test, model, x, mask, policy):
  _, inputs = model(x, mask)
  certs = topk_nn.collect_certificates(model)
  test.assertEqual(
    sorted(certs), ["blocks/0/last_certificate", "blocks/1/last_certificate"]
  )
  real = jnp.tri(SEQ, dtype=bool)[None, None] & mask
  real = np.broadcast_to(np.asarray(real), (BATCH, HEADS, SEQ, SEQ))
  for i, (block, h) in enumerate(zip(model.blocks, inputs, strict=True)):
    cert = certs[f"blocks/{i}/last_certificate"]
    q, k, v = block.query(h), block.key(h), block.value(h)
    # The layer's core on the same q, k, v reproduces the read-back one.
    out, again = topk_nn.certified_attention(
      q, k, v, policy=policy, mask=mask, is_causal=True
    )
    chex.assert_trees_all_equal(cert, again)
    logits, dense = _dense_truth(q, k, v, real)
    valid = np.asarray(cert.valid)  # [b, t, h]
    test.assertTrue(valid.all())
    k_kept = np.asarray(cert.k_kept).transpose(0, 2, 1)  # [b, h, t]
    tau = _best_tail_mass(logits, k_kept).transpose(0, 2, 1)  # [b, t, h]
    bound = np.asarray(cert.tv_bound, np.float64)
    test.assertTrue(np.all(bound >= tau), f"layer {i}: {np.max(tau - bound)=}")
    err = np.linalg.norm(np.asarray(out, np.float32) - dense, axis=-1)
    # Plus the rounding of the returned output to its dtype (a few ulps of
    # the largest value norm: exp, normalisation and the weighted sum each
    # add a few), which the certificate does not cover.
    v_max = np.linalg.norm(np.asarray(v, np.float32), axis=-1).max()
    eps_out = 16 * float(jnp.finfo(out.dtype).eps) * v_max
    err_bound = np.asarray(cert.output_error_bound, np.float64) + eps_out
    test.assertTrue(
      np.all(err <= err_bound), f"layer {i}: {np.max(err - err_bound)=}"
    )
    if isinstance(policy, jaxtopk.Certified):
      test.assertLessEqual(float(bound.max()), policy.eps)
    if isinstance(policy, jaxtopk.FixedK):
      np.testing.assert_array_equal(
        k_kept, np.minimum(policy.topk, real.sum(-1))
      )


class SoundnessTest(parameterized.TestCase):
  @parameterized.named_parameters(
    (f"{name}_{case}", policy, case)
    for name, policy in POLICIES
    for case in ("random", "ties", "wide")
  )
  def test_read_back_certificates_are_sound(self, policy, case):
    model = Model(policy, rngs=nnx.Rngs(0))
    x = rand.normal(0, (BATCH, SEQ, FEATURES))
    if case == "ties":  # repeated tokens: equal keys, tied logits
      x = jnp.concatenate([x[:, :4]] * 4, axis=1)[:, :SEQ]
    if case == "wide":  # huge logit ranges
      x = 30.0 * x
    # Padding: row b has its last b keys masked.
    mask = (jnp.arange(SEQ) < SEQ - jnp.arange(BATCH)[:, None])[
      :, None, None, :
    ]
    _check_model(self, model, x, mask, policy)

  @pytest.mark.slow
  def test_bfloat16_model(self):
    policy = jaxtopk.FixedK(4)
    model = Model(policy, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = rand.normal(0, (BATCH, SEQ, FEATURES))
    mask = jnp.ones((1, 1, 1, SEQ), bool)
    _check_model(self, model, x.astype(jnp.bfloat16), mask, policy)

  @pytest.mark.slow
  @hypothesis.settings(max_examples=10)
  @hypothesis.given(
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([0.1, 1.0, 5.0, 40.0]),
    ties=st.booleans(),
  )
  def test_property_fixed_k(self, seed, scale, ties):
    policy = jaxtopk.FixedK(3)
    model = Model(policy, rngs=nnx.Rngs(0))
    x = scale * rand.normal(seed, (BATCH, SEQ, FEATURES))
    if ties:  # every key repeated: tied logits at the Top-k boundary
      x = jnp.repeat(x[:, : (SEQ + 1) // 2], 2, axis=1)[:, :SEQ]
    mask = jnp.ones((1, 1, 1, SEQ), bool)
    _check_model(self, model, x, mask, policy)


class DecodeSoundnessTest(parameterized.TestCase):
  """Step-by-step decode certificates (decode_attention over the KVCache)."""

  @parameterized.named_parameters(
    ("fixed_k", jaxtopk.FixedK(3)),
    (
      "certified_delta",
      jaxtopk.Certified(0.05, jaxtopk.DeltaSearch(block_size=4)),
    ),
    ("certified_mc", jaxtopk.Certified(0.05, jaxtopk.MCSearch(block_size=4))),
  )
  @pytest.mark.slow
  def test_decode_certificates_are_sound(self, policy):
    layer = topk_nn.CertifiedTopKAttention(
      num_heads=HEADS,
      in_features=FEATURES,
      num_kv_heads=KV_HEADS,
      policy=policy,
      decode=False,
      rngs=nnx.Rngs(0),
    )
    x = 3.0 * rand.normal(0, (BATCH, SEQ, FEATURES))
    # The same projections the decode steps compute, token by token.
    q, k, v = layer.query(x), layer.key(x), layer.value(x)
    layer.init_cache(x.shape)
    for t in range(SEQ):
      layer(x[:, t : t + 1], decode=True)
      cert = layer.last_certificate.get_value()  # [batch, 1, heads]
      self.assertTrue(bool(jnp.all(cert.valid)))
      real = np.zeros((BATCH, HEADS, 1, SEQ), bool)
      real[..., : t + 1] = True
      logits, _ = _dense_truth(q[:, t : t + 1], k, v, real)
      k_kept = np.asarray(cert.k_kept).transpose(0, 2, 1)  # [b, h, 1]
      tau = _best_tail_mass(logits, k_kept).transpose(0, 2, 1)
      bound = np.asarray(cert.tv_bound, np.float64)
      mc = isinstance(policy, jaxtopk.Certified) and policy.search.needs_rng
      if mc:
        # MC-Search holds with probability >= 1 - delta per row, so its
        # bound is not compared with the truth row by row here.
        self.assertEqual(cert.failure_prob, policy.failure_prob)
      else:
        self.assertTrue(np.all(bound >= tau), f"step {t}: {tau - bound}")
        # Keys plus the block boxes read (2 key-equivalents per block).
        bs = getattr(policy, "block_size", None)
        blocks = -(-(t + 1) // bs) if bs else 0
        scored = np.asarray(cert.keys_scored)
        self.assertTrue(np.all(scored <= t + 1 + 2 * blocks), scored)
      if isinstance(policy, jaxtopk.Certified):
        self.assertLessEqual(float(bound.max()), policy.eps)


class CollectTest(absltest.TestCase):
  def test_per_head_report(self):
    model = Model(jaxtopk.FixedK(3), rngs=nnx.Rngs(0))
    self.assertEqual(topk_nn.collect_certificates(model), {})
    x = rand.normal(0, (BATCH, SEQ, FEATURES))
    model(x)
    certs = topk_nn.collect_certificates(model)
    report = topk_nn.per_head_report(certs["blocks/0/last_certificate"])
    self.assertEqual(report["tv_bound_max"].shape, (HEADS,))
    # Causal: query i has i + 1 keys, so the mean kept count is below 3.
    want = np.mean(np.minimum(np.arange(1, SEQ + 1), 3))
    np.testing.assert_allclose(report["k_kept_mean"], want)
    np.testing.assert_allclose(report["valid_fraction"], 1.0)

  def test_sow_weights_sows_the_same_certificates(self):
    model = Model(jaxtopk.FixedK(3), rngs=nnx.Rngs(0))
    x = rand.normal(0, (BATCH, SEQ, FEATURES))
    _, inter = nnx.capture(model, nnx.Intermediate)(x)
    self.assertEqual(topk_nn.collect_certificates(inter), {})  # as Flax
    _, inter = nnx.capture(model, nnx.Intermediate)(x, sow_weights=True)
    sown = topk_nn.collect_certificates(inter)
    kept = topk_nn.collect_certificates(model)
    self.assertEqual(
      sorted(sown), ["blocks/0/certificate/0", "blocks/1/certificate/0"]
    )
    for i in (0, 1):
      chex.assert_trees_all_close(
        sown[f"blocks/{i}/certificate/0"],
        kept[f"blocks/{i}/last_certificate"],
      )


if __name__ == "__main__":
  absltest.main()
