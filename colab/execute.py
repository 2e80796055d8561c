"""Executes the notebooks in colab/ from their percent-format sources.

Each notebook's source is ``colab/NN_topic.py`` (jupytext percent format,
linted by ruff with the rest of the repository); ``colab/NN_topic.ipynb`` is
the same cells with outputs, for reading on GitHub and Colab. This script
reads the ``.py``, injects parameters the papermill way (a cell tagged
``injected-parameters`` after the cell tagged ``parameters``), runs it top to
bottom in a fresh kernel of THIS Python and writes the ``.ipynb``:

  python colab/execute.py                      # all, small size (committed)
  python colab/execute.py 03_native_topk_training
  python colab/execute.py --full --out_dir=/tmp/nb   # full size

``papermill colab/NN_topic.ipynb out.ipynb -p SMALL True`` does the same from
the notebook. tests/notebooks/notebooks_test.py calls :func:`execute` at small
size and checks that every committed ``.ipynb`` holds the cells of its
``.py`` (``jupytext --to ipynb --update colab/NN_topic.py`` refreshes the
inputs of a notebook and keeps its outputs; the pre-commit hook runs it).
"""

import argparse
import json
import os
import pathlib
import sys
import tempfile

import jupytext
import nbformat
from papermill.parameterize import parameterize_notebook

COLAB_DIR = pathlib.Path(__file__).resolve().parent
REPO_ROOT = COLAB_DIR.parent
NAMES = tuple(sorted(p.stem for p in COLAB_DIR.glob("[0-9][0-9]_*.py")))

# XLA CPU flags that roughly halve compile time (measured on the README
# snippets: 19.5 s -> 10.5 s CPU); the tests set them, the committed outputs
# are made without them.
FAST_COMPILE_FLAGS = (
  "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)


def source_path(name: str) -> pathlib.Path:
  """``colab/<name>.py``, the notebook's source."""
  return COLAB_DIR / f"{name}.py"


def read_source(name: str) -> nbformat.NotebookNode:
  """The notebook of ``colab/<name>.py`` (no outputs)."""
  return jupytext.read(source_path(name))


def input_cells(nb) -> list[tuple[str, str]]:
  """``(cell_type, source)`` of every cell but papermill's injected one."""
  return [
    (c.cell_type, c.source.strip())
    for c in nb.cells
    if "injected-parameters" not in c.metadata.get("tags", [])
  ]


def execute(
  name: str,
  *,
  small: bool = True,
  fast_compile: bool = False,
  timeout: int = 600,
) -> nbformat.NotebookNode:
  """Runs ``colab/<name>.py`` in a fresh kernel; returns the executed notebook.

  The kernel is started from a temporary kernelspec whose argv is
  ``sys.executable``, so it runs in the current virtual environment whatever
  kernelspecs the machine has (a fresh CI venv has none). The repository
  root is put on PYTHONPATH, so an un-installed checkout imports too.

  Args:
    name: the notebook's name, e.g. ``"01_theory_tour"``.
    small: inject ``SMALL = True`` (the small sizes).
    fast_compile: add ``FAST_COMPILE_FLAGS`` to the kernel's XLA_FLAGS.
    timeout: seconds allowed per cell.

  Returns:
    The executed notebook (outputs stored), with papermill's injected
    parameters cell.

  Raises:
    nbclient.exceptions.CellExecutionError: a cell raised.
  """
  import nbclient
  from jupyter_client.kernelspec import KernelSpecManager
  from jupyter_client.manager import KernelManager

  nb = read_source(name)
  # The metadata papermill's own loader adds (load_notebook_node).
  nb.metadata["papermill"] = {"parameters": {}, "environment_variables": {}}
  for cell in nb.cells:
    cell.metadata.setdefault("tags", [])
  nb = parameterize_notebook(nb, {"SMALL": small})
  for cell in nb.cells:
    if not cell.metadata["tags"]:
      del cell.metadata["tags"]
  env = {
    "PYTHONPATH": os.pathsep.join(
      [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    ),
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
  }
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if fast_compile:
    xla_flags = f"{xla_flags} {FAST_COMPILE_FLAGS}".strip()
  if xla_flags:
    env["XLA_FLAGS"] = xla_flags
  with tempfile.TemporaryDirectory() as tmp:
    spec_dir = pathlib.Path(tmp, "kernels", "jaxtopk-python3")
    spec_dir.mkdir(parents=True)
    spec = {
      "argv": [
        sys.executable,
        "-m",
        "ipykernel_launcher",
        "-f",
        "{connection_file}",
      ],
      "display_name": "Python 3 (jaxtopk)",
      "language": "python",
      "env": env,
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    ksm = KernelSpecManager(kernel_dirs=[str(spec_dir.parent)])
    km = KernelManager(kernel_name="jaxtopk-python3", kernel_spec_manager=ksm)
    client = nbclient.NotebookClient(
      nb,
      km=km,
      timeout=timeout,
      resources={"metadata": {"path": str(COLAB_DIR)}},
    )
    try:
      client.execute()
    finally:  # nbclient leaves a kernel it was handed running
      if km.has_kernel:
        km.shutdown_kernel(now=True)
  nb.metadata["kernelspec"] = {
    "name": "python3",
    "display_name": "Python 3",
    "language": "python",
  }
  nb.metadata.pop("widgets", None)
  return nb


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--full", action="store_true", help="full sizes")
  parser.add_argument(
    "--out_dir", default=str(COLAB_DIR), help="where to write (default colab/)"
  )
  parser.add_argument("names", nargs="*", help=f"default: all of {NAMES}")
  args = parser.parse_args(argv)
  for name in args.names or NAMES:
    nb = execute(name, small=not args.full)
    path = pathlib.Path(args.out_dir) / f"{name}.ipynb"
    nbformat.write(nb, path)
    print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
  main()
