"""Checks of the contract test: one attention call against THE reference.

``check(variant, policy, case, out, cert)`` asserts everything a variant
promises on one input (shapes and dtypes, validity, soundness, the
policy's fields honoured, agreement with the float64 reference); the test
file decides which inputs and which variants. Kept sets are read off the
output's identity columns (``families``): key j is kept iff its computed
weight is > 0.
"""

import math

import jax.numpy as jnp
import numpy as np

from jaxtopk.selection import Certified
from jaxtopk.selection import FixedCount
from tests import tolerances
from tests.contract import families as fam
from tests.contract import reference

F32 = np.finfo(np.float32)
# Families whose outputs must agree with the reference to the dtype's
# tolerance (elsewhere the logits' own rounding, which the certificate
# covers, can move the output by much more than a tolerance).
PLAIN = {"normal", "ties", "dominant", "padding", "row_masks", "neg_inf_bias"}


def out_info(dtype):
  """finfo of the output dtype (bfloat16 included)."""
  return jnp.finfo(dtype)


def head_major_cert(cert):
  """Certificate fields ``[B, T, H]`` -> numpy ``[B, H, T]``."""
  f = lambda x: None if x is None else np.swapaxes(np.asarray(x), 1, 2)  # noqa: E731
  return {
    "tv": f(cert.tv_bound),
    "log_tv": f(cert.log_tv_bound),
    "k_kept": f(cert.k_kept),
    "keys_scored": f(cert.keys_scored),
    "oeb": f(cert.output_error_bound),
    "valid": f(cert.valid),
  }


def truth_of(variant, case):
  q, k, v = case.q, case.k, case.v
  if variant.effective is not None:
    q, k, v = variant.effective(q, k, v)
  qh, kh, vh = reference.head_major(q, k, v)
  return reference.Truth(
    qh, kh, vh, scale=variant.scale, mask=case.mask, bias=case.bias
  ), (qh, kh, vh)


def _logit_error(qh, kh, scale, real):
  """``[B, H, T]`` |exact - computed| logit bound as the harness sees it.

  The computed logits are emulated with subnormal inputs flushed (as XLA on
  CPU reads them) plus a generous (D + 8) eps32 of sum |q_c k_c| for the
  rounding: an estimate used only to decide which keys' true masses are
  too small to be told apart from 0 in the output (see ``check``).
  """
  tiny = F32.tiny

  def flush(x):
    x = np.asarray(x, np.float64)
    return np.where(np.abs(x) < tiny, 0.0, x)

  with np.errstate(over="ignore", invalid="ignore"):
    qf, kf = flush(qh), flush(kh)
    s_emu = np.einsum("...td,...nd->...tn", qf, kf) * scale
    s_ex = (
      np.einsum(
        "...td,...nd->...tn",
        np.asarray(qh, np.float64),
        np.asarray(kh, np.float64),
      )
      * scale
    )
    a = (
      np.einsum(
        "...td,...nd->...tn",
        np.abs(np.asarray(qh, np.float64)),
        np.abs(np.asarray(kh, np.float64)),
      )
      * scale
    )
    err = np.abs(s_ex - s_emu) + (fam.D + 8) * F32.eps * a
  err = np.where(real, err, 0.0)
  return np.max(err, axis=-1)


