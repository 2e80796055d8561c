"""Test-wide settings: a bounded hypothesis profile; CPU jax without a GPU.

On a machine with no accelerator, jax is pinned to the CPU (no probing for
a TPU). Where a GPU or TPU is present, jax picks it (or whatever
JAX_PLATFORMS says), so the compiled-kernel test classes run instead of
skipping.
"""

import glob
import importlib.metadata
import os


def _has_accelerator() -> bool:
  return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/accel[0-9]*"))


if not _has_accelerator():
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Most of the suite's time is XLA compiling small programs that then run once
# on tiny inputs. With JAX_DISABLE_MOST_OPTIMIZATIONS=1 (the default here;
# jax's own switch) tests compile at XLA's backend level 0 and with XLA:CPU's
# classic fusion emitters (`--xla_cpu_use_fusion_emitters=false`), which
# compile the certified paths' programs ~2.5x faster than the newer ones
# (4.4 s against 1.7 s for a causal Certified prefill and its gradient at
# T = 1,024). Together they cut the suite's wall time by half. Code
# generation only: the same IEEE arithmetic (no fast-math either way), and
# every bound covers any summation order of a product. One contract variant
# compiles at jax's default level, where level 0 miscompiles
# (tests/contract/variants.py). Set JAX_DISABLE_MOST_OPTIMIZATIONS=0 to test
# the programs users run (jax's defaults; do, before a release and when
# soaking); benchmarks and experiments always run at jax's defaults. Set in
# the environment, so the subprocesses some tests start inherit it. The
# emitter flag is set on CPU-only machines with jaxlib < 0.11 only: jaxlib
# 0.11.2 with its CUDA plugin aborts on it as an unknown flag.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
_FAST_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
_flags = os.environ.get("XLA_FLAGS", "")
_jaxlib = tuple(
  int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2]
)
if (
  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] not in ("0", "false", "False")
  and "--xla_cpu_use_fusion_emitters" not in _flags
  and _jaxlib < (0, 11)
  and not _has_accelerator()
):
  os.environ["XLA_FLAGS"] = f"{_flags} {_FAST_EMITTERS}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests: bounded example counts (sized for CI's 20 minutes on 2
# cores; the soak profile below draws 500 fresh ones), no deadline (jit
# compiles on first call), derandomized so CI runs are reproducible.
# differing_executors: a compiled-kernel class (tests/kernels, INTERPRET =
# False) inherits its interpret-mode class's properties, and on a GPU both
# run in one process: the same property on two kernels, as intended.
_SUPPRESSED = [HealthCheck.too_slow, HealthCheck.differing_executors]
settings.register_profile(
  "ci",
  max_examples=30,
  deadline=None,
  derandomize=True,
  suppress_health_check=_SUPPRESSED,
)
# Bug hunting (not CI): HYPOTHESIS_PROFILE=soak draws fresh random examples,
# many more of them, e.g. on the soundness tests (`-k sound`).
settings.register_profile(
  "soak",
  max_examples=500,
  deadline=None,
  derandomize=False,
  database=None,
  suppress_health_check=_SUPPRESSED,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Each compiled XLA:CPU executable holds a few memory mappings; a pytest
# worker compiles thousands of programs, and past vm.max_map_count (65,530 by
# default on Linux) LLVM's next mapping fails and the worker dies with a
# segfault inside the compiler (seen in CI with the contract test: ~24,000
# mappings after 7 minutes in one worker). Dropping jax's caches frees them (at
# 40,000: clearing earlier recompiles programs the next tests share).
_MAPS = "/proc/self/maps"
_MAX_MAPS = 40_000


def _num_maps() -> int:
  try:
    with open(_MAPS, "rb") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux
    return 0


@pytest.fixture(autouse=True)
def _bounded_compile_caches():
  """After a test, clears jax's caches when the process maps too much."""
  yield
  if _num_maps() > _MAX_MAPS:
    jax.clear_caches()


# Scheduling under `pytest -n` (`--dist loadfile`: a file's tests share one
# worker and its compiled programs). The tests that start processes with
# several CPU devices or gloo collectives form one work unit, run one after
# another on one worker, and go first (xdist's own order, files with the most
# tests first, put them last, where two of them ran side by side): two such
# tests at once oversubscribe 2 cores and spin waiting for their peers
# (measured: the pod runs and the 8-device modules together took 111 s wall
# and 201 s of CPU, one after the other 90 s and 127 s). The other files keep
# xdist's order.
_PROCESS_TESTS = (
  "tests/parallel/multiprocess/",
  "tests/parallel/multidevice_test.py",
  "tests/parallel/bench_scaling_test.py",
  "tests/parallel/local_cluster_test.py",
)
_PROCESS_SCOPE = "tests/parallel (processes)"


def _scope(nodeid: str) -> str:
  path = nodeid.split("::", 1)[0]
  return _PROCESS_SCOPE if path.startswith(_PROCESS_TESTS) else path


def pytest_collection_modifyitems(config, items):
  """Orders the work units (xdist keeps this order: no loadscope reorder):
  the process tests, then files by number of tests (xdist's own rule)."""
  del config
  count: dict[str, int] = {}
  for item in items:
    scope = _scope(item.nodeid)
    count[scope] = count.get(scope, 0) + 1

  def rank(scope):
    return (scope != _PROCESS_SCOPE, -count[scope])

  order = {s: i for i, s in enumerate(sorted(count, key=rank))}
  items.sort(key=lambda item: order[_scope(item.nodeid)])  # stable


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """`--dist loadfile`, with the process tests' files as one work unit."""
  if config.getvalue("dist") != "loadfile":
    return None
  from xdist.scheduler import LoadScopeScheduling

  class _Scheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid):
      return _scope(nodeid)

  return _Scheduling(config, log)
