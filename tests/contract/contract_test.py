"""THE attention contract: every variant x every policy x every family.

Modelled on optax's shared optimizer test. The variants
are ``variants.VARIANTS`` (one line each), the policies
``policies.POLICIES`` (one line each), the adversarial families
``families.FAMILIES``; the float64 truth is ``reference`` (the one reference
module of the test suite); the per-call checks are ``harness.check``.

Per (variant, policy) cell:
- ``test_contract``: a supported policy runs on hypothesis-drawn float32
  cases of every family (one compiled function per cell): shape, dtype,
  validity rule, soundness of tv_bound / log_tv_bound / output_error_bound
  against the reference, the output against the exact attention, every
  policy field honoured; then jit + vmap of the same variant on a batch of
  two cases equal the jitted call on each (in CI on one certified cell of
  each variant, ``_VMAP_CI``; soak: every cell). An
  unsupported policy (or an input the variant does not take, e.g. a per-row
  mask on a key-padding-only path) must be refused with an error naming the
  field (or the argument).
- ``test_low_precision``: bfloat16 and float16 inputs (one policy; in CI
  one of the two per variant, alternating).
- ``test_gradient``: where the variant supports it, gradients equal the
  float64 gradient of attention over the kept keys (THEORY 8.2).
- ``test_one_key``: kv_len = 1.
- ``test_eager``: the variant called without jit equals its jitted form
  (one policy per variant; in CI the variants of ``_EAGER_CI``, soak:
  every variant).

Cells that fail on paths this branch does not own are listed ONCE, in
``EXPECTED_FAILURES`` with a reason; they run, and must fail (an expected
failure that passes is an error: remove it from the list). The list is
emptied as the owners land their fixes.

CI runs the derandomized ``ci`` hypothesis profile with ``_EXAMPLES``
examples per cell; ``HYPOTHESIS_PROFILE=soak`` draws 500 fresh ones.
"""

import os

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized

from jaxtopk.selection import UnsupportedPolicyError
from tests import rand
from tests import tolerances
from tests.contract import families as fam
from tests.contract import harness
from tests.contract import policies as pol
from tests.contract import reference
from tests.contract import variants as var

# (variant, policy or dtype, test) -> why it fails today. ONE place,
# emptied as the fixes of these paths land (an entry that passes fails the
# test: remove it). Every cell here still
# runs all its checks; the xfail message lists what failed.
EXPECTED_FAILURES: dict[tuple[str, str, str], str] = {}

_SOAK = os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci"
# Examples per cell: many cells share the CI budget; soak draws 500.
_EXAMPLES = hypothesis.settings.default.max_examples if _SOAK else 2
_LOWP_POLICY = ("cert_exact", "cert_delta", "dense")


def _supported(variant, policy) -> bool:
  return pol.features(policy) <= variant.supported(policy)


def _cells():
  for v in var.VARIANTS:
    for p_name, policy in pol.POLICIES:
      ci = v.ci_policies
      if not _SOAK and ci is not None and p_name not in ci:
        if _supported(v, policy):
          continue  # CI crosses a few (variants.Variant.ci_policies)
      yield (f"{v.name}__{p_name}", v.name, p_name)


# jit(vmap(variant)) compiles a second program per cell: CI checks it on
# one certified search policy of each variant (else its first certified or
# supported one), soak on every cell.
_VMAP_CI = ("cert_delta",)

# test_eager dispatches op by op (slow): CI runs it on one variant per
# public entry point whose un-jitted call differs from the jitted one
# (checks on concrete values, donation): topk_attention, KVCache with
# decode_attention, IndexedKVCache, certify/grow_selection. The others call
# the same entry points (pallas_*, cache_appends), see tracers either way
# (the sharded ones under vmap) or are jitted adapters (the Flax ones);
# soak runs every variant.
_EAGER_CI = ("xla_prefill", "xla_decode", "index", "given_set")


