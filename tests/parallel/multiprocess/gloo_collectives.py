"""Which collectives work over gloo CPU collectives, per dtype.

A diagnostic, not a test: it starts itself as 2 processes x 2 CPU devices
(``jaxtopk.parallel.launch.launch_local``), runs each collective under
``shard_map`` over the 4-device mesh, compares with numpy, and prints one
line per (collective, dtype): OK, WRONG (with the values) or FAIL (with the
error). Measured with jax 0.10.2: every line OK except ``psum_scatter`` of
bool, which jax rejects while tracing on any backend (``add`` does not
accept bool), not a gloo limitation.

  python -m tests.parallel.multiprocess.gloo_collectives
"""

import pathlib
import sys

import numpy as np

_ROOT = pathlib.Path(__file__).resolve().parents[3]
_DEVICES = 4  # 2 processes x 2


def _expected(name, x):
  """numpy result of a collective over the 4 row blocks of ``x`` [4, 8]."""
  blocks = np.split(x, _DEVICES)
  if name == "psum":
    return np.sum(blocks, axis=0, dtype=x.dtype)
  if name == "pmax":
    return np.max(blocks, axis=0)
  if name == "pmin":
    return np.min(blocks, axis=0)
  if name == "all_gather":
    return x
  if name == "psum_scatter":  # sum of the gathered x over devices, split
    return (x * _DEVICES).astype(x.dtype)
  if name == "all_to_all":  # device j: column chunk j of every block, in order
    cols = x.shape[1] // _DEVICES
    return np.concatenate(
      [
        np.concatenate([b[:, j * cols : (j + 1) * cols] for b in blocks], 1)
        for j in range(_DEVICES)
      ]
    )
  if name == "ppermute":  # device i sends to i + 1
    return np.concatenate(blocks[-1:] + blocks[:-1])
  raise ValueError(name)


def child():
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxtopk import parallel

  parallel.maybe_initialize_distributed()
  mesh = parallel.make_mesh({"x": _DEVICES})
  ops = {
    "psum": (lambda a: lax.psum(a, "x"), P()),
    "pmax": (lambda a: lax.pmax(a, "x"), P()),
    "pmin": (lambda a: lax.pmin(a, "x"), P()),
    "all_gather": (lambda a: lax.all_gather(a, "x", tiled=True), P()),
    "psum_scatter": (
      lambda a: lax.psum_scatter(
        lax.all_gather(a, "x", tiled=True), "x", tiled=True
      ),
      P("x"),
    ),
    "all_to_all": (lambda a: lax.all_to_all(a, "x", 1, 1, tiled=True), P("x")),
    "ppermute": (
      lambda a: lax.ppermute(
        a, "x", [(i, (i + 1) % _DEVICES) for i in range(_DEVICES)]
      ),
      P("x"),
    ),
  }
  dtypes = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.bool_)
  for dtype in dtypes:
    x = (np.arange(_DEVICES * 8 * _DEVICES) % 7).reshape(_DEVICES * _DEVICES, 8)
    x = np.asarray(x, dtype=np.dtype(dtype))
    arr = parallel.make_global_array(
      lambda sl, x=x: x[sl], NamedSharding(mesh, P("x")), x.shape
    )
    for name, (fn, out) in ops.items():
      label = f"{name:13s} {np.dtype(dtype).name:9s}"
      try:
        f = parallel.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=out)
        got = parallel.fetch(jax.jit(f)(arr))
      except Exception as e:  # noqa: BLE001 (a diagnostic: report it)
        print(f"FAIL  {label} {type(e).__name__}: {str(e)[:160]}")
        continue
      want = _expected(name, x.astype(np.float64)).astype(x.dtype)
      if x.dtype == np.bool_ and name == "psum":
        want = np.sum(np.split(x, _DEVICES), axis=0)  # jax counts Trues
      ok = np.array_equal(np.asarray(got, want.dtype), want)
      print(f"{'OK   ' if ok else 'WRONG'} {label}" + ("" if ok else f" {got}"))
  sys.stdout.flush()


def main():
  from jaxtopk import parallel

  results = parallel.launch.launch_local(
    [sys.executable, "-m", "tests.parallel.multiprocess.gloo_collectives"]
    + ["--child"],
    num_processes=2,
    devices_per_process=2,
    timeout_s=600,
    cwd=_ROOT,
  )
  lines = results[0].output.splitlines()
  print("\n".join(x for x in lines if x[:5] in ("OK   ", "WRONG", "FAIL ")))


if __name__ == "__main__":
  if "--child" in sys.argv:
    child()
  else:
    main()
