"""LocalCluster: wiring, failure reports, deadlines, no orphans.

The processes here are tiny Python programs (no jax), so every test takes
well under a second of CPU; the jax multi-process runs live in
``tests/parallel/multiprocess/``.
"""

import json
import os
import pathlib
import signal
import socket
import sys
import tempfile
import time

from absl.testing import absltest

from jaxtopk import parallel


def _py(code: str) -> list[str]:
  return [sys.executable, "-c", code]


def _alive(pid: int) -> bool:
  """True if ``pid`` exists and is not a zombie."""
  try:
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
  except FileNotFoundError:
    return False
  state = [line for line in status.splitlines() if line.startswith("State:")]
  return bool(state) and "Z" not in state[0].split()[1]


class FreePortTest(absltest.TestCase):
  def test_port_can_be_bound(self):
    port = parallel.launch.free_port()
    self.assertBetween(port, 1, 65535)
    with socket.socket() as s:
      s.bind(("127.0.0.1", port))


class LocalClusterTest(absltest.TestCase):
  def test_environment_wires_each_process(self):
    code = (
      "import json, os; print(json.dumps({k: os.environ.get(k) for k in"
      " ('JAXTOPK_COORDINATOR_ADDRESS', 'JAXTOPK_NUM_PROCESSES',"
      " 'JAXTOPK_PROCESS_ID', 'JAXTOPK_CPU_COLLECTIVES',"
      " 'JAX_NUM_CPU_DEVICES', 'JAX_PLATFORMS', 'EXTRA', 'HOME')}))"
    )
    results = parallel.launch.launch_local(
      _py(code),
      num_processes=3,
      devices_per_process=2,
      timeout_s=60,
      env={"EXTRA": "x", "HOME": None},
    )
    self.assertLen(results, 3)
    seen = [json.loads(r.output.strip().splitlines()[-1]) for r in results]
    addresses = {s["JAXTOPK_COORDINATOR_ADDRESS"] for s in seen}
    self.assertLen(addresses, 1)
    self.assertStartsWith(addresses.pop(), "127.0.0.1:")
    for i, (r, s) in enumerate(zip(results, seen, strict=True)):
      self.assertEqual((r.process_id, r.returncode), (i, 0))
      self.assertEqual(s["JAXTOPK_PROCESS_ID"], str(i))
      self.assertEqual(s["JAXTOPK_NUM_PROCESSES"], "3")
      self.assertEqual(s["JAXTOPK_CPU_COLLECTIVES"], "gloo")
      self.assertEqual(s["JAX_NUM_CPU_DEVICES"], "2")
      self.assertEqual(s["JAX_PLATFORMS"], "cpu")
      self.assertEqual(s["EXTRA"], "x")
      self.assertIsNone(s["HOME"])

  def test_one_process_is_a_plain_run(self):
    code = "import os; print(os.environ.get('JAXTOPK_PROCESS_ID'))"
    (result,) = parallel.launch.launch_local(
      _py(code), num_processes=1, timeout_s=60
    )
    self.assertEqual(result.output.strip(), "None")
    (result,) = parallel.launch.launch_local(
      _py(code), num_processes=1, timeout_s=60, distributed=True
    )
    self.assertEqual(result.output.strip(), "0")

  def test_failed_process_stops_the_others_and_is_named(self):
    code = (
      "import os, sys, time\n"
      "if os.environ['JAXTOPK_PROCESS_ID'] == '1':\n"
      "  print('step 3: something broke', flush=True); sys.exit(3)\n"
      "print('waiting for peer', flush=True); time.sleep(120)\n"
    )
    cluster = parallel.launch.LocalCluster(
      _py(code), num_processes=2, timeout_s=100
    )
    t0 = time.monotonic()
    with cluster, self.assertRaises(parallel.launch.ClusterError) as ctx:
      cluster.wait()
    self.assertLess(time.monotonic() - t0, 30)
    msg = str(ctx.exception)
    self.assertIn("process 1 of 2 failed with exit status 3", msg)
    self.assertIn("step 3: something broke", msg)
    self.assertIn("waiting for peer", msg)  # the peer's last output too
    self.assertEqual(cluster.returncodes()[0], -signal.SIGKILL)

  def test_deadline_kills_hung_processes(self):
    code = "import time; print('hung here', flush=True); time.sleep(120)"
    cluster = parallel.launch.LocalCluster(
      _py(code), num_processes=2, timeout_s=2
    )
    t0 = time.monotonic()
    with cluster, self.assertRaises(parallel.launch.ClusterError) as ctx:
      cluster.wait()
    self.assertLess(time.monotonic() - t0, 30)
    msg = str(ctx.exception)
    self.assertIn("processes [0, 1] of 2 still running after the 2 s", msg)
    self.assertIn("hung here", msg)
    self.assertEqual(cluster.returncodes(), [-signal.SIGKILL] * 2)

  def test_close_kills_the_whole_process_group(self):
    # Each process starts a grandchild (same process group) and waits.
    code = (
      "import subprocess, sys, time\n"
      "p = subprocess.Popen([sys.executable, '-c',"
      " 'import time; time.sleep(120)'])\n"
      "print('grandchild', p.pid, flush=True); time.sleep(120)\n"
    )
    with parallel.launch.LocalCluster(
      _py(code), num_processes=2, timeout_s=100
    ) as cluster:
      cluster.wait_until(
        lambda: all("grandchild" in cluster.output(i) for i in range(2)),
        what="both grandchildren",
      )
      pids = [int(cluster.output(i).split()[1]) for i in range(2)]
      self.assertTrue(all(_alive(p) for p in pids))
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
      time.sleep(0.05)
    self.assertFalse(any(_alive(p) for p in pids), pids)

  def test_processes_die_with_the_launcher(self):
    # A launcher process starts a cluster, then is SIGKILLed (no close()).
    launcher = (
      "import sys\n"
      "from jaxtopk import parallel\n"
      "c = parallel.launch.LocalCluster([sys.executable, '-c',"
      " 'import os, time;"
      " print(os.getpid(), flush=True); time.sleep(120)'],"
      " num_processes=2, timeout_s=100).start()\n"
      "c.wait_until(lambda: all(c.output(i) for i in range(2)), what='pids')\n"
      "print(*(c.output(i).strip() for i in range(2)), flush=True)\n"
      "import time; time.sleep(120)\n"
    )
    with parallel.launch.LocalCluster(
      _py(launcher),
      num_processes=1,
      timeout_s=100,
      env={"PYTHONPATH": str(pathlib.Path(__file__).parents[2])},
    ) as outer:
      outer.wait_until(
        lambda: len(outer.output(0).split()) == 2, what="the cluster's pids"
      )
      pids = [int(p) for p in outer.output(0).split()]
      self.assertTrue(all(_alive(p) for p in pids))
      outer.kill(0)
      deadline = time.monotonic() + 10
      while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
      self.assertFalse(any(_alive(p) for p in pids), pids)

  def test_expected_kill_is_not_a_failure(self):
    code = (
      "import os, time\n"
      "print('ready', flush=True)\n"
      "if os.environ['JAXTOPK_PROCESS_ID'] == '0': time.sleep(120)\n"
    )
    with parallel.launch.LocalCluster(
      _py(code), num_processes=2, timeout_s=100
    ) as cluster:
      cluster.wait_until(lambda: "ready" in cluster.output(0), what="ready")
      self.assertTrue(cluster.kill(0))
      results = cluster.wait()
    self.assertEqual([r.returncode for r in results], [-signal.SIGKILL, 0])

  def test_wait_until_reports_processes_that_ended_first(self):
    with parallel.launch.LocalCluster(
      _py("print('bye')"), num_processes=2, timeout_s=60
    ) as cluster:
      with self.assertRaisesRegex(
        parallel.launch.ClusterError, "every process ended before the marker"
      ):
        cluster.wait_until(lambda: False, what="the marker")

  def test_logs_are_kept_in_a_given_dir(self):
    with tempfile.TemporaryDirectory() as d:
      parallel.launch.launch_local(
        _py("print('hello')"), num_processes=2, timeout_s=60, log_dir=d
      )
      for i in range(2):
        text = pathlib.Path(d, f"process_{i}.log").read_text()
        self.assertEqual(text.strip(), "hello")

  def test_rejects_bad_arguments(self):
    for kwargs, regex in (
      (dict(num_processes=0), "num_processes=0"),
      (dict(num_processes=2, devices_per_process=0), "devices_per_process=0"),
      (dict(num_processes=2, timeout_s=0), "timeout_s=0"),
      (dict(num_processes=2, cpu_collectives="nccl"), "cpu_collectives='nccl'"),
    ):
      with self.assertRaisesRegex(ValueError, regex):
        parallel.launch.LocalCluster(_py("pass"), **kwargs)

  def test_parent_jaxtopk_variables_are_not_inherited(self):
    code = "import os; print(os.environ.get('JAXTOPK_DISTRIBUTED'))"
    os.environ["JAXTOPK_DISTRIBUTED"] = "1"
    try:
      (result,) = parallel.launch.launch_local(_py(code), num_processes=1)
    finally:
      del os.environ["JAXTOPK_DISTRIBUTED"]
    self.assertEqual(result.output.strip(), "None")


if __name__ == "__main__":
  absltest.main()