def _vmap_policies(variant) -> tuple[str, ...]:
  """The policies whose cells check jit + vmap in CI (at least one)."""
  ran = [c[2] for c in _cells() if c[1] == variant.name]
  ok = [p for p in ran if _supported(variant, pol.BY_NAME[p])]
  certified = [p for p in ok if p.startswith("cert_")]
  return tuple(p for p in ok if p in _VMAP_CI) or tuple((certified or ok)[:1])


def _low_precision_cells():
  """(variant, dtype) cells: in CI one dtype per variant, the variants
  alternating between them (every dtype on about half the variants); soak:
  every dtype of every variant."""
  for i, v in enumerate(var.VARIANTS):
    dtypes = v.low_precision
    if not _SOAK and dtypes:
      dtypes = (dtypes[i % len(dtypes)],)
    for d in dtypes:
      yield (f"{v.name}__{d}", v.name, d)


def _args(variant, case):
  """The variant's arguments for ``case``: always a mask (and a bias where
  the variant takes one), in ONE shape per variant, so that every case
  reuses one compiled function."""
  b, t, n = fam.B, fam.T, fam.N
  mask = np.ones((b, 1, t, n), bool) if case.mask is None else case.mask
  if variant.masks == "padding" and case.padding_only:
    mask = mask[:, :, :1, :]  # [B, 1, 1, N]: key padding
  bias = None
  if variant.bias:
    bias = case.bias
    if bias is None:
      bias = np.zeros((b, fam.H, t, n), np.float32)
  return (
    jnp.asarray(case.q),
    jnp.asarray(case.k),
    jnp.asarray(case.v),
    jnp.asarray(mask),
    None if bias is None else jnp.asarray(bias),
  )


def _takes(variant, case) -> str | None:
  """Why ``variant`` must refuse ``case`` ('mask'), or None if it takes it.

  A case with a bias is never given to a variant without a bias argument.
  """
  if variant.masks == "padding" and not case.padding_only:
    return "mask"
  return None


def _family_ok(variant, family) -> bool:
  return variant.bias or family != "neg_inf_bias"


class _Outcome:
  """Runs a cell's checks; an expected failure is collected, not raised.

  A cell listed in ``EXPECTED_FAILURES`` runs every check (no hypothesis
  shrinking) and records each distinct failure; at the end it must have
  failed (xfail, with what failed) or the test errors (remove the entry).
  """

  def __init__(self, key):
    self.key = key
    self.reason = EXPECTED_FAILURES.get(key)
    self.failures = {}

  def run(self, fn, *args):
    if self.reason is None:
      return fn(*args)
    try:
      return fn(*args)
    except Exception as e:  # noqa: BLE001 (recorded, reported at the end)
      what = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
      self.failures.setdefault(what, 0)
      self.failures[what] += 1
      return None

  def finish(self):
    if self.reason is None:
      return
    if not self.failures:
      raise AssertionError(
        f"{self.key} is in EXPECTED_FAILURES ({self.reason!r}) but passed:"
        " remove it from the list"
      )
    seen = "; ".join(f"{n}x {w}" for w, n in self.failures.items())
    pytest.xfail(f"{self.reason} [{seen[:1500]}]")


def _call(variant, policy_name, dtype_name, case, jit=True):
  fn = (var.compiled if jit else var.eager)(
    variant.name, policy_name, dtype_name
  )
  return fn(*_args(variant, case))


def _check_refused(test, variant, policy, fn):
  """``fn()`` raises an error naming a field of ``policy`` it cannot honour."""
  with test.assertRaises((UnsupportedPolicyError, NotImplementedError)) as cm:
    fn()
  msg = str(cm.exception)
  missing = [
    (f if "." in f else repr(val))
    for f, val, feat in policy.features()
    if feat not in variant.supported(policy)
  ]
  test.assertTrue(
    any(m in msg for m in missing), f"{msg!r} names none of {missing}"
  )


