"""Several processes of one program on this machine, as a small pod.

``LocalCluster`` starts ``num_processes`` copies of a command on 127.0.0.1,
each with ``devices_per_process`` CPU devices, wired for
``maybe_initialize_distributed`` (``JAXTOPK_COORDINATOR_ADDRESS`` with a
free port, ``JAXTOPK_NUM_PROCESSES``, ``JAXTOPK_PROCESS_ID``,
``JAXTOPK_CPU_COLLECTIVES=gloo``, ``JAX_NUM_CPU_DEVICES``, and
``JAX_PLATFORMS=cpu``), so 2 processes x 4 devices form one 8-device global
mesh over JAX's gloo CPU collectives.
It is how the library's multi-host path is tested without a pod, and how a
user tries a pod program on a laptop.

Bounded and self-stopping:

- one deadline (``timeout_s``) for every process, from its start;
- each process runs in its own process group (session) and, on Linux, is
  killed if the thread that started it dies (``PR_SET_PDEATHSIG``): no
  orphans, even when the launcher is killed;
- the first process to fail (non-zero exit) stops the cluster: the others,
  which would wait in a collective for the dead peer, are killed, and
  ``ClusterError`` names the failed process with its exit status and the
  last lines of its output; a deadline names every process still running,
  with its last lines;
- leaving the ``with`` block kills whatever is still running.

Output of process i goes to ``<log_dir>/process_<i>.log`` (stdout and stderr
merged), never to a pipe that could fill and block it.
"""

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence

from jaxtopk.parallel import _multihost

_TAIL_LINES = 40


class ClusterError(RuntimeError):
  """A process of a LocalCluster failed, or the cluster ran out of time."""


@dataclasses.dataclass(frozen=True)
class ProcessResult:
  """How one process ended.

  Attributes:
    process_id: its index.
    returncode: exit status (negative: killed by that signal).
    output: its stdout and stderr, merged.
  """

  process_id: int
  returncode: int
  output: str


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that was free a moment ago (bind to port 0, read it back).

  Another program may take it before it is used; the window is short.
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


