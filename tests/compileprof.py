"""pytest plugin: where each test's time goes (tracing, lowering, compiling).

Not a test module (pytest collects ``*_test.py``). Run the suite with it::

  PROF_OUT=prof.jsonl python -m pytest -p tests.compileprof -n 2 -p no:logging

One JSON line per test: wall seconds, jax.monitoring's trace, lowering and
XLA compile durations and counts, persistent-cache events, and the 15
jitted functions that took longest to compile (from ``jax_log_compiles``).
"""

import collections
import json
import logging
import os
import re
import time

import jax
import pytest

_acc: collections.Counter = collections.Counter()
_cnt: collections.Counter = collections.Counter()
_fn: collections.Counter = collections.Counter()
_fnn: collections.Counter = collections.Counter()
_ev: collections.Counter = collections.Counter()
_RE = re.compile(r"Finished XLA compilation of (.*) in ([0-9.e-]+) sec")


def _duration(event, duration_secs, **kwargs):
  del kwargs
  _acc[event] += duration_secs
  _cnt[event] += 1


def _event(event, **kwargs):
  del kwargs
  if "compilation_cache" in event:
    _ev[event.rsplit("/", 1)[-1]] += 1


class _Compiles(logging.Handler):
  def emit(self, record):
    m = _RE.search(record.getMessage())
    if m:
      _fn[m.group(1)] += float(m.group(2))
      _fnn[m.group(1)] += 1


def pytest_configure(config):
  del config
  jax.monitoring.register_event_duration_secs_listener(_duration)
  jax.monitoring.register_event_listener(_event)
  jax.config.update("jax_log_compiles", True)
  logging.getLogger("jax").addHandler(_Compiles(logging.DEBUG))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  for c in (_acc, _cnt, _fn, _fnn, _ev):
    c.clear()
  t = time.perf_counter()
  yield
  row = {"test": item.nodeid, "wall": round(time.perf_counter() - t, 2)}
  for k, v in _acc.items():
    short = k.rsplit("/", 1)[-1]
    row[short] = round(v, 2)
    row["n_" + short] = _cnt[k]
  row["cache"] = dict(_ev)
  row["fns"] = {k: [round(v, 2), _fnn[k]] for k, v in _fn.most_common(15)}
  with open(os.environ.get("PROF_OUT", "compileprof.jsonl"), "a") as f:
    f.write(json.dumps(row) + "\n")