class ContractTest(parameterized.TestCase):
  @parameterized.named_parameters(*_cells())
  def test_contract(self, variant_name, policy_name):
    variant = var.BY_NAME[variant_name]
    policy = pol.BY_NAME[policy_name]
    outcome = _Outcome((variant_name, policy_name, "contract"))
    if not _supported(variant, policy):
      case = fam.fixed_case("normal")
      _check_refused(
        self,
        variant,
        policy,
        lambda: _call(variant, policy_name, "float32", case),
      )
      return
    families = [f for f in fam.FAMILIES if _family_ok(variant, f)]

    @hypothesis.settings(max_examples=_EXAMPLES)
    @hypothesis.given(case=fam.cases("float32", families))
    def prop(case):
      outcome.run(self._one, variant, policy_name, case)

    for family in families:  # every family at least once, then random
      outcome.run(self._one, variant, policy_name, fam.fixed_case(family))
    prop()
    if _SOAK or policy_name in _vmap_policies(variant):
      outcome.run(self._jit_vmap, variant, policy_name)
    outcome.finish()

  def _one(self, variant, policy_name, case, dtype_name="float32"):
    policy = pol.BY_NAME[policy_name]
    why = _takes(variant, case)
    if why is not None:
      with self.assertRaisesRegex((NotImplementedError, ValueError), why):
        _call(variant, policy_name, dtype_name, case)
      return
    out, cert = _call(variant, policy_name, dtype_name, case)
    harness.check(variant, policy, case, out, cert)

  def _jit_vmap(self, variant, policy_name):
    """jit(vmap(variant)) over two cases == the jitted call on each (the
    jitted call == the eager one: ``test_eager``)."""
    cases = [fam.fixed_case("padding", seed=s) for s in (1, 2)]
    eager = var.eager(variant.name, policy_name, "float32")
    one = var.compiled(variant.name, policy_name, "float32")
    want = [one(*_args(variant, c)) for c in cases]
    stacked = jax.tree.map(
      lambda *xs: jnp.stack(xs), *[_args(variant, c) for c in cases]
    )
    fn = jax.jit(jax.vmap(eager))
    got = fn(*stacked)
    for i, (o, c) in enumerate(want):
      go, gc = jax.tree.map(lambda x, i=i: x[i], got)
      np.testing.assert_allclose(go, o, **tolerances.tol(jnp.float32))
      np.testing.assert_array_equal(gc.valid, c.valid)
      np.testing.assert_array_equal(gc.k_kept, c.k_kept)
      np.testing.assert_allclose(gc.tv_bound, c.tv_bound, rtol=1e-5, atol=0)

  @parameterized.named_parameters(*_low_precision_cells())
  def test_low_precision(self, variant_name, dtype_name):
    variant = var.BY_NAME[variant_name]
    policy_name = next(
      p for p in _LOWP_POLICY if _supported(variant, pol.BY_NAME[p])
    )
    outcome = _Outcome((variant_name, dtype_name, "low_precision"))
    families = [f for f in fam.FAMILIES if _family_ok(variant, f)]

    @hypothesis.settings(max_examples=_EXAMPLES)
    @hypothesis.given(case=fam.cases(dtype_name, families))
    def prop(case):
      outcome.run(self._one, variant, policy_name, case, dtype_name)

    for family in families:
      case = fam.fixed_case(family, dtype_name)
      outcome.run(self._one, variant, policy_name, case, dtype_name)
    prop()
    outcome.finish()

  @parameterized.named_parameters(*[(v.name, v.name) for v in var.VARIANTS])
  def test_one_key(self, variant_name):
    """kv_len = 1: the single key is kept, tv 0, output = its value."""
    variant = var.BY_NAME[variant_name]
    policy_name = next(
      p for p in _LOWP_POLICY if _supported(variant, pol.BY_NAME[p])
    )
    outcome = _Outcome((variant_name, policy_name, "one_key"))
    outcome.run(self._one_key, variant, policy_name)
    outcome.finish()

  def _one_key(self, variant, policy_name):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((fam.B, fam.T, fam.H, fam.D)).astype(np.float32)
    k = rng.standard_normal((fam.B, 1, fam.HK, fam.D)).astype(np.float32)
    v = rng.standard_normal((fam.B, 1, fam.HK, fam.E)).astype(np.float32)
    fn = jax.jit(var.eager(variant.name, policy_name, "float32"))
    out, cert = fn(q, k, v, None, None)
    self.assertEqual(out.shape, (fam.B, fam.T, fam.H, fam.E))
    want = np.broadcast_to(v[:, :1], out.shape)
    np.testing.assert_allclose(out, want, **tolerances.tol(jnp.float32))
    np.testing.assert_array_equal(cert.valid, True)
    np.testing.assert_array_equal(cert.k_kept, 1)
    np.testing.assert_array_equal(cert.tv_bound, 0.0)
    # Nothing dropped: only the logits' rounding moves the output (here
    # not at all: one key has weight 1), bounded by a few ulps of |v|.
    bound = np.asarray(cert.output_error_bound)
    self.assertTrue(np.all((bound >= 0) & (bound <= 1e-4)), bound)


