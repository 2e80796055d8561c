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
