"""Shared plumbing for the experiment binaries (big_vision style).

Every binary under experiments/ is an absl app with two entry points:

- ``run(config, workdir, *, overwrite=False)``: flag-free, does the work and
  returns a small summary dict. Tests call it in-process with the ``smoke``
  config.
- ``main(argv)``: reads ``--config``, ``--workdir`` and ``--overwrite`` (set
  up by ``define_flags`` below, only when the module is run as a script so
  several binaries can be imported in one process) and calls ``run``.

A run writes into its workdir:

- ``config.json``: the config it ran with;
- ``metrics.jsonl``: one JSON object per line, each with a ``"kind"`` field
  naming the table it belongs to;
- ``*.png``: figures (matplotlib, Agg backend, no display needed);
- ``summary.txt``: the table printed at the end.

A rerun into a workdir that already holds outputs refuses unless
``--overwrite`` is given (then only the files a run writes are removed), so
two runs are never silently mixed.
"""

import json
import math
import pathlib
import statistics
import time
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import flags
from absl import logging
from ml_collections import config_flags

# Files a run writes; --overwrite removes exactly these (and *.png).
OUTPUT_FILES = ("config.json", "metrics.jsonl", "summary.txt")
CONFIG_DIR = pathlib.Path(__file__).resolve().parent / "configs"


class WorkdirNotEmptyError(FileExistsError):
  """Raised when a workdir already holds a run's outputs."""


def define_flags(name: str, *, default_workdir: str | None = None):
  """Defines ``--config``, ``--workdir`` and ``--overwrite`` for a binary.

  Call this under ``if __name__ == "__main__":`` so that importing a binary
  defines no flags.

  Args:
    name: the binary's name; its default config is
      ``experiments/configs/<name>.py``.
    default_workdir: default for ``--workdir``; None makes it required.

  Returns:
    ``(config_flag, workdir_flag, overwrite_flag)`` flag holders.
  """
  config = config_flags.DEFINE_config_file(
    "config",
    default=str(CONFIG_DIR / f"{name}.py"),
    help_string=(
      f"Config file, e.g. experiments/configs/{name}.py or"
      f" experiments/configs/{name}.py:smoke."
    ),
    lock_config=True,
  )
  workdir = flags.DEFINE_string(
    "workdir",
    default_workdir,
    "Directory for config.json, metrics.jsonl and figures.",
  )
  if default_workdir is None:
    flags.mark_flag_as_required("workdir")
  overwrite = flags.DEFINE_bool(
    "overwrite",
    False,
    "Replace the outputs of an earlier run in --workdir instead of refusing.",
  )
  return config, workdir, overwrite


def prepare_workdir(workdir, *, overwrite: bool) -> pathlib.Path:
  """Creates ``workdir``; refuses if it holds outputs unless ``overwrite``.

  Args:
    workdir: path of the run directory.
    overwrite: remove an earlier run's outputs (config.json, metrics.jsonl,
      summary.txt, *.png) instead of raising.

  Returns:
    The workdir as a ``pathlib.Path``.

  Raises:
    WorkdirNotEmptyError: when outputs exist and ``overwrite`` is False.
  """
  path = pathlib.Path(workdir)
  path.mkdir(parents=True, exist_ok=True)
  existing = [path / f for f in OUTPUT_FILES if (path / f).exists()]
  existing += sorted(path.glob("*.png"))
  if existing and not overwrite:
    raise WorkdirNotEmptyError(
      f"{str(path)!r} already holds a run's outputs"
      f" ({', '.join(p.name for p in existing)}); pass --overwrite to"
      " replace them or choose another --workdir."
    )
  for p in existing:
    p.unlink()
  return path


def _to_jsonable(x: Any) -> Any:
  """Numpy/jax scalars and arrays to plain Python; NaN/inf kept as floats."""
  if isinstance(x, dict):
    return {str(k): _to_jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_to_jsonable(v) for v in x]
  if isinstance(x, (str, bool)) or x is None:
    return x
  if isinstance(x, (int, np.integer)):
    return int(x)
  if isinstance(x, (float, np.floating)):
    return float(x)
  arr = np.asarray(x)
  if arr.dtype == bool:
    return arr.tolist() if arr.ndim else bool(arr)
  if np.issubdtype(arr.dtype, np.integer):
    return arr.tolist() if arr.ndim else int(arr)
  return arr.astype(np.float64).tolist() if arr.ndim else float(arr)


def write_config(workdir: pathlib.Path, config: ml_collections.ConfigDict):
  """Writes ``config.json`` (the config the run used)."""
  with open(workdir / "config.json", "w") as f:
    json.dump(_to_jsonable(config.to_dict()), f, indent=2, sort_keys=True)
    f.write("\n")


