"""Shared machinery of the experiment binaries (big_vision style).

The convention every binary under experiments/ follows (experiments/README.md
states it for new ones):

- an absl app: ``app.run(main)``; flags ``--config`` (a
  ``config_flags.DEFINE_config_file`` pointing at
  ``experiments/configs/<name>.py``, whose ``get_config(arg)`` has a
  ``smoke`` variant that runs in seconds), a required ``--workdir`` and
  ``--overwrite``; :func:`app_main` defines them and calls the binary's
  ``run``;
- ``run(config, workdir, *, overwrite=False)``: flag-free, does the work
  and returns a small summary; tests call it in-process with the smoke
  config;
- a run opens its directory through :class:`Workdir`, which writes
  ``config.json`` and refuses a directory that already holds a run
  (``--overwrite`` replaces it), or, for a resumable binary, resumes a run
  of the same config and refuses a different one: two runs are never mixed;
- ``metrics.jsonl``: one JSON object per line, each with a ``"kind"`` field
  naming its table; ``*.png`` figures (Agg backend); ``summary.txt`` the
  printed table; benchmarks also write ``results.json`` with
  :func:`machine_info` (machine, jax, load average before and after);
- long loops log progress with :class:`Progress`.
"""

import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

# Files a run writes; --overwrite removes exactly these (and *.png).
OUTPUT_FILES = ("config.json", "metrics.jsonl", "summary.txt", "results.json")
CONFIG_DIR = pathlib.Path(__file__).resolve().parent / "configs"


class WorkdirNotEmptyError(FileExistsError):
  """Raised when a workdir already holds a run's outputs."""


def machine_info() -> dict:
  """Where and how a figure was measured: machine, jax, devices, load."""
  return dict(
    machine=platform.machine(),
    processor=platform.processor(),
    platform=platform.platform(),
    cpu_count=os.cpu_count(),
    python=platform.python_version(),
    jax=jax.__version__,
    backend=jax.default_backend(),
    devices=[str(d) for d in jax.devices()],
    load_average_1_5_15=list(os.getloadavg()),
    command=" ".join(["python -m", *sys.argv]) if sys.argv else "",
  )


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


class Workdir:
  """One run's directory; opening it starts, resumes or refuses a run.

  Attributes:
    path: the directory (``pathlib.Path``).
    resumed: True when an earlier run of the same config is being resumed.
    metrics: the run's :class:`MetricWriter` (``metrics.jsonl``).

  Args:
    path: the directory; created if missing.
    config: the run's config (``ml_collections.ConfigDict``); written to
      ``config.json``.
    overwrite: remove an earlier run's outputs (``OUTPUT_FILES``, ``*.png``)
      instead of refusing.
    resumable: a binary that can continue an interrupted run: a directory
      holding the SAME config is resumed (outputs kept), a different config
      is refused.

  Raises:
    WorkdirNotEmptyError: the directory holds a run that may not be reused.
  """

  def __init__(
    self,
    path,
    config: ml_collections.ConfigDict,
    *,
    overwrite: bool = False,
    resumable: bool = False,
  ):
    self.path = pathlib.Path(path)
    self.path.mkdir(parents=True, exist_ok=True)
    current = _to_jsonable(config.to_dict())
    saved_path = self.path / "config.json"
    saved = json.loads(saved_path.read_text()) if saved_path.exists() else None
    self.resumed = False
    if resumable and saved is not None and not overwrite:
      if saved != current:
        raise WorkdirNotEmptyError(
          f"{str(self.path)!r} holds a run with a different config.json; use"
          " a new --workdir (or delete it) instead of mixing two runs"
        )
      self.resumed = True
    elif jax.process_index() == 0:  # multi-host: process 0 writes
      prepare_workdir(self.path, overwrite=overwrite)
      write_config(self.path, config)
    self.metrics = MetricWriter(self.path)

  def write_json(self, name: str, obj: Any) -> pathlib.Path:
    """Writes ``<workdir>/<name>`` as indented JSON; returns its path."""
    path = self.path / name
    path.write_text(json.dumps(_to_jsonable(obj), indent=1) + "\n")
    return path

  def save_figure(self, fig, name: str) -> pathlib.Path:
    """Saves ``fig`` as ``<workdir>/<name>.png`` and closes it."""
    return save_figure(fig, self.path, name)

  def write_summary(self, text: str) -> None:
    """Writes ``summary.txt`` and prints it."""
    write_summary(self.path, text)


def app_main(name: str, run, *, default_workdir: str | None = None) -> None:
  """The ``__main__`` of a binary: defines the common flags, runs ``run``.

  Args:
    name: the binary's name (its config is experiments/configs/<name>.py).
    run: ``run(config, workdir, *, overwrite)``.
    default_workdir: only for the main job (k_eps_scaling); None makes
      ``--workdir`` required.
  """
  config, workdir, overwrite = define_flags(
    name, default_workdir=default_workdir
  )

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    run(config.value, workdir.value, overwrite=overwrite.value)

  app.run(main)


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
  """Writes ``config.json`` (the config the run used), atomically.

  Atomic (write then rename) because the other processes of a multi-host run
  may read it meanwhile.
  """
  tmp = workdir / "config.json.tmp"
  with open(tmp, "w") as f:
    json.dump(_to_jsonable(config.to_dict()), f, indent=2, sort_keys=True)
    f.write("\n")
  os.replace(tmp, workdir / "config.json")


class MetricWriter:
  """Appends one JSON object per line to ``metrics.jsonl``.

  Every record carries a ``kind`` naming its table, so a reader can split the
  file with ``[r for r in records if r["kind"] == ...]``.
  """

  def __init__(self, workdir: pathlib.Path):
    self.path = workdir / "metrics.jsonl"
    # Multi-host: only process 0 writes (the others return the records).
    self.writes = jax.process_index() == 0
    if self.writes:
      self.path.touch()

  def write(self, kind: str, **values) -> dict:
    record = {"kind": kind, **_to_jsonable(values)}
    if self.writes:
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


def bar_figure(
  workdir: pathlib.Path,
  name: str,
  groups: dict,
  *,
  ylabel: str,
  title: str,
  log: bool = False,
) -> pathlib.Path:
  """Grouped bar chart ``groups[group][bar] = value`` saved as ``name.png``.

  The figure of a benchmark: one group per size, one bar per variant.
  """
  fig, axes = new_figure(size=(6.0, 3.6))
  ax = axes[0][0]
  bars = sorted({b for g in groups.values() for b in g})
  width = 0.8 / max(len(bars), 1)
  for i, bar in enumerate(bars):
    xs = [j + i * width for j in range(len(groups))]
    ys = [groups[g].get(bar, np.nan) for g in groups]
    ax.bar(xs, ys, width, label=bar)
  ax.set_xticks(
    [j + 0.4 - width / 2 for j in range(len(groups))], [str(g) for g in groups]
  )
  if log:
    ax.set_yscale("log")
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=7)
  return save_figure(fig, workdir, name)


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
