r"""Wall time per step and collective bytes at 1, 2 and 4 processes.

Runs ``worker.py`` with ``--repeats`` as one 8-device mesh laid out four
ways, one after the other: 1 process with XLA's in-process collectives
(the usual single-host run), 1 process through jax.distributed (gloo), 2
processes x 4 devices and 4 x 2 (gloo). For every program (the prefill and
decode cases, a 32,768-position decode, a native Top-k training step) it
records process 0's min and median wall time per call and the collectives
of the compiled HLO (``parallel.communication_summary``: count, result
bytes and ring-estimated bytes sent per device), the load average around
each run, and writes one JSON plus a markdown table.

On one machine every process shares the same cores, so this measures the
OVERHEAD of the multi-process path (gloo over TCP on localhost against
in-process collectives), not a speed-up.

  python -m tests.parallel.multiprocess.benchmark \
    --out=experiments/results/multihost/bench_multihost_cpu.json
"""

import json
import os
import pathlib
import platform
import sys
import tempfile
import time

from absl import app
from absl import flags

_OUT = flags.DEFINE_string("out", None, "JSON file to write.", required=True)
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed calls per program.")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 600, "Deadline per layout.")

LAYOUTS = (  # name, processes, devices per process, jax.distributed
  ("1x8 in-process", 1, 8, False),
  ("1x8 gloo", 1, 8, True),
  ("2x4 gloo", 2, 4, True),
  ("4x2 gloo", 4, 2, True),
)
_ROOT = pathlib.Path(__file__).resolve().parents[3]


def _load():
  return float(pathlib.Path("/proc/loadavg").read_text().split()[0])


def _table(rows):
  names = [name for name, *_ in LAYOUTS]
  lines = [
    "| program | collectives | bytes sent/device | "
    + " | ".join(f"{n} ms" for n in names)
    + " |",
    "|" + "---|" * (3 + len(names)),
  ]
  for program, row in rows.items():
    comm = row["comm"]
    times = [
      f"{row['ms'][n]['min_ms']:.1f} ({row['ms'][n]['median_ms']:.1f})"
      if n in row["ms"]
      else "-"
      for n in names
    ]
    lines.append(
      f"| {program} | {comm['count']} | {comm['sent_bytes']:.0f} | "
      + " | ".join(times)
      + " |"
    )
  return "\n".join(lines)


def main(argv):
  del argv
  from jaxtopk import parallel

  rows, runs = {}, []
  with tempfile.TemporaryDirectory() as tmp:
    for name, procs, devices, distributed in LAYOUTS:
      out = pathlib.Path(tmp, name.replace(" ", "_"))
      argv = [
        sys.executable,
        "-m",
        "tests.parallel.multiprocess.worker",
        f"--out={out}",
        "--prefill",
        "--decode",
        "--decode_large",
        f"--train_workdir={out / 'train'}",
        f"--repeats={_REPEATS.value}",
      ]
      load0, t0 = _load(), time.time()
      parallel.launch.launch_local(
        argv,
        num_processes=procs,
        devices_per_process=devices,
        timeout_s=_TIMEOUT.value,
        cwd=_ROOT,
        distributed=distributed,
      )
      runs.append(
        dict(
          layout=name,
          processes=procs,
          devices_per_process=devices,
          wall_s=round(time.time() - t0, 1),
          loadavg_before=load0,
          loadavg_after=_load(),
        )
      )
      print(runs[-1], flush=True)
      for stage in ("prefill", "decode", "decode_large", "train"):
        info = json.loads(
          (out / f"process_0_{stage}.json").read_text()
        )  # process 0's view (every process times the same SPMD step)
        for program, b in info["bench"].items():
          row = rows.setdefault(program, dict(comm=b["comm"], ms={}))
          row["ms"][name] = dict(min_ms=b["min_ms"], median_ms=b["median_ms"])
          if b["comm"] != row["comm"]:  # the same SPMD program: never seen
            row.setdefault("comm_by_layout", {})[name] = b["comm"]
  import jax

  result = dict(
    what=(
      "min and median wall ms per call of each program on one 8-device"
      " mesh laid out as 1, 2 or 4 processes on ONE machine (overhead of"
      " the multi-process path, not a speed-up); collectives from the"
      " compiled HLO"
    ),
    machine=dict(
      cpus=os.cpu_count(),
      platform=platform.platform(),
      python=platform.python_version(),
      jax=jax.__version__,
    ),
    date_utc=time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    repeats=_REPEATS.value,
    runs=runs,
    programs=rows,
  )
  path = pathlib.Path(_OUT.value)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(result, indent=1))
  table = _table(rows)
  path.with_suffix(".md").write_text(table + "\n")
  print(table)


if __name__ == "__main__":
  app.run(main)
