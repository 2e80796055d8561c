"""What the upstream attention tests share: the policies and the checks.

The tests in this directory are jax's and Flax's own attention tests, run
against jaxtopk (each file says where it comes from). They call jaxtopk
with ``DENSE`` (which must reproduce jax / Flax) and, where a test compares
outputs with a reference, also with ``CERTIFIED`` (whose outputs must match
within the call's certificate).
"""

import jax.numpy as jnp
import numpy as np

import jaxtopk
from tests.tolerances import tol

DENSE = jaxtopk.Dense()
CERTIFIED = jaxtopk.Certified(0.05)
POLICIES = (("dense", DENSE), ("certified", CERTIFIED))


def assert_matches(out, ref, cert, policy, *, atol=None, rtol=None):
  """``out`` equals ``ref`` (Dense), or is within the certificate.

  Args:
    out: jaxtopk's output ``[..., q_len, heads, d_v]``.
    ref: the reference output, same shape.
    cert: the call's Certificate ``[..., q_len, heads]`` (None for Dense).
    policy: the policy of the call.
    atol, rtol: the rounding tolerance (default: the dtype's, ``tol``).

  Under a certified policy, each valid row's error ||out - ref||_2 must be
  at most the certificate's ``output_error_bound`` plus the rounding of the
  two outputs (``atol`` per component, times sqrt(d_v)); an invalid row's
  output is zero.
  """
  t = tol(jnp.asarray(out).dtype)
  atol = t["atol"] if atol is None else atol
  rtol = t["rtol"] if rtol is None else rtol
  out64 = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  ref64 = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
  if isinstance(policy, jaxtopk.Dense):
    np.testing.assert_allclose(out64, ref64, atol=atol, rtol=rtol)
    return
  valid = np.asarray(cert.valid)
  bound = np.asarray(cert.output_error_bound, np.float64)
  err = np.linalg.norm(out64 - ref64, axis=-1)
  slack = (atol + rtol * np.abs(ref64).max(-1)) * np.sqrt(out64.shape[-1])
  bad = valid & ~(err <= bound + slack)
  assert not bad.any(), (err[bad], bound[bad])
  np.testing.assert_array_equal(out64[~valid], 0.0)
