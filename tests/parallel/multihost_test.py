"""Multi-host helpers in one process: start-up wiring (jax mocked), data.

The real multi-process runs (gloo, 2 x 4 and 4 x 2 devices) are in
``tests/parallel/multiprocess/``.
"""

import os
from unittest import mock

import jax
import numpy as np
from absl import flags
from absl.testing import absltest
from absl.testing import parameterized
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtopk import parallel

_CLEAN_ENV = {
  name: ""
  for name in (
    "JAXTOPK_DISTRIBUTED",
    "JAXTOPK_COORDINATOR_ADDRESS",
    "JAXTOPK_NUM_PROCESSES",
    "JAXTOPK_PROCESS_ID",
    "JAXTOPK_CPU_COLLECTIVES",
    "JAXTOPK_INITIALIZATION_TIMEOUT",
  )
}


class InitializeTest(absltest.TestCase):
  def setUp(self):
    super().setUp()
    self.enter_context(mock.patch.dict(os.environ, _CLEAN_ENV))
    self.enter_context(
      mock.patch.object(jax.distributed, "is_initialized", lambda: False)
    )
    self.init = self.enter_context(
      mock.patch.object(jax.distributed, "initialize")
    )
    # The CPU collectives setting is global: never change it for real here.
    self.config_update = self.enter_context(
      mock.patch.object(jax.config, "update")
    )

  def test_single_host_does_not_initialize(self):
    self.assertFalse(parallel.maybe_initialize_distributed())
    self.init.assert_not_called()
    self.config_update.assert_not_called()

  def test_arguments_are_passed_through(self):
    self.assertTrue(
      parallel.maybe_initialize_distributed(
        coordinator_address="10.0.0.1:1234", num_processes=4, process_id=2
      )
    )
    self.init.assert_called_once_with(
      coordinator_address="10.0.0.1:1234", num_processes=4, process_id=2
    )
    self.config_update.assert_called_once_with(
      "jax_cpu_collectives_implementation", "gloo"
    )

  def test_env_triggers_autodetect(self):
    os.environ["JAXTOPK_DISTRIBUTED"] = "1"
    self.assertTrue(parallel.maybe_initialize_distributed())
    self.init.assert_called_once_with()

  def test_environment_describes_the_cluster(self):
    os.environ.update(
      JAXTOPK_COORDINATOR_ADDRESS="127.0.0.1:7",
      JAXTOPK_NUM_PROCESSES="3",
      JAXTOPK_PROCESS_ID="1",
      JAXTOPK_CPU_COLLECTIVES="mpi",
      JAXTOPK_INITIALIZATION_TIMEOUT="11",
    )
    self.assertTrue(parallel.maybe_initialize_distributed())
    self.init.assert_called_once_with(
      coordinator_address="127.0.0.1:7",
      num_processes=3,
      process_id=1,
      initialization_timeout=11,
    )
    self.config_update.assert_called_once_with(
      "jax_cpu_collectives_implementation", "mpi"
    )

  def test_arguments_win_over_environment(self):
    os.environ.update(JAXTOPK_NUM_PROCESSES="3", JAXTOPK_PROCESS_ID="1")
    parallel.maybe_initialize_distributed(
      "h:1", 2, 0, local_device_ids=[0, 1], cpu_collectives="none"
    )
    self.init.assert_called_once_with(
      coordinator_address="h:1",
      num_processes=2,
      process_id=0,
      local_device_ids=[0, 1],
    )
    self.config_update.assert_called_once_with(
      "jax_cpu_collectives_implementation", "none"
    )

  def test_bad_environment_is_named(self):
    os.environ["JAXTOPK_NUM_PROCESSES"] = "two"
    with self.assertRaisesRegex(ValueError, "JAXTOPK_NUM_PROCESSES='two'"):
      parallel.maybe_initialize_distributed()
    self.init.assert_not_called()

  def test_bad_collectives_are_named(self):
    with self.assertRaisesRegex(ValueError, "cpu_collectives='nccl'"):
      parallel.maybe_initialize_distributed("h:1", 2, 0, cpu_collectives="nccl")

  def test_already_initialized_is_a_no_op(self):
    with mock.patch.object(jax.distributed, "is_initialized", lambda: True):
      self.assertTrue(parallel.maybe_initialize_distributed("h:1", 2, 0))
    self.init.assert_not_called()

  def test_flags_feed_initialize(self):
    fv = flags.FlagValues()
    init = parallel.flags.define_distributed_flags(flag_values=fv)
    again = parallel.flags.define_distributed_flags(flag_values=fv)  # reused
    fv(["prog", "--coordinator_address=h:9", "--num_processes=2"])
    fv["process_id"].value = 1
    self.assertTrue(again())
    self.init.assert_called_once_with(
      coordinator_address="h:9", num_processes=2, process_id=1
    )
    self.init.reset_mock()
    fv["coordinator_address"].value = None
    fv["num_processes"].value = None
    fv["process_id"].value = None
    self.assertFalse(init())  # nothing given, nothing in the environment
    self.init.assert_not_called()