class MetricWriter:
  """Appends one JSON object per line to ``metrics.jsonl``.

  Every record carries a ``kind`` naming its table, so a reader can split the
  file with ``[r for r in records if r["kind"] == ...]``.
  """

  def __init__(self, workdir: pathlib.Path):
    self.path = workdir / "metrics.jsonl"
    self.path.touch()

  def write(self, kind: str, **values) -> dict:
    record = {"kind": kind, **_to_jsonable(values)}
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    return record


def read_metrics(workdir, kind: str | None = None) -> list[dict]:
  """Reads ``metrics.jsonl``; keeps only records of ``kind`` when given."""
  with open(pathlib.Path(workdir) / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f if line.strip()]
  if kind is not None:
    records = [r for r in records if r["kind"] == kind]
  return records


class Progress:
  """Logs ``done/total``, elapsed time and ETA on long loops (absl logging).

  Logs at most every ``every_s`` seconds, plus the last step.
  """

  def __init__(self, name: str, total: int, every_s: float = 5.0):
    self.name = name
    self.total = int(total)
    self.every_s = every_s
    self.start = time.monotonic()
    self._last = -math.inf
    self.done = 0

  def update(self, steps: int = 1, note: str = "") -> None:
    self.done += steps
    now = time.monotonic()
    if now - self._last < self.every_s and self.done < self.total:
      return
    self._last = now
    elapsed = now - self.start
    eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
    logging.info(
      "%s: %d/%d done, %.1fs elapsed, ETA %.1fs %s",
      self.name,
      self.done,
      self.total,
      elapsed,
      eta,
      note,
    )

  def wrap(self, items: Iterable, note_fn=None):
    for item in items:
      yield item
      self.update(1, note_fn(item) if note_fn else "")


def new_figure(ncols: int = 1, nrows: int = 1, size=(4.5, 3.5)):
  """A matplotlib figure with the Agg backend (no display needed)."""
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  fig, axes = plt.subplots(
    nrows,
    ncols,
    figsize=(size[0] * ncols, size[1] * nrows),
    squeeze=False,
  )
  return fig, axes


def save_figure(fig, workdir: pathlib.Path, name: str, dpi: int = 80):
  """Saves ``fig`` as ``<workdir>/<name>.png`` and closes it."""
  from matplotlib import pyplot as plt

  path = workdir / f"{name}.png"
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  plt.close(fig)
  return path


def _fmt(v: Any) -> str:
  if isinstance(v, (float, np.floating)):
    v = float(v)
    if v != v:
      return "nan"
    if v == 0 or 1e-3 <= abs(v) < 1e5:
      return f"{v:.4g}"
    return f"{v:.3e}"
  return str(v)


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
  """A plain-text table (markdown pipe syntax) of ``rows`` by ``columns``."""
  cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
  widths = [
    max([len(c)] + [len(row[i]) for row in cells])
    for i, c in enumerate(columns)
  ]
  line = lambda xs: (
    "| "
    + " | ".join(x.rjust(w) for x, w in zip(xs, widths, strict=True))
    + " |"
  )
  out = [line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
  out += [line(row) for row in cells]
  return "\n".join(out)


def write_summary(workdir: pathlib.Path, text: str) -> None:
  """Writes ``summary.txt`` and prints it."""
  (workdir / "summary.txt").write_text(text + "\n")
  print(text)


def time_call(fn, repeats: int) -> dict:
  """Times ``fn()``: one warm-up (compile) run, then ``repeats`` timed runs.

  Every run is waited on with ``jax.block_until_ready``. Returns seconds:
  ``first_s`` (the warm-up, compile included), ``median_s``, ``min_s`` (the
  steadier figure on a shared machine) and ``repeats``.
  """
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return dict(
    first_s=first,
    median_s=statistics.median(times),
    min_s=min(times),
    repeats=repeats,
  )


def time_round_robin(variants, *, repeats):
  """Times ``{name: (fn, args)}`` interleaved, so load spikes hit all alike.

  Returns:
    ``{name: dict(min_ms, median_ms)}`` after two warm-up calls each.
  """
  for fn, args in variants.values():
    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))
  ts = {name: [] for name in variants}
  for _ in range(repeats):
    for name, (fn, args) in variants.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      ts[name].append(time.perf_counter() - t0)
  return {
    name: dict(min_ms=1e3 * min(t), median_ms=1e3 * float(np.median(t)))
    for name, t in ts.items()
  }
