"""The notebooks in colab/: sources in sync, conventions, and they execute.

Each notebook's source is a percent-format script, ``colab/NN_topic.py``
(jupytext); ``colab/NN_topic.ipynb`` holds the same cells with the outputs of
a small-size run. The fast tests check that every committed notebook holds
exactly its source's cells (plus papermill's injected parameters), opens with
a title, a purpose and a tagged ``parameters`` cell, and shows its figures.
The slow test executes every source at small size in a fresh kernel
(``colab/execute.py``, papermill parameters, nbclient); a cell error fails it.
"""

import importlib.util
import pathlib

import nbformat
import pytest
from absl.testing import absltest
from absl.testing import parameterized

_COLAB = pathlib.Path(__file__).resolve().parents[2] / "colab"


def _load_execute():
  spec = importlib.util.spec_from_file_location(
    "colab_execute", _COLAB / "execute.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_EXECUTE = _load_execute()
_NAMES = _EXECUTE.NAMES

# Figures each notebook must show (image/png outputs).
FIGURES = {
  "01_theory_tour": 6,
  "02_certified_attention": 5,
  "03_native_topk_training": 3,
  "04_scaling_out": 2,
  "05_llm_checkpoints": 2,
}


def _read(name):
  return nbformat.read(_COLAB / f"{name}.ipynb", as_version=4)


def _figures(nb):
  return sum(
    "image/png" in out.get("data", {})
    for cell in nb.cells
    if cell.cell_type == "code"
    for out in cell.outputs
  )


def _tagged(nb, tag):
  return [c for c in nb.cells if tag in c.metadata.get("tags", [])]


class CommittedNotebooksTest(parameterized.TestCase):
  def test_every_notebook_has_a_source_and_figures(self):
    self.assertEqual(sorted(_NAMES), sorted(FIGURES))
    ipynbs = sorted(p.stem for p in _COLAB.glob("[0-9][0-9]_*.ipynb"))
    self.assertEqual(ipynbs, sorted(_NAMES))

  @parameterized.named_parameters((name, name) for name in _NAMES)
  def test_notebook_holds_the_cells_of_its_source(self, name):
    self.assertEqual(
      _EXECUTE.input_cells(_read(name)),
      _EXECUTE.input_cells(_EXECUTE.read_source(name)),
      msg=f"rerun python colab/execute.py {name}",
    )

  @parameterized.named_parameters((name, name) for name in _NAMES)
  def test_opens_with_title_purpose_parameters_and_install(self, name):
    cells = _EXECUTE.read_source(name).cells
    self.assertEqual(cells[0].cell_type, "markdown")
    self.assertTrue(cells[0].source.startswith("# "))
    self.assertIn("**Purpose.**", cells[0].source)
    code = [c for c in cells if c.cell_type == "code"]
    self.assertIn("parameters", code[0].metadata.get("tags", []))
    self.assertIn("SMALL = False", code[0].source)
    self.assertIn("import jaxtopk", code[1].source)
    self.assertIn("pip_install(", code[1].source)

  @parameterized.named_parameters((name, name) for name in _NAMES)
  def test_committed_outputs_are_small_size_with_figures(self, name):
    nb = _read(name)
    injected = _tagged(nb, "injected-parameters")
    rerun = f"rerun python colab/execute.py {name}"
    self.assertLen(injected, 1, msg=f"not an executed notebook: {rerun}")
    self.assertIn("SMALL = True", injected[0].source)
    self.assertGreaterEqual(_figures(nb), FIGURES[name])
    errors = [
      out
      for cell in nb.cells
      if cell.cell_type == "code"
      for out in cell.outputs
      if out.output_type == "error"
    ]
    self.assertEqual(errors, [])
    size = (_COLAB / f"{name}.ipynb").stat().st_size
    self.assertLess(size, 1_000_000, msg=f"{name}.ipynb is {size} bytes")


@pytest.mark.slow
class ExecuteNotebooksTest(parameterized.TestCase):
  @parameterized.named_parameters((name, name) for name in _NAMES)
  def test_executes_at_small_size(self, name):
    # Raises CellExecutionError on a cell error.
    nb = _EXECUTE.execute(name, small=True, fast_compile=True)
    self.assertGreaterEqual(_figures(nb), FIGURES[name])


if __name__ == "__main__":
  absltest.main()