class SlowContractTest(parameterized.TestCase):
  """The heavier checks (eager dispatch, gradients): marked slow, sized to
  one fixed case each (still run by default, as every slow test)."""

  pytestmark = pytest.mark.slow

  @parameterized.named_parameters(
    *[
      (v.name, v.name)
      for v in var.VARIANTS
      if v.eager and (_SOAK or v.name in _EAGER_CI)
    ]
  )
  def test_eager(self, variant_name):
    """Called without jit, the variant returns what its jitted form does.

    One policy per variant (eager calls dispatch op by op: slow).
    """
    variant = var.BY_NAME[variant_name]
    policy_name = next(
      p for p in _LOWP_POLICY if _supported(variant, pol.BY_NAME[p])
    )
    outcome = _Outcome((variant_name, policy_name, "eager"))
    outcome.run(self._eager, variant, policy_name)
    outcome.finish()

  def _eager(self, variant, policy_name):
    case = fam.fixed_case("padding", seed=1)
    args = _args(variant, case)
    o, c = var.eager(variant.name, policy_name, "float32")(*args)
    jo, jc = var.compiled(variant.name, policy_name, "float32")(*args)
    np.testing.assert_allclose(o, jo, **tolerances.tol(jnp.float32))
    np.testing.assert_array_equal(c.valid, jc.valid)
    np.testing.assert_array_equal(c.k_kept, jc.k_kept)
    np.testing.assert_allclose(c.tv_bound, jc.tv_bound, rtol=1e-5, atol=0)

  @parameterized.named_parameters(
    *[
      (f"{v.name}__{p}", v.name, p)
      for v in var.VARIANTS
      if v.grad
      for p in ("dense", "fixed_k", "cert_exact")
    ]
  )
  def test_gradient(self, variant_name, policy_name):
    variant = var.BY_NAME[variant_name]
    policy = pol.BY_NAME[policy_name]
    if not _supported(variant, policy):
      return  # refusal is checked by test_contract
    outcome = _Outcome((variant_name, policy_name, "gradient"))
    outcome.run(self._gradient, variant, policy_name)
    outcome.finish()

  def _gradient(self, variant, policy_name):
    case = fam.fixed_case("normal", seed=3)
    q, k, v, mask, bias = _args(variant, case)
    fn = var.eager(variant.name, policy_name, "float32")
    ct = rand.normal(0, (fam.B, fam.T, fam.H, fam.E))

    def loss(q, k, v):
      out, _ = fn(q, k, v, mask, bias)
      return jnp.sum(out * ct)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    out, _ = var.compiled(variant.name, policy_name, "float32")(
      q, k, v, mask, bias
    )
    keep = np.swapaxes(np.asarray(out)[..., : fam.N] > 0, 1, 2)
    qh, kh, vh = reference.head_major(case.q, case.k, case.v)
    want = reference.kept_attention_grads(
      qh, kh, vh, keep, np.swapaxes(np.asarray(ct), 1, 2), scale=variant.scale
    )
    dq = np.swapaxes(want[0], 1, 2)
    dk = np.swapaxes(reference.sum_groups(want[1], fam.HK), 1, 2)
    dv = np.swapaxes(reference.sum_groups(want[2], fam.HK), 1, 2)
    for got, exp in zip(grads, (dq, dk, dv), strict=True):
      np.testing.assert_allclose(got, exp, atol=2e-5, rtol=2e-4)


if __name__ == "__main__":
  absltest.main()
