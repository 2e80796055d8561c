"""Multi-host (multi-controller) runs: start-up, process-local data, I/O.

A pod is many hosts, each running ONE process of the same program that owns
only its own devices (JAX's multi-controller model). This module holds what
every such program needs, written once:

- ``maybe_initialize_distributed``: calls ``jax.distributed.initialize``
  from arguments, absl flags (``define_distributed_flags``) or environment
  variables, and selects JAX's CPU collectives (gloo) so the same program
  runs as several processes on one machine (tests) or on a CPU cluster.
  On a Cloud TPU pod slice (and SLURM, Open MPI, Kubernetes) jax finds the
  coordinator, the process count and this process' id itself:
  ``JAXTOPK_DISTRIBUTED=1`` asks for that auto-detection.
- ``process_local_slices`` / ``make_global_array`` / ``global_batch``: a
  global ``jax.Array`` from the block of data THIS process loads
  (``jax.make_array_from_process_local_data``); a process never needs the
  whole array.
- ``put_global``: values every process holds alike (same seed) placed on
  global shardings without ``jax.device_put``'s cross-process check;
- ``fetch``: global arrays to numpy on every process (an all-gather over
  processes where the array is split across them), for metrics and tests.
- ``is_main_process`` (metrics, figures and reports are written by process
  0 only), ``any_process`` (a stop decision every process agrees on, so
  no process leaves a collective its peers are still waiting in) and
  ``fail_fast`` (a failed process ends at once instead of waiting in jax's
  shutdown barrier for peers that wait for it).

Environment variables read by ``maybe_initialize_distributed`` (an argument
or flag wins over its variable):

- ``JAXTOPK_DISTRIBUTED=1``: initialise, auto-detecting what is not given;
- ``JAXTOPK_COORDINATOR_ADDRESS`` (``host:port`` of process 0; jax's own
  ``JAX_COORDINATOR_ADDRESS`` works too), ``JAXTOPK_NUM_PROCESSES``,
  ``JAXTOPK_PROCESS_ID``: explicit cluster (GPU or CPU clusters, localhost);
- ``JAXTOPK_CPU_COLLECTIVES``: ``gloo`` (default when initialising),
  ``mpi`` or ``none``;
- ``JAXTOPK_INITIALIZATION_TIMEOUT``: seconds to wait for all processes
  (jax's default 300).

jax itself reads ``JAX_LOCAL_DEVICE_IDS`` and ``JAX_NUM_CPU_DEVICES`` (CPU
devices per process).
"""

import contextlib
import os
import sys
import traceback
from collections.abc import Callable
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtopk.parallel import _mesh

ENV_DISTRIBUTED = "JAXTOPK_DISTRIBUTED"
ENV_COORDINATOR = "JAXTOPK_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXTOPK_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXTOPK_PROCESS_ID"
ENV_CPU_COLLECTIVES = "JAXTOPK_CPU_COLLECTIVES"
ENV_INIT_TIMEOUT = "JAXTOPK_INITIALIZATION_TIMEOUT"
CPU_COLLECTIVES = ("gloo", "mpi", "none")


def _env_int(name: str) -> int | None:
  raw = os.environ.get(name, "").strip()
  if not raw:
    return None
  try:
    return int(raw)
  except ValueError:
    raise ValueError(
      f"environment variable {name}={raw!r} must be an integer"
    ) from None


