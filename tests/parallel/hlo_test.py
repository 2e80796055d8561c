# ruff: noqa: E501 (verbatim HLO lines are long)
"""Parsing collectives and their sizes out of compiled HLO text."""

from absl.testing import absltest

from jaxtopk import parallel

_HLO = """
HloModule jit_f, entry_computation_layout={(f32[2,4]{1,0})->f32[2,4]{1,0}}

ENTRY %main.1 (param: f32[2,4]) -> f32[2,4] {
  %param = f32[2,4]{1,0} parameter(0)
  %psum.1 = f32[2,4]{1,0} all-reduce(%param), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %all-reduce = (f32[3]{0}, s32[5,7]{1,0}) all-reduce(%a, %b), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %all_gather.3 = bf16[2,4,11]{2,1,0} all-gather(%x), channel_id=3, replica_groups=[2,4]<=[8], dimensions={2}
  %ags = (f32[13]{0}, f32[104]{0}) all-gather-start(%y), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %agd = f32[104]{0} all-gather-done(%ags)
  %cp = u8[64]{0} collective-permute(%z), source_target_pairs={{0,1},{1,0}}
  %get-tuple-element.1 = f32[3]{0} get-tuple-element(%all-reduce), index=0
  %all-reduce.20 = (f32[16,16]{1,0}, f32[51]{0}, f32[2]{0}, f32[]{0}, f32[]{0}, /*index=5*/f32[3]{0}) all-reduce(%a, %b, %c, %d, %e, %f), channel_id=4, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, use_global_device_ids=true, to_apply=%add
  %all-reduce.21 = f32[] all-reduce(%g), channel_id=5, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}, use_global_device_ids=true, to_apply=%add
  ROOT %r = f32[2,4]{1,0} add(%psum.1, %psum.1)
}
"""


class HloTest(absltest.TestCase):
  def test_collectives_and_sizes(self):
    ops = parallel.collectives(_HLO)
    self.assertEqual(
      [op.kind for op in ops],
      [
        "all-reduce",
        "all-reduce",
        "all-gather",
        "all-gather",
        "collective-permute",
        "all-reduce",
        "all-reduce",
      ],
    )
    self.assertEqual(
      [op.result_bytes for op in ops],
      [
        2 * 4 * 4,
        3 * 4 + 5 * 7 * 4,
        2 * 4 * 11 * 2,
        104 * 4,
        64,
        (16 * 16 + 51 + 2 + 1 + 1 + 3) * 4,  # a tuple with /*index=5*/
        4,
      ],
    )
    self.assertEqual([op.group_size for op in ops], [4, 8, 4, 8, 1, 4, 8])

  def test_summary_uses_ring_estimates(self):
    s = parallel.communication_summary(_HLO)
    self.assertEqual(s["count"], 7)
    ar = s["by_kind"]["all-reduce"]
    self.assertEqual(ar["count"], 4)
    self.assertAlmostEqual(
      ar["sent_bytes"],
      2 * 3 / 4 * 32 + 2 * 7 / 8 * 152 + 2 * 3 / 4 * 1256 + 2 * 7 / 8 * 4,
    )
    ag = s["by_kind"]["all-gather"]
    self.assertAlmostEqual(ag["sent_bytes"], 3 / 4 * 176 + 7 / 8 * 416)
    self.assertEqual(s["by_kind"]["collective-permute"]["sent_bytes"], 64)

  def test_no_collectives(self):
    self.assertEqual(
      parallel.communication_summary("ROOT %x = f32[] add()"),
      {"count": 0, "result_bytes": 0, "sent_bytes": 0, "by_kind": {}},
    )


if __name__ == "__main__":
  absltest.main()
