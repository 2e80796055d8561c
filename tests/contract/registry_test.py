"""Registering an attention op is what puts it under the contract."""

from absl.testing import absltest

import jaxtopk  # noqa: F401 (registers every op: kernels, parallel)
from jaxtopk.attention import registry
from tests.contract import policies as pol
from tests.contract import variants as var


class RegistryTest(absltest.TestCase):
  def test_every_registered_op_is_a_variant(self):
    covered = {name for v in var.VARIANTS for name in v.ops}
    self.assertEmpty(set(registry.OPS) - covered)
    self.assertContainsSubset(
      {"xla_prefill", "xla_decode", "index_decode", "pallas_prefill"},
      set(registry.OPS),
    )

  def test_variants_derive_from_their_ops(self):
    for v in var.VARIANTS:
      if not v.ops:
        continue
      op = registry.OPS[v.ops[0]]  # the op it attends with (registered)
      self.assertEqual(v.kind, op.kind, v.name)
      if len(v.ops) == 1 and v.effective is None:  # the op itself
        self.assertEqual(v.bias, "bias" in op.arguments, v.name)
        self.assertEqual(v.masks, op.masks, v.name)
      for _, policy in pol.POLICIES:
        if v.ops:
          for name in v.ops:
            self.assertLessEqual(
              v.supported(policy), registry.OPS[name].supported(policy)
            )


if __name__ == "__main__":
  absltest.main()