def maybe_initialize_distributed(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  local_device_ids: Sequence[int] | None = None,
  cpu_collectives: str | None = None,
  initialization_timeout: int | None = None,
) -> bool:
  """Calls ``jax.distributed.initialize`` when this is a multi-host run.

  A run is multi-host when any of coordinator, process count or process id
  is given (argument or environment variable, see the module docstring), or
  when ``JAXTOPK_DISTRIBUTED=1`` (jax then auto-detects what is missing on
  Cloud TPU, SLURM, Open MPI, Kubernetes). Call it before any other jax
  call: the CPU collectives and the device set are fixed when jax starts
  its backends. A second call is a no-op.

  Args:
    coordinator_address: ``host:port`` of process 0, reachable by all.
    num_processes: number of processes (usually one per host).
    process_id: this process' index in ``[0, num_processes)``.
    local_device_ids: restrict this process to these local devices.
    cpu_collectives: ``'gloo'`` (default when initialising), ``'mpi'`` or
      ``'none'``: how CPU devices of different processes communicate.
    initialization_timeout: seconds to wait for every process to connect.

  Returns:
    True when jax.distributed is (now) initialised, False for a
    single-process run.

  Raises:
    ValueError: for an environment variable that is not an integer, an
      unknown ``cpu_collectives``, or (from jax) an incomplete cluster
      description that cannot be auto-detected.

  Example (two processes on one machine, one per shell)::

    JAXTOPK_COORDINATOR_ADDRESS=127.0.0.1:7777 JAXTOPK_NUM_PROCESSES=2 \\
      JAXTOPK_PROCESS_ID=0 JAX_NUM_CPU_DEVICES=4 python my_program.py
  """
  if not coordinator_address:
    coordinator_address = os.environ.get(ENV_COORDINATOR, "").strip() or None
  if num_processes is None:
    num_processes = _env_int(ENV_NUM_PROCESSES)
  if process_id is None:
    process_id = _env_int(ENV_PROCESS_ID)
  if initialization_timeout is None:
    initialization_timeout = _env_int(ENV_INIT_TIMEOUT)
  if cpu_collectives is None:
    cpu_collectives = os.environ.get(ENV_CPU_COLLECTIVES) or None
  if cpu_collectives is not None and cpu_collectives not in CPU_COLLECTIVES:
    raise ValueError(f"{cpu_collectives=} must be one of {CPU_COLLECTIVES}")
  args = dict(
    coordinator_address=coordinator_address,
    num_processes=num_processes,
    process_id=process_id,
  )
  wanted = any(v is not None for v in args.values()) or (
    os.environ.get(ENV_DISTRIBUTED, "") == "1"
  )
  if jax.distributed.is_initialized():
    return True
  if not wanted:
    return False
  # Before the backends start: CPU devices of different processes talk
  # through gloo (jax 0.10 defaults to it; older releases to 'none').
  jax.config.update(
    "jax_cpu_collectives_implementation", cpu_collectives or "gloo"
  )
  kwargs = {k: v for k, v in args.items() if v is not None}
  if local_device_ids is not None:
    kwargs["local_device_ids"] = list(local_device_ids)
  if initialization_timeout is not None:
    kwargs["initialization_timeout"] = int(initialization_timeout)
  jax.distributed.initialize(**kwargs)
  return True


def define_distributed_flags(flag_values=None) -> Callable[[], bool]:
  """Defines absl flags for the multi-host start-up; returns its caller.

  Flags (all default to their environment variable, see the module
  docstring): ``--coordinator_address``, ``--num_processes``,
  ``--process_id``, ``--cpu_collectives``. Flags already defined (a second
  binary imported in the same process) are reused.

  Args:
    flag_values: the ``absl.flags.FlagValues`` (default ``flags.FLAGS``).

  Returns:
    ``init()``: calls ``maybe_initialize_distributed`` with the parsed
    flags; call it first in ``main``. Returns what that returns.

  Example (in an experiment binary)::

    _INIT_DISTRIBUTED = parallel.flags.define_distributed_flags()

    def main(argv):
      _INIT_DISTRIBUTED()
      ...
  """
  from absl import flags

  fv = flag_values if flag_values is not None else flags.FLAGS
  specs = (
    ("coordinator_address", flags.DEFINE_string, "host:port of process 0"),
    ("num_processes", flags.DEFINE_integer, "number of processes (hosts)"),
    ("process_id", flags.DEFINE_integer, "this process' index"),
    ("cpu_collectives", flags.DEFINE_string, "gloo, mpi or none"),
  )
  for name, define, help_text in specs:
    if name not in fv:
      define(
        name,
        None,
        f"Multi-host: {help_text} (default: from the environment, see"
        " jaxtopk.parallel.maybe_initialize_distributed).",
        flag_values=fv,
      )

  def init() -> bool:
    return maybe_initialize_distributed(
      fv["coordinator_address"].value,
      fv["num_processes"].value,
      fv["process_id"].value,
      cpu_collectives=fv["cpu_collectives"].value,
    )

  return init


