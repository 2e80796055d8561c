"""Executes every Colab notebook in colab/ at small size (issue #9).

Each notebook runs top to bottom in a fresh kernel of this Python with
JAXTOPK_NOTEBOOK_SMALL=1; any cell error fails the test (nbclient raises
CellExecutionError), and the figures it promises must appear as image/png
outputs. A second test checks that the committed .ipynb files are what
colab/_build_notebooks.py generates, so the reviewed builder and the
notebooks cannot drift apart.
"""

import importlib.util
import pathlib

import nbformat
import pytest
from absl.testing import absltest
from absl.testing import parameterized

_COLAB = pathlib.Path(__file__).resolve().parents[2] / "colab"


def _builder():
  spec = importlib.util.spec_from_file_location(
    "_build_notebooks", _COLAB / "_build_notebooks.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_BUILDER = _builder()
_NAMES = tuple(_BUILDER.NOTEBOOKS)


def _read(name):
  return nbformat.read(_COLAB / f"{name}.ipynb", as_version=4)


def _figures(nb):
  return sum(
    "image/png" in out.get("data", {})
    for cell in nb.cells
    if cell.cell_type == "code"
    for out in cell.outputs
  )


class CommittedNotebooksTest(parameterized.TestCase):
  @parameterized.named_parameters((name, name) for name in _NAMES)
  def test_matches_builder(self, name):
    committed = _read(name)
    built = _BUILDER.build(name, _BUILDER.NOTEBOOKS[name])
    self.assertEqual(
      [(c.cell_type, c.source) for c in committed.cells],
      [(c.cell_type, c.source) for c in built.cells],
      msg=f"rerun python colab/_build_notebooks.py --execute {name}",
    )

  @parameterized.named_parameters((name, name) for name in _NAMES)
  def test_opens_with_title_purpose_and_install(self, name):
    cells = _read(name).cells
    self.assertEqual(cells[0].cell_type, "markdown")
    self.assertTrue(cells[0].source.startswith("# "))
    self.assertIn("**Purpose.**", cells[0].source)
    first_code = next(c for c in cells if c.cell_type == "code")
    self.assertIn("import jaxtopk", first_code.source)
    self.assertIn("%pip install", first_code.source)

  @parameterized.named_parameters((name, name) for name in _NAMES)
  def test_committed_outputs_show_figures(self, name):
    nb = _read(name)
    self.assertGreaterEqual(_figures(nb), _BUILDER.FIGURES[name])
    size = (_COLAB / f"{name}.ipynb").stat().st_size
    self.assertLess(size, 1_000_000, msg=f"{name}.ipynb is {size} bytes")


@pytest.mark.slow
class ExecuteNotebooksTest(parameterized.TestCase):
  @parameterized.named_parameters((name, name) for name in _NAMES)
  def test_executes_at_small_size(self, name):
    nb = _read(name)
    for cell in nb.cells:
      if cell.cell_type == "code":
        cell.outputs, cell.execution_count = [], None
    # Raises CellExecutionError on a cell error.
    _BUILDER.execute(nb, small=True, fast_compile=True)
    errors = [
      out
      for cell in nb.cells
      if cell.cell_type == "code"
      for out in cell.outputs
      if out.output_type == "error"
    ]
    self.assertEqual(errors, [])
    self.assertGreaterEqual(_figures(nb), _BUILDER.FIGURES[name])


if __name__ == "__main__":
  absltest.main()
