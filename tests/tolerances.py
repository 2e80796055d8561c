"""One table of numerical tolerances per dtype, used by every test.

A test that needs a looser value says why in a comment at the call site.
"""

import jax.numpy as jnp
import numpy as np

# (atol, rtol) for comparing attention outputs or probabilities.
_TOL = {
  np.dtype(np.float64): (1e-12, 1e-10),
  np.dtype(np.float32): (1e-5, 1e-5),
  np.dtype(jnp.bfloat16): (2e-2, 2e-2),
  np.dtype(np.float16): (2e-3, 2e-3),
}


def tol(dtype) -> dict[str, float]:
  """``dict(atol=..., rtol=...)`` for ``dtype`` (np.testing.assert_allclose)."""
  atol, rtol = _TOL[np.dtype(dtype)]
  return dict(atol=atol, rtol=rtol)


def assert_same_up_to_rounding(actual, desired, err_msg: str = "") -> None:
  """``actual == desired`` up to a few ulps of their float dtype.

  For two computations of one quantity that differ only in program shape
  (a paged vs a contiguous cache, a fused vs a copying append): XLA:CPU
  happens to give identical bits, GPU fusions may round differently (seen:
  1 ulp on an H200). Integers and booleans compare exactly; NaN equals NaN.
  """
  a, d = np.asarray(actual), np.asarray(desired)
  if a.dtype == jnp.bfloat16:  # numpy compares a numpy float
    a, d = a.astype(np.float32), d.astype(np.float32)
    ulp = float(jnp.finfo(jnp.bfloat16).eps)
  elif np.issubdtype(a.dtype, np.floating):
    ulp = float(np.finfo(a.dtype).eps)
  else:
    np.testing.assert_array_equal(a, d, err_msg=err_msg)
    return
  tiny = float(np.finfo(a.dtype).tiny)
  np.testing.assert_allclose(a, d, rtol=4 * ulp, atol=4 * ulp * tiny + tiny,
                             err_msg=err_msg)  # fmt: skip