def check(variant, policy, case, out, cert, *, where=""):
  """Asserts the contract on one call (see the module docstring)."""
  ctx = f"{variant.name}/{case.family}/{np.dtype(case.dtype)}{where}"
  b, t, h, e = fam.B, fam.T, fam.H, fam.E
  # Shape and dtype.
  assert out.shape == (b, t, h, e), (ctx, out.shape)
  assert out.dtype == jnp.dtype(case.dtype), (ctx, out.dtype)
  assert cert.tv_bound.shape == (b, t, h), (ctx, cert.tv_bound.shape)
  assert cert.tv_bound.dtype == jnp.float32, (ctx, cert.tv_bound.dtype)
  assert cert.k_kept.dtype == jnp.int32, (ctx, cert.k_kept.dtype)
  assert cert.valid.dtype == jnp.bool_, (ctx, cert.valid.dtype)
  assert cert.output_error_bound is not None, ctx
  c = head_major_cert(cert)
  o = np.swapaxes(np.asarray(out, np.float64), 1, 2)  # [B, H, T, E]
  truth, (qh, kh, vh) = truth_of(variant, case)
  real = truth.real
  n_real = truth.n_real
  v64 = np.asarray(vh, np.float64)  # [B, H, N, E]
  with np.errstate(invalid="ignore", over="ignore"):
    vfin = np.all(np.isfinite(v64), axis=-1)[:, :, None, :]  # [B, H, 1, N]
    vnorm = np.asarray(reference.norm(vh), np.float64)[:, :, None, :]
    a = (
      np.einsum(
        "...td,...nd->...tn",
        np.abs(np.asarray(qh, np.float64)),
        np.abs(np.asarray(kh, np.float64)),
      )
      * variant.scale
    )
  bad_vals = np.any(real & ~vfin, axis=-1)
  has_mass = n_real > 0
  huge = np.any(real & ~(a < F32.max / 64), axis=-1)  # may overflow
  if case.bias is not None:
    bb = np.abs(np.asarray(case.bias, np.float64))
    huge = huge | np.any(real & (bb > F32.max / 64), axis=-1)
  big_v = np.any(real & ~(vnorm < F32.max / 64), axis=-1)
  must_invalid = ~has_mass | bad_vals
  must_valid = has_mass & ~bad_vals & ~huge & ~big_v
  valid = c["valid"]
  assert not np.any(valid & must_invalid), (
    ctx,
    "valid row with no key of mass or non-finite values",
    np.argwhere(valid & must_invalid),
  )
  assert np.all(valid | ~must_valid), (
    ctx,
    "invalid on a normal row",
    np.argwhere(~valid & must_valid),
  )
  # Invalid rows: the defined result.
  inv = ~valid
  assert np.all(o[inv] == 0), (ctx, "nonzero output on an invalid row")
  assert np.all(np.isnan(c["tv"][inv])), (ctx, "tv not NaN on invalid row")
  assert np.all(c["k_kept"][inv] == 0), (ctx, "k_kept on invalid row")
  assert np.all(np.isnan(c["oeb"][inv])), (ctx, "oeb not NaN on invalid")
  if not np.any(valid):
    return
  # Kept set: computed weights > 0 (identity columns).
  w = o[..., : fam.N]  # [B, H, T, N]
  assert np.all(np.isfinite(o[valid])), (ctx, "non-finite output, valid")
  assert np.all(w[valid] >= 0), (ctx, "negative weight")
  ghost = valid[..., None] & ~real & (w > 0)
  assert not np.any(ghost), (ctx, "weight on a key that is not real")
  keep = (w > 0) & real
  # Keys whose true mass is too small to tell from a flushed 0 output
  # (<= tiny_out e^(2 delta)) do not count as surely dropped.
  info = out_info(case.dtype)
  delta = _logit_error(qh, kh, variant.scale, real)
  with np.errstate(over="ignore"):
    unsure = np.asarray(truth.p, np.float64) <= (
      float(info.tiny) * np.exp(np.minimum(2 * delta, 700))[..., None]
    )
  dropped = real & ~keep & ~unsure
  tau = np.sum(np.where(dropped, np.asarray(truth.p, np.float64), 0), -1)
  slack = fam.N * float(info.tiny)
  tv = np.asarray(c["tv"], np.float64)
  vt = valid
  assert np.all(np.isfinite(tv[vt]) & (tv[vt] >= 0) & (tv[vt] <= 1)), (
    ctx,
    "tv_bound out of [0, 1]",
    tv[vt],
  )
  bad = vt & ~(tv >= tau - slack)
  assert not np.any(bad), (ctx, "UNSOUND tv_bound", tv[bad], tau[bad])
  with np.errstate(divide="ignore"):
    log_tau = np.log(np.maximum(tau - slack, 0))
  log_tv = np.asarray(c["log_tv"], np.float64)
  bad = vt & ~(log_tv >= log_tau - 1e-6)
  assert not np.any(bad), (ctx, "UNSOUND log_tv_bound", log_tv[bad])
  # Output error: ||Attn - Attn_k|| of the kept set, and the returned
  # output against the exact attention up to its own rounding.
  oeb = np.asarray(c["oeb"], np.float64)
  err = np.asarray(truth.output_error(keep | (real & unsure)), np.float64)
  vmax = np.max(np.where(real, vnorm, 0), axis=-1)
  with np.errstate(over="ignore"):
    slack_o = slack * np.exp(np.minimum(2 * delta, 700)) * vmax
  bad = vt & ~(oeb >= err - slack_o)
  assert not np.any(bad), (ctx, "UNSOUND output_error_bound", oeb[bad])
  attn = np.asarray(truth.attn, np.float64)
  with np.errstate(over="ignore", invalid="ignore"):
    full = np.asarray(reference.norm(o - attn), np.float64)
    rnd = (fam.N + 16) * float(info.eps) * vmax
  bad = vt & ~(full <= oeb + rnd + slack_o)
  assert not np.any(bad), (
    ctx,
    "output farther from the exact attention than output_error_bound",
    full[bad],
    oeb[bad],
  )
  if case.family in PLAIN:
    kept_attn = np.asarray(truth.kept_attention(keep), np.float64)
    tol = tolerances.tol(case.dtype)
    gap = np.asarray(reference.norm(o - kept_attn), np.float64)
    lim = tol["atol"] + tol["rtol"] * vmax
    lim = lim * math.sqrt(fam.E)
    bad = vt & ~(gap <= lim)
    assert not np.any(bad), (ctx, "output != reference Attn_k", gap[bad])
  # Counts.
  kk = c["k_kept"]
  assert np.all(kk[vt] >= np.sum(keep, -1)[vt]), (ctx, "k_kept < kept keys")
  assert np.all(kk[vt] <= n_real[vt]), (ctx, "k_kept > real keys")
  assert np.all(kk[vt] >= 1), (ctx, "valid row keeps nothing")
  ks = c["keys_scored"]
  assert np.all(ks[vt] >= kk[vt]), (ctx, "keys_scored < k_kept")
  # Policy fields, on rows whose logits cannot overflow (elsewhere the
  # computed logits may be -inf where the exact ones are finite).
  check_policy(policy, kk, tv, n_real, vt & must_valid, cert, ctx)


def check_policy(policy, k_kept, tv, n_real, valid, cert, ctx):
  """Each field of ``policy`` honoured on the valid rows."""
  if isinstance(policy, FixedCount):
    want = np.vectorize(lambda n: policy.num_kept(int(n)) if n else 0)(n_real)
    bad = valid & (k_kept != want)
    assert not np.any(bad), (ctx, f"{policy} kept", k_kept[bad], want[bad])
    assert cert.failure_prob == 0.0, (ctx, cert.failure_prob)
    return
  assert isinstance(policy, Certified), policy
  assert cert.failure_prob == policy.failure_prob, (
    ctx,
    "failure_prob",
    cert.failure_prob,
  )
  cap = policy.max_topk
  if cap is not None:
    assert np.all(k_kept[valid] <= cap), (ctx, "max_topk ignored", k_kept)
  # eps: met, or every real key kept, or the cap reached.
  met = tv <= policy.eps * (1 + 1e-6)
  full = k_kept == n_real
  capped = np.zeros_like(full) if cap is None else np.ones_like(full)
  bad = valid & ~(met | full | capped)
  assert not np.any(bad), (ctx, f"eps={policy.eps} not met", tv[bad])
