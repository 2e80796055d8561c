"""The jaxtyping annotations of the public theory functions are accurate.

Each function is wrapped with ``jaxtyped(typechecker=beartype)``: calls with
consistent shapes and dtypes pass the check, a keep mask of the wrong length
fails it.
"""

import jax.numpy as jnp
from absl.testing import absltest
from absl.testing import parameterized
from beartype import beartype
from jaxtyping import TypeCheckError
from jaxtyping import jaxtyped

from jaxtopk import theory
from tests.theory import strategies

_S = strategies.normal((3, 7), seed=1)
_K = strategies.bernoulli((3, 7), 0.5, 2)
_V = strategies.normal((3, 7, 5), seed=3)
_M = jnp.ones((3, 7), bool)

_CALLS = (
  ("tail_mass", theory.tail_mass, (_S, _K, _M), {}),
  ("log_tail_mass", theory.log_tail_mass, (_S, _K), {}),
  ("kl_truncated", theory.kl_truncated, (_S, _K, _M), {}),
  ("single_gap", theory.single_gap_bound, (_S, 2, _M), {}),
  ("multi_gap", theory.multi_gap_log_bound, (_S, jnp.array([1, 2, 3])), {}),
  ("certifies", theory.single_gap_certifies, (_S, 2, 0.1), {}),
  ("topk_mask", theory.topk_mask, (_S, 2, _M), {}),
  ("k_eps", theory.k_eps, (_S, 0.1, _M), {}),
  ("error", theory.head_tail_error, (_S, _K, _V, _M), {"tv_bound": 0.5}),
  ("diameter", theory.diameter_bound, (_S, _K, _V), {}),
  ("variance", theory.variance_bound, (_S, _K, _V, _M), {}),
  ("effective", theory.effective_entries, (_S, 0.1, _M), {}),
  ("ineffective", theory.ineffective_fraction, (_S, 0.1), {}),
  ("row_l2", theory.row_l2_error, (_S, _K, _M), {}),
  ("entropy", theory.attention_entropy, (_S, _M), {}),
)


class AnnotationsTest(parameterized.TestCase):
  @parameterized.named_parameters(*_CALLS)
  def test_checked_call_passes(self, fn, args, kwargs):
    jaxtyped(typechecker=beartype)(fn)(*args, **kwargs)

  def test_wrong_shape_fails_the_check(self):
    checked = jaxtyped(typechecker=beartype)(theory.tail_mass)
    with self.assertRaises(TypeCheckError):
      checked(_S, _K[:, :5])


if __name__ == "__main__":
  absltest.main()
