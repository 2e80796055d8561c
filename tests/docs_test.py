"""README.md's and docs/*.md's programs run as written (docs match code).

Every ```python block is a whole program (it starts with an import) and runs
alone, in a fresh namespace. Programs that use ``jaxtopk.parallel`` meshes
run in a subprocess (they set up their own devices before importing jax).
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
_PAGES = [_ROOT / "README.md", *sorted((_ROOT / "docs").glob("*.md"))]


def _blocks():
  for page in _PAGES:
    text = page.read_text()
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
      yield f"{page.stem}_{i}", block


_PROGRAMS = list(_blocks())


class DocsTest(parameterized.TestCase):
  def test_every_block_is_a_program(self):
    self.assertGreaterEqual(len(_PROGRAMS), 15)
    for name, source in _PROGRAMS:
      self.assertTrue(
        source.startswith(("import", "from")), f"{name} is a fragment"
      )

  def test_readme_is_short(self):
    lines = (_ROOT / "README.md").read_text().splitlines()
    self.assertLessEqual(len(lines), 300)

  @pytest.mark.slow
  @parameterized.named_parameters(*_PROGRAMS)
  def test_program_runs(self, source):
    if "parallel" not in source:
      exec(compile(source, "docs", "exec"), {})  # noqa: S102
      return
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(_ROOT))
    # The program appends its own device count to XLA_FLAGS (the last
    # occurrence of a flag wins); the tests' flags stay.
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
