"""Runs the 8-device tests (``multidevice/*_md.py``) in fresh processes.

The number of CPU devices is fixed when jax starts its backend, and the
pytest process (or xdist worker) running this file may already have started
it with one device. So the ``*_md.py`` modules run in one fresh
``python -m pytest`` subprocess (one start-up of jax and flax, ~3.5 s of CPU,
for all of them) with ``JAX_NUM_CPU_DEVICES=8`` and
``--xla_force_host_platform_device_count=8`` in its environment; its
failures are printed in this test's failure message.
"""

import os
import pathlib
import subprocess
import sys

from absl.testing import absltest

_HERE = pathlib.Path(__file__).resolve().parent
_ROOT = _HERE.parents[1]
_MODULES = sorted(p.name for p in (_HERE / "multidevice").glob("*_md.py"))
NUM_DEVICES = 8


def run_modules(names) -> subprocess.CompletedProcess:
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("PYTEST_", "XLA_FLAGS"))
  }
  env["JAX_PLATFORMS"] = "cpu"
  env["JAX_NUM_CPU_DEVICES"] = str(NUM_DEVICES)
  env["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={NUM_DEVICES}"
  ).strip()
  return subprocess.run(
    [
      sys.executable,
      "-m",
      "pytest",
      "-q",
      "-p",
      "no:cacheprovider",
      *(str(_HERE / "multidevice" / name) for name in names),
    ],
    cwd=_ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )


class MultiDeviceTest(absltest.TestCase):
  def test_modules_found(self):
    self.assertNotEmpty(_MODULES)

  def test_modules_pass_on_8_devices(self):
    r = run_modules(_MODULES)
    self.assertEqual(
      r.returncode,
      0,
      f"{_MODULES} failed on {NUM_DEVICES} simulated devices:\n"
      f"{r.stdout[-8000:]}\n{r.stderr[-4000:]}",
    )
    self.assertIn("passed", r.stdout)
    self.assertNotIn("skipped", r.stdout)


if __name__ == "__main__":
  absltest.main()