@contextlib.contextmanager
def fail_fast():
  """Ends this process at once if the block raises in a multi-process run.

  A process that raises after ``jax.distributed.initialize`` does not exit:
  jax's atexit shutdown waits (up to its 300 s timeout) for peers that are
  themselves waiting for it in a collective. Inside ``fail_fast()`` such an
  error is printed and the process ends with ``os._exit(1)``, so a
  scheduler (or ``LocalCluster``) sees the failure immediately. On one
  process, or for a clean ``sys.exit(0)``, exceptions pass through.

  Example::

    def main(argv):
      parallel.maybe_initialize_distributed()
      with parallel.fail_fast():
        train(...)
  """
  try:
    yield
  except BaseException as e:
    clean_exit = isinstance(e, SystemExit) and e.code in (0, None)
    if clean_exit or not jax.distributed.is_initialized():
      raise
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def is_main_process() -> bool:
  """True on process 0, the one that writes metrics, figures and reports."""
  return jax.process_index() == 0


def any_process(flag: bool) -> bool:
  """True on every process if ``flag`` is True on any (one all-gather).

  Use it for decisions that change which collectives run next, such as
  "stop after this step" on a signal that reached only some hosts.
  """
  if jax.process_count() == 1:
    return bool(flag)
  from jax.experimental import multihost_utils

  every = multihost_utils.process_allgather(np.asarray(flag, np.int32))
  return bool(np.any(every))


def process_local_slices(
  sharding: jax.sharding.Sharding, global_shape: Sequence[int]
) -> tuple[slice, ...]:
  """The block of a global array held by this process' devices.

  Args:
    sharding: the global array's sharding.
    global_shape: its shape.

  Returns:
    One ``slice`` per dimension (start and stop explicit): what this
    process must load.

  Raises:
    ValueError: when this process' shards do not form one block (then use
      ``jax.make_array_from_callback``, which loads shard by shard).
  """
  global_shape = tuple(int(s) for s in global_shape)
  index_map = sharding.addressable_devices_indices_map(global_shape)
  blocks = set()
  for index in index_map.values():
    pairs = zip(index, global_shape, strict=True)
    blocks.add(tuple(sl.indices(size)[:2] for sl, size in pairs))
  lo = [min(b[d][0] for b in blocks) for d in range(len(global_shape))]
  hi = [max(b[d][1] for b in blocks) for d in range(len(global_shape))]
  volume = sum(int(np.prod([e - s for s, e in b])) for b in blocks)
  if volume != int(np.prod([h - lo_ for lo_, h in zip(lo, hi, strict=True)])):
    raise ValueError(
      f"process {jax.process_index()}'s shards of a {global_shape} array"
      f" under {sharding} are not one block; load shard by shard with"
      " jax.make_array_from_callback"
    )
  return tuple(slice(s, e) for s, e in zip(lo, hi, strict=True))


def make_global_array(
  load: Callable[[tuple[slice, ...]], np.ndarray],
  sharding: jax.sharding.Sharding,
  global_shape: Sequence[int],
) -> jax.Array:
  """A global array from the block this process loads.

  Args:
    load: ``load(slices) -> array`` returns this process' block,
      ``global[slices]`` (``slices`` from ``process_local_slices``). On a
      pod it reads only those rows from storage.
    sharding: the global array's sharding (e.g. a ``NamedSharding``).
    global_shape: the global shape.

  Returns:
    A ``jax.Array`` of ``global_shape`` laid out by ``sharding``.

  Raises:
    ValueError: when ``load`` returns a block of the wrong shape.

  Example:
    >>> import numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = make_mesh({"data": 1})
    >>> x = np.arange(6.0).reshape(3, 2)
    >>> make_global_array(lambda sl: x[sl], NamedSharding(mesh, P("data")),
    ...                   x.shape).shape
    (3, 2)
  """
  slices = process_local_slices(sharding, global_shape)
  block = np.asarray(load(slices))
  want = tuple(s.stop - s.start for s in slices)
  if block.shape != want:
    raise ValueError(
      f"load({slices}) returned shape {block.shape}; process"
      f" {jax.process_index()} must load {want}"
    )
  return jax.make_array_from_process_local_data(
    sharding, block, tuple(global_shape)
  )


