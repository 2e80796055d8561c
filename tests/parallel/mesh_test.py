"""Mesh helpers: flag parsing and mesh construction."""

import jax
from absl import flags
from absl.testing import absltest
from absl.testing import parameterized
from jax.sharding import PartitionSpec as P

from jaxtopk import parallel


class ParseMeshFlagTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("two_axes", "data=4,heads=2", {"data": 4, "heads": 2}),
    ("spaces", " kv = 8 ", {"kv": 8}),
    ("wildcard", "data=2,kv=-1", {"data": 2, "kv": -1}),
    ("empty", "", {"data": -1}),
  )
  def test_parses(self, spec, expected):
    self.assertEqual(parallel.parse_mesh_flag(spec), expected)

  @parameterized.named_parameters(
    ("no_size", "data"),
    ("bad_name", "4=data"),
    ("repeated", "data=2,data=2"),
    ("float", "data=2.5"),
  )
  def test_rejects(self, spec):
    with self.assertRaisesRegex(ValueError, "spec="):
      parallel.parse_mesh_flag(spec)


class MakeMeshTest(parameterized.TestCase):
  def test_one_device_mesh(self):
    mesh = parallel.mesh_from_flag("data=1,kv=-1", devices=jax.devices()[:1])
    self.assertEqual(mesh.axis_names, ("data", "kv"))
    self.assertEqual(dict(mesh.shape), {"data": 1, "kv": 1})
    self.assertEqual(
      mesh.axis_types, (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Auto)
    )

  @parameterized.named_parameters(
    ("too_many", {"data": 3}, "needs 3 devices"),
    ("zero", {"data": 0}, "must be >= 1"),
    ("two_wildcards", {"data": -1, "kv": -1}, "at most one"),
    ("empty", {}, "at least one"),
  )
  def test_rejects(self, axes, regex):
    with self.assertRaisesRegex(ValueError, regex):
      parallel.make_mesh(axes, devices=jax.devices()[:1])

  def test_specs_drop_missing_and_trivial_axes(self):
    mesh = parallel.make_mesh({"data": 1}, devices=jax.devices()[:1])
    q_spec, kv_spec = parallel.attention_specs(mesh)
    self.assertEqual(q_spec, P(None, None, None, None))
    self.assertEqual(kv_spec, P(None, None, None, None))


class MeshFlagTest(absltest.TestCase):
  def test_flag_feeds_mesh_from_flag(self):
    fv = flags.FlagValues()
    holder = parallel.flags.define_mesh_flag(flag_values=fv)
    fv(["prog", "--mesh=data=1,kv=-1"])
    self.assertEqual(holder.value, "data=1,kv=-1")
    mesh = parallel.mesh_from_flag(holder.value, devices=jax.devices()[:1])
    self.assertEqual(mesh.axis_names, ("data", "kv"))


if __name__ == "__main__":
  absltest.main()
