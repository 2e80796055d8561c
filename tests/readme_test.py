"""README.md's self-contained examples run as written (docs match code).

Every ```python block that starts with an import is a whole program and is
executed here; the others are fragments that continue one of these. The
scale-out block needs 8 devices: it runs in a subprocess with 8 simulated
CPU devices.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest
from absl.testing import absltest
from absl.testing import parameterized

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_BLOCKS = re.findall(
  r"```python\n(.*?)```", (_ROOT / "README.md").read_text(), re.S
)
_PROGRAMS = [
  (f"block{i}", b)
  for i, b in enumerate(_BLOCKS)
  if b.startswith(("import", "from"))
]


class ReadmeTest(parameterized.TestCase):
  def test_has_programs(self):
    self.assertGreaterEqual(len(_PROGRAMS), 6)

  @pytest.mark.slow
  @parameterized.named_parameters(*_PROGRAMS)
  def test_program_runs(self, source):
    if "parallel" not in source:
      exec(compile(source, "README.md", "exec"), {})  # noqa: S102
      return
    env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS="--xla_force_host_platform_device_count=8",
      PYTHONPATH=str(_ROOT),
    )
    proc = subprocess.run(
      [sys.executable, "-c", source],
      env=env,
      cwd=_ROOT,
      capture_output=True,
      text=True,
      timeout=600,
    )
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])


if __name__ == "__main__":
  absltest.main()