def global_batch(
  batch: np.ndarray, mesh: jax.sharding.Mesh, *, batch_axis: str = _mesh.DATA
) -> jax.Array:
  """A host batch as a global array split over ``batch_axis`` along dim 0.

  Every process passes the same ``batch`` (e.g. drawn from the same seeded
  generator) and hands over only its own rows; the other dims are
  replicated. Without the axis in the mesh the batch is replicated.

  Args:
    batch: ``[batch, ...]`` numpy array, identical on every process.
    mesh: the global mesh.
    batch_axis: mesh axis of the batch.

  Returns:
    A global ``jax.Array`` sharded as ``P(batch_axis)``.

  Raises:
    ValueError: when the batch does not divide over the axis.
  """
  batch = np.asarray(batch)
  ax = _mesh.axis_or_none(mesh, batch_axis)
  if ax is not None and batch.shape[0] % mesh.shape[ax]:
    raise ValueError(
      f"batch size {batch.shape[0]} must be divisible by mesh axis {ax!r}"
      f" of size {mesh.shape[ax]}"
    )
  sharding = NamedSharding(mesh, P(ax, *([None] * (batch.ndim - 1))))
  return make_global_array(lambda sl: batch[sl], sharding, batch.shape)


def put_global(tree, shardings):
  """Places values every process holds alike on (multi-process) shardings.

  Every process passes the same values (the same seeded initialisation, a
  host copy of restored weights); each hands over only the blocks its own
  devices hold (``make_global_array``). ``jax.device_put`` does the same
  but first all-gathers every leaf to check it is equal on all processes
  (one collective per leaf, seconds for a small model on gloo); here
  nothing is compared: equal inputs are the caller's promise. For models
  too large for one host, initialise them sharded instead
  (``jax.jit(init, out_shardings=...)``).

  Args:
    tree: a pytree of arrays (numpy or fully addressable jax.Arrays).
    shardings: a matching pytree of ``jax.sharding.Sharding``.

  Returns:
    The pytree of global ``jax.Array``.
  """

  def one(x, sharding):
    host = np.asarray(x)
    return make_global_array(lambda sl: host[sl], sharding, host.shape)

  return jax.tree.map(one, tree, shardings)


def fetch(tree):
  """Every array leaf as numpy, on every process.

  Leaves split across processes are gathered by ONE jitted identity per
  mesh (resharded to replicated: an all-gather), not one program per
  leaf; leaves this process holds whole (fully addressable or fully
  replicated) are copied; other leaves go through ``np.asarray``. Call it
  on every process with the same tree (it is a collective).
  """
  leaves, treedef = jax.tree.flatten(tree)
  split = [
    i
    for i, x in enumerate(leaves)
    if isinstance(x, jax.Array)
    and not (x.is_fully_addressable or x.is_fully_replicated)
  ]
  groups = {}  # mesh -> leaf indices
  for i in split:
    sharding = leaves[i].sharding
    key = sharding.mesh if isinstance(sharding, NamedSharding) else None
    groups.setdefault(key, []).append(i)
  out = list(leaves)
  for mesh, idx in groups.items():
    arrays = [leaves[i] for i in idx]
    if mesh is None:  # not a NamedSharding: jax's per-array all-gather
      from jax.experimental import multihost_utils

      gathered = [
        multihost_utils.process_allgather(x, tiled=True) for x in arrays
      ]
    else:
      replicated = NamedSharding(mesh, P())
      gathered = jax.jit(
        lambda xs: xs, out_shardings=[replicated] * len(arrays)
      )(arrays)
    for i, x in zip(idx, gathered, strict=True):
      out[i] = x
  return jax.tree.unflatten(treedef, [np.asarray(x) for x in out])
