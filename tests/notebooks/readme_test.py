"""Runs the Python snippets of README.md's tour section (issue #9).

Every ```python block under the "## Tour" heading is executed, each in a
fresh namespace, so the README's promise that its snippets run stays true.
Other sections hold fragments (``rngs``, ``old_attn`` undefined) and are not
run here.
"""

import pathlib
import re

from absl.testing import absltest
from absl.testing import parameterized

_README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
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
    exec(compile(source, "README.md", "exec"), {"__name__": "__readme__"})


if __name__ == "__main__":
  absltest.main()
