"""The kernel modules of jaxtopk.kernels, and the old aliases that warn."""

import warnings

from absl.testing import absltest
from absl.testing import parameterized

from jaxtopk import kernels


class KernelModulesTest(parameterized.TestCase):
  @parameterized.parameters(
    ("DecodeSizes", kernels.decode.BlockSizes),
    ("SparseFlashSizes", kernels.sparse_flash.BlockSizes),
    ("BlockStatsSizes", kernels.stats.BlockSizes),
    (
      "sparse_flash_gathered_attention",
      kernels.sparse_flash.gathered_attention,
    ),
    ("sparse_flash_kept_key_mask", kernels.sparse_flash.kept_key_mask),
    ("sparse_flash_visible_mask", kernels.stats.visible_mask),
  )
  def test_old_alias_warns_and_names_the_new_place(self, old, new):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      got = getattr(kernels, old)
    self.assertIs(got, new)
    (w,) = caught
    self.assertIs(w.category, DeprecationWarning)
    self.assertIn("jaxtopk.kernels.", str(w.message))
    self.assertNotIn(old, kernels.__all__)

  def test_three_block_sizes_are_three_classes_under_one_name(self):
    sizes = {
      kernels.decode.BlockSizes,
      kernels.sparse_flash.BlockSizes,
      kernels.stats.BlockSizes,
    }
    self.assertLen(sizes, 3)
    for module in ("decode", "prefill", "select", "sparse_flash", "stats"):
      self.assertIn(module, kernels.__all__)

  def test_unknown_name_raises_attribute_error(self):
    with self.assertRaisesRegex(AttributeError, "no_such_kernel"):
      kernels.no_such_kernel  # noqa: B018


if __name__ == "__main__":
  absltest.main()