class FailFastTest(absltest.TestCase):
  def test_single_process_errors_pass_through(self):
    with mock.patch.object(jax.distributed, "is_initialized", lambda: False):
      with self.assertRaisesRegex(ValueError, "boom"):
        with parallel.fail_fast():
          raise ValueError("boom")

  def test_multi_process_error_ends_the_process(self):
    with (
      mock.patch.object(jax.distributed, "is_initialized", lambda: True),
      mock.patch.object(os, "_exit") as exit_,
    ):
      with parallel.fail_fast():
        raise ValueError("boom")  # printed, then os._exit(1)
      exit_.assert_called_once_with(1)
      with self.assertRaises(SystemExit):  # a clean exit is not a failure
        with parallel.fail_fast():
          raise SystemExit(0)
      exit_.assert_called_once()


class DataTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("rows", P("data", None)),
    ("replicated", P()),
    ("cols", P(None, "data")),
  )
  def test_global_array_from_process_block(self, spec):
    mesh = parallel.make_mesh({"data": 1}, devices=jax.devices()[:1])
    x = np.arange(35.0, dtype=np.float32).reshape(5, 7)
    sharding = NamedSharding(mesh, spec)
    self.assertEqual(
      parallel.process_local_slices(sharding, x.shape),
      (slice(0, 5), slice(0, 7)),
    )
    seen = []

    def load(slices):
      seen.append(slices)
      return x[slices]

    arr = parallel.make_global_array(load, sharding, x.shape)
    self.assertLen(seen, 1)
    self.assertEqual(arr.sharding, sharding)
    np.testing.assert_array_equal(parallel.fetch({"a": arr})["a"], x)

  def test_wrong_block_shape_is_named(self):
    mesh = parallel.make_mesh({"data": 1}, devices=jax.devices()[:1])
    sharding = NamedSharding(mesh, P("data"))
    with self.assertRaisesRegex(ValueError, r"returned shape \(2,\)"):
      parallel.make_global_array(lambda sl: np.zeros(2), sharding, (3,))

  def test_global_batch(self):
    mesh = parallel.make_mesh({"data": 1}, devices=jax.devices()[:1])
    x = np.arange(6, dtype=np.int32).reshape(3, 2)
    arr = parallel.global_batch(x, mesh)
    self.assertEqual(arr.shape, (3, 2))
    np.testing.assert_array_equal(np.asarray(arr), x)

  def test_put_global_follows_the_shardings(self):
    mesh = parallel.make_mesh({"data": 1}, devices=jax.devices()[:1])
    tree = {"w": np.ones((3, 2), np.float32), "n": np.int32(4)}
    shardings = {
      "w": NamedSharding(mesh, P("data")),
      "n": NamedSharding(mesh, P()),
    }
    out = parallel.put_global(tree, shardings)
    self.assertEqual(out["w"].sharding, shardings["w"])
    np.testing.assert_array_equal(out["w"], tree["w"])
    self.assertEqual(int(out["n"]), 4)

  def test_single_process_helpers(self):
    self.assertTrue(parallel.is_main_process())
    self.assertTrue(parallel.any_process(True))
    self.assertFalse(parallel.any_process(False))
    self.assertEqual(parallel.fetch([1.5])[0], 1.5)


if __name__ == "__main__":
  absltest.main()