# On Linux each process first runs this (no preexec_fn: the fork stays
# free of Python code, which jax warns about in a multithreaded parent): ask
# for SIGKILL when the parent dies, exit if it already has, then exec the
# real command (the setting survives exec).
_DIE_WITH_PARENT = """\
import ctypes, os, sys
try:
  ctypes.CDLL("libc.so.6").prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
except (OSError, AttributeError):
  pass
if os.getppid() != int(sys.argv[1]):
  sys.exit("jaxtopk LocalCluster: the launching process is gone")
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _with_parent_watch(argv: list[str]) -> list[str]:
  if not sys.platform.startswith("linux"):
    return argv
  return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


def _tail(text: str, lines: int = _TAIL_LINES) -> str:
  return "\n".join(text.rstrip().splitlines()[-lines:])


def _clean_xla_flags(flags: str) -> str:
  """Drops a forced host device count (JAX_NUM_CPU_DEVICES decides)."""
  return " ".join(
    f
    for f in flags.split()
    if not f.startswith("--xla_force_host_platform_device_count")
  )


class LocalCluster:
  """``num_processes`` copies of ``argv`` on 127.0.0.1, one jax process each.

  Use as a context manager (or call ``start`` and ``close``)::

    with LocalCluster([sys.executable, "prog.py"], num_processes=2,
                      devices_per_process=4, timeout_s=120) as cluster:
      results = cluster.wait()  # raises ClusterError on any failure

  Args:
    argv: the command every process runs (``argv[0]`` an executable).
    num_processes: processes to start.
    devices_per_process: CPU devices per process (``JAX_NUM_CPU_DEVICES``).
    timeout_s: deadline for every process, from ``start``.
    env: extra environment variables (over a copy of ``os.environ``
      without its ``JAXTOPK_*`` and ``PYTEST_*`` variables); a value of
      None removes the variable.
    cwd: working directory of the processes.
    log_dir: where ``process_<i>.log`` files go (default a new temporary
      directory, removed by ``close`` unless ``keep_logs``).
    keep_logs: keep a default ``log_dir`` after ``close``.
    cpu_collectives: ``JAXTOPK_CPU_COLLECTIVES`` for the processes.
    distributed: set the ``JAXTOPK_*`` cluster variables (default: when
      ``num_processes > 1``). True with one process gives a one-process
      jax.distributed run: its collectives go through ``cpu_collectives``
      like a multi-process run's, not XLA's in-process ones.

  Raises:
    ValueError: for a bad process or device count or timeout.
  """

  def __init__(
    self,
    argv: Sequence[str],
    *,
    num_processes: int,
    devices_per_process: int = 1,
    timeout_s: float = 300.0,
    env: Mapping[str, str | None] | None = None,
    cwd: str | os.PathLike | None = None,
    log_dir: str | os.PathLike | None = None,
    keep_logs: bool = False,
    cpu_collectives: str = "gloo",
    distributed: bool | None = None,
  ):
    if not (isinstance(num_processes, int) and num_processes >= 1):
      raise ValueError(f"{num_processes=} must be an int >= 1")
    if not (isinstance(devices_per_process, int) and devices_per_process >= 1):
      raise ValueError(f"{devices_per_process=} must be an int >= 1")
    if not timeout_s > 0:
      raise ValueError(f"{timeout_s=} must be > 0")
    if cpu_collectives not in _multihost.CPU_COLLECTIVES:
      raise ValueError(
        f"{cpu_collectives=} must be one of {_multihost.CPU_COLLECTIVES}"
      )
    self.argv = [str(a) for a in argv]
    self.num_processes = num_processes
    self.devices_per_process = devices_per_process
    self.timeout_s = float(timeout_s)
    self._extra_env = dict(env or {})
    self.cwd = cwd
    self._own_log_dir = log_dir is None
    self._keep_logs = keep_logs
    self.log_dir = None if log_dir is None else os.fspath(log_dir)
    self.cpu_collectives = cpu_collectives
    self.distributed = num_processes > 1 if distributed is None else distributed
    self.coordinator_address = None
    self._procs: list[subprocess.Popen] = []
    self._logs = []
    self._killed: set[int] = set()
    self._deadline = None

  # ------------------------------------------------------------ start/stop

  def _env(self, process_id: int) -> dict[str, str]:
    env = dict(os.environ)
    for key in list(env):
      if key.startswith(("PYTEST_", "JAXTOPK_")):
        del env[key]
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_NUM_CPU_DEVICES"] = str(self.devices_per_process)
    env["PYTHONUNBUFFERED"] = "1"
    flags = _clean_xla_flags(env.get("XLA_FLAGS", ""))
    if flags:
      env["XLA_FLAGS"] = flags
    else:
      env.pop("XLA_FLAGS", None)
    if self.distributed:
      env[_multihost.ENV_COORDINATOR] = self.coordinator_address
      env[_multihost.ENV_NUM_PROCESSES] = str(self.num_processes)
      env[_multihost.ENV_PROCESS_ID] = str(process_id)
      env[_multihost.ENV_CPU_COLLECTIVES] = self.cpu_collectives
      # Give up connecting well before the cluster's own deadline.
      env[_multihost.ENV_INIT_TIMEOUT] = str(
        max(10, int(min(120, self.timeout_s / 2)))
      )
    for key, value in self._extra_env.items():
      if value is None:
        env.pop(key, None)
      else:
        env[key] = str(value)
    return env

  def start(self) -> "LocalCluster":
    """Starts every process (once)."""
    if self._procs:
      raise RuntimeError("LocalCluster.start() was already called")
    if self.log_dir is None:
      self.log_dir = tempfile.mkdtemp(prefix="jaxtopk_cluster_")
    os.makedirs(self.log_dir, exist_ok=True)
    self.coordinator_address = f"127.0.0.1:{free_port()}"
    self._deadline = time.monotonic() + self.timeout_s
    try:
      for i in range(self.num_processes):
        log = open(os.path.join(self.log_dir, f"process_{i}.log"), "wb")
        self._logs.append(log)
        self._procs.append(
          subprocess.Popen(
            _with_parent_watch(self.argv),
            cwd=self.cwd,
            env=self._env(i),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
          )
        )
    except BaseException:
      self.close()
      raise
    return self

  def __enter__(self) -> "LocalCluster":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.close()

  def kill(self, process_id: int, sig: int = signal.SIGKILL) -> bool:
    """Sends ``sig`` to process ``process_id``'s group; expected by ``wait``.

    Returns:
      True if the process was still running when signalled.
    """
    proc = self._procs[process_id]
    self._killed.add(process_id)
    if proc.poll() is not None:
      return False
    try:
      os.killpg(proc.pid, sig)
    except ProcessLookupError:
      return False
    return True

  def close(self) -> None:
    """Kills every process still running (SIGKILL to its group) and reaps it."""
    for proc in self._procs:
      if proc.poll() is None:
        try:
          os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
    for proc in self._procs:
      try:
        proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        pass
    for log in self._logs:
      log.close()
    if self._own_log_dir and not self._keep_logs and self.log_dir:
      import shutil

      shutil.rmtree(self.log_dir, ignore_errors=True)

  # ------------------------------------------------------------ inspection

  def output(self, process_id: int) -> str:
    """Everything process ``process_id`` printed so far.

    Readable until ``close`` removes a default (temporary) ``log_dir``.
    """
    if not self._logs[process_id].closed:
      self._logs[process_id].flush()
    path = os.path.join(self.log_dir, f"process_{process_id}.log")
    with open(path, "rb") as f:
      return f.read().decode("utf-8", errors="replace")

  def returncodes(self) -> list[int | None]:
    """Each process' exit status, None while it runs."""
    return [p.poll() for p in self._procs]

  def _report(self, ids: Sequence[int]) -> str:
    parts = []
    for i in ids:
      rc = self._procs[i].poll()
      state = "running" if rc is None else f"exit status {rc}"
      parts.append(
        f"--- process {i} ({state}); last output:\n"
        f"{_tail(self.output(i)) or '(none)'}"
      )
    return "\n".join(parts)

  def _check(self) -> None:
    """Raises ClusterError (after killing the rest) if a process failed."""
    for i, proc in enumerate(self._procs):
      rc = proc.poll()
      if rc is not None and rc != 0 and i not in self._killed:
        others = [j for j in range(self.num_processes) if j != i]
        self._kill_all()
        raise ClusterError(
          f"process {i} of {self.num_processes} failed with exit status"
          f" {rc} (argv {self.argv}); the other processes were stopped.\n"
          + self._report([i] + others)
        )
    if time.monotonic() > self._deadline:
      running = [i for i, p in enumerate(self._procs) if p.poll() is None]
      self._kill_all()
      raise ClusterError(
        f"processes {running} of {self.num_processes} still running after"
        f" the {self.timeout_s:.0f} s deadline (hung or too slow; argv"
        f" {self.argv}); all were killed.\n" + self._report(running)
      )

  def _kill_all(self) -> None:
    for i, proc in enumerate(self._procs):
      if proc.poll() is None:
        self.kill(i)
    for proc in self._procs:
      try:
        proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        pass

  def wait_until(
    self,
    condition: Callable[[], bool],
    *,
    what: str,
    timeout_s: float | None = None,
    poll_s: float = 0.05,
  ) -> None:
    """Polls ``condition()`` until True, watching the processes meanwhile.

    Args:
      condition: checked every ``poll_s`` seconds.
      what: the awaited event, for the error message.
      timeout_s: give up after this long (default: the cluster deadline).
      poll_s: polling period.

    Raises:
      ClusterError: when a process fails, the deadline passes, or every
        process ended without ``condition`` becoming True.
    """
    limit = self._deadline
    if timeout_s is not None:
      limit = min(limit, time.monotonic() + timeout_s)
    while True:
      if condition():
        return
      self._check()
      if all(p.poll() is not None for p in self._procs):
        if condition():
          return
        raise ClusterError(
          f"every process ended before {what}.\n"
          + self._report(range(self.num_processes))
        )
      if time.monotonic() > limit:
        running = [i for i, p in enumerate(self._procs) if p.poll() is None]
        self._kill_all()
        raise ClusterError(
          f"gave up waiting for {what}; processes"
          f" {running} were still running and were killed.\n"
          + self._report(range(self.num_processes))
        )
      time.sleep(poll_s)

  def wait(self, poll_s: float = 0.05) -> list[ProcessResult]:
    """Waits for every process; all must exit 0 (or be ``kill``-ed).

    Returns:
      One ``ProcessResult`` per process, in process order.

    Raises:
      ClusterError: naming the first process that failed (the rest are
        killed) or, at the deadline, every process still running.
    """
    while any(p.poll() is None for p in self._procs):
      self._check()
      time.sleep(poll_s)
    self._check()
    return [
      ProcessResult(i, p.returncode, self.output(i))
      for i, p in enumerate(self._procs)
    ]


def launch_local(
  argv: Sequence[str],
  *,
  num_processes: int,
  devices_per_process: int = 1,
  timeout_s: float = 300.0,
  **kwargs,
) -> list[ProcessResult]:
  """Runs ``argv`` as a ``LocalCluster`` to the end; see ``LocalCluster``.

  Returns:
    One ``ProcessResult`` per process.

  Raises:
    ClusterError: a process failed or the deadline passed (every process
      is then killed).
  """
  with LocalCluster(
    argv,
    num_processes=num_processes,
    devices_per_process=devices_per_process,
    timeout_s=timeout_s,
    **kwargs,
  ) as cluster:
    return cluster.wait()
