"""Runs the Python snippets of README.md's tour section (issue #9).

Every ```python block under the "## Tour" heading is executed, each in a
fresh Python process (as a user pasting it would), so the README's promise
that its snippets run stays true. The processes get the notebook tests' fast
XLA compile flags. Other sections hold fragments (``rngs``, ``old_attn``
undefined) and are not run here.
"""

import os
import pathlib
import re
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_README = _ROOT / "README.md"
_FAST_COMPILE = (
  "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)
_SECTION = "## Tour: notebooks, three snippets, API overview"


def tour_snippets(text: str) -> list[str]:
  """The ```python blocks of the tour section of README text."""
  start = text.index(_SECTION)
  end = text.find("\n## ", start + len(_SECTION))
  section = text[start : None if end < 0 else end]
  return re.findall(r"```python\n(.*?)```", section, flags=re.S)


_SNIPPETS = tour_snippets(_README.read_text())


class ReadmeTest(parameterized.TestCase):
  def test_tour_has_three_snippets(self):
    self.assertLen(_SNIPPETS, 3)

  @parameterized.named_parameters(
    (f"snippet_{i}", source) for i, source in enumerate(_SNIPPETS)
  )
  def test_snippet_runs(self, source):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
      [str(_ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
    result = subprocess.run(
      [sys.executable, "-"],
      input=source,
      capture_output=True,
      text=True,
      env=env,
      cwd=_ROOT,
      timeout=300,
    )
    self.assertEqual(result.returncode, 0, msg=f"{source}\n{result.stderr}")


if __name__ == "__main__":
  absltest.main()
