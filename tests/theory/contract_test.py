"""Every row-wise public function: vmap over extra axes and x64 dtypes.

A function joins by being added to ``_CASES``: (name, fn(logits, keep,
values, mask) -> array). Checks: ``jax.vmap`` over a new leading axis equals
the batched call, and under x64 float64 inputs give float64 outputs that
agree with the float32 ones.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from jaxtopk import theory
from tests.theory import strategies

_CASES = (
  ("tail_mass", lambda s, k, v, m: theory.tail_mass(s, k, m)),
  ("kl_truncated", lambda s, k, v, m: theory.kl_truncated(s, k, m)),
  ("single_gap", lambda s, k, v, m: theory.single_gap_bound(s, 2, m)),
  (
    "single_gap_ratio",
    lambda s, k, v, m: theory.single_gap_bound(s, 2, m, form="ratio"),
  ),
  ("multi_gap", lambda s, k, v, m: theory.multi_gap_bound(s, 2, m)),
  ("k_eps", lambda s, k, v, m: theory.k_eps(s, 0.1, m)),
  ("topk_mask", lambda s, k, v, m: theory.topk_mask(s, 2, m)),
  ("head_tail_error", lambda s, k, v, m: theory.head_tail_error(s, k, v, m)),
  ("diameter", lambda s, k, v, m: theory.diameter_bound(s, k, v, m)),
  ("variance", lambda s, k, v, m: theory.variance_bound(s, k, v, m)),
  ("effective", lambda s, k, v, m: theory.effective_entries(s, 0.1, m)),
  ("ineffective", lambda s, k, v, m: theory.ineffective_fraction(s, 0.1, m)),
  ("row_l2", lambda s, k, v, m: theory.row_l2_error(s, k, m)),
  ("entropy", lambda s, k, v, m: theory.attention_entropy(s, m)),
)


def _inputs(dtype):
  s = strategies.normal((3, 5, 7), seed=11, scale=2.0, dtype=dtype)
  keep = strategies.bernoulli((3, 5, 7), 0.5, 12).at[..., 0].set(True)
  values = strategies.normal((3, 5, 7, 11), seed=13, dtype=dtype)
  mask = strategies.bernoulli((3, 5, 7), 0.8, 14).at[..., 0].set(True)
  return s, keep, values, mask


class ContractTest(parameterized.TestCase):
  @parameterized.named_parameters(*_CASES)
  def test_vmap_and_x64(self, fn):
    args = _inputs(jnp.float32)
    out = fn(*args)
    self.assertEqual(out.shape[:2], (3, 5))
    vm = jax.vmap(fn)(*args)
    np.testing.assert_allclose(vm, out, rtol=1e-6)
    with jax.enable_x64(True):
      out64 = fn(*_inputs(jnp.float64))
      if jnp.issubdtype(out.dtype, jnp.floating):
        self.assertEqual(out64.dtype, jnp.float64)
        np.testing.assert_allclose(out64, out, rtol=2e-5, atol=1e-6)
      else:
        np.testing.assert_array_equal(out64, out)


if __name__ == "__main__":
  absltest.main()
