"""Scaling study: collective bytes of one sharded decode step vs n, devices.

For every (policy, mesh, n) it compiles ``parallel.make_sharded_attention``
for a decode step (q_len = 1) with the keys split over the mesh's ``kv`` axis,
reads the collectives from the compiled HLO (``parallel.communication_summary``)
and XLA's memory analysis, and, up to ``execute_max_n``, also runs the step
and checks it against the 1-device result. Compiling needs no memory for the
arrays (``jax.ShapeDtypeStruct`` inputs), so n = 1M is cheap on a laptop.

Writes into --workdir (experiments/README.md): config.json, metrics.jsonl
(one object per compile), results.json (the machine, the load and all rows;
runs before the common convention wrote the rows as scaling.json) and
scaling.png. A workdir that holds a run is refused (``--overwrite``).

  python -m experiments.bench_scaling \
    --config=experiments/configs/bench_scaling.py --workdir=/tmp/scaling
  # a single mesh, from the flag:
  python -m experiments.bench_scaling --config=...:smoke --workdir=... \
    --mesh=data=2,kv=4
"""

import os
import time

from absl import app
from absl import flags
from absl import logging

from experiments import _common

NAME = "bench_scaling"


def _policy(expr):
  import jaxtopk

  ns = {
    name: getattr(jaxtopk, name)
    for name in ("Dense", "FixedK", "Ratio", "PowerLaw", "Certified")
  }
  return eval(expr, {"__builtins__": {}}, ns)  # noqa: S307 (trusted config)


def _study_one(cfg, policy_name, policy, mesh_spec, n, reference):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding

  from jaxtopk import parallel

  axes = parallel.parse_mesh_flag(mesh_spec)
  sizes = [s for s in axes.values() if s != -1]
  n_dev = len(jax.devices()) if -1 in axes.values() else int(np.prod(sizes))
  mesh = parallel.make_mesh(axes, devices=jax.devices()[:n_dev])
  dtype = jnp.dtype(cfg.dtype)
  b, h, d, t = cfg.batch, cfg.heads, cfg.head_dim, cfg.q_len
  q_spec, kv_spec = parallel.attention_specs(mesh)
  args = (
    jax.ShapeDtypeStruct(
      (b, t, h, d), dtype, sharding=NamedSharding(mesh, q_spec)
    ),
    jax.ShapeDtypeStruct(
      (b, n, h, d), dtype, sharding=NamedSharding(mesh, kv_spec)
    ),
    jax.ShapeDtypeStruct(
      (b, n, h, d), dtype, sharding=NamedSharding(mesh, kv_spec)
    ),
  )
  fn = parallel.make_sharded_attention(
    mesh, policy=policy, kv_len=n, head_dim=d
  )
  t0 = time.perf_counter()
  compiled = fn.lower(*args, None).compile()
  compile_s = time.perf_counter() - t0
  comm = parallel.communication_summary(compiled.as_text())
  mem = compiled.memory_analysis()
  kv = parallel.axis_or_none(mesh, parallel.KV)
  row = {
    "policy": policy_name,
    "mesh": mesh_spec,
    "devices": int(n_dev),
    "kv_shards": 1 if kv is None else int(mesh.shape[kv]),
    "n": int(n),
    "batch": b,
    "heads": h,
    "head_dim": d,
    "q_len": t,
    "dtype": cfg.dtype,
    "rows": b * h * t,
    "collectives": comm["count"],
    "result_bytes": comm["result_bytes"],
    "sent_bytes_per_device": comm["sent_bytes"],
    "sent_bytes_per_row": comm["sent_bytes"] * n_dev / (b * h * t),
    "by_kind": comm["by_kind"],
    "kv_bytes_per_device": 2 * b * n * h * d * dtype.itemsize // n_dev,
    "compile_s": round(compile_s, 3),
  }
  if mem is not None:
    row["temp_bytes_per_device"] = int(mem.temp_size_in_bytes)
    row["argument_bytes_per_device"] = int(mem.argument_size_in_bytes)
  if n <= cfg.execute_max_n:
    # Inputs generated directly into their shardings (works multi-host).
    def gen(seed, shape, spec, mul=1.0):
      f = lambda: jax.random.normal(jax.random.key(seed), shape, dtype) * mul  # noqa: E731
      return jax.jit(f, out_shardings=NamedSharding(mesh, spec))()

    q = gen(0, (b, t, h, d), q_spec, 2.0)
    k = gen(1, (b, n, h, d), kv_spec)
    v = gen(2, (b, n, h, d), kv_spec)
    t0 = time.perf_counter()
    out, cert = compiled(q, k, v, None)
    jax.block_until_ready(out)
    row["first_run_s"] = round(time.perf_counter() - t0, 4)
    row["k_kept_mean"] = float(jnp.mean(cert.k_kept))
    row["tv_bound_max"] = float(jnp.nanmax(cert.tv_bound))
    if jax.process_count() == 1:
      key = (policy_name, n)
      if key not in reference:
        ref_mesh = parallel.make_mesh({"kv": 1}, devices=jax.devices()[:1])
        reference[key] = jax.device_get(
          parallel.sharded_topk_attention(
            jax.device_get(q),
            jax.device_get(k),
            jax.device_get(v),
            policy=policy,
            mesh=ref_mesh,
          )
        )
      ref_out, ref_cert = reference[key]
      out, cert = jax.device_get((out, cert))
      row["max_abs_diff_vs_1_device"] = float(
        np.max(np.abs(out.astype(np.float32) - ref_out.astype(np.float32)))
      )
      row["k_kept_equal_1_device"] = bool(
        np.array_equal(cert.k_kept, ref_cert.k_kept)
      )
  return row


def _plot(rows, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  policies = sorted({r["policy"] for r in rows})
  fig, axes = plt.subplots(
    1, len(policies), figsize=(4.5 * len(policies), 3.6), squeeze=False
  )
  for ax, pol in zip(axes[0], policies, strict=True):
    for mesh in sorted({r["mesh"] for r in rows if r["policy"] == pol}):
      sel = sorted(
        (r for r in rows if r["policy"] == pol and r["mesh"] == mesh),
        key=lambda r: r["n"],
      )
      if not any(r["sent_bytes_per_row"] for r in sel):
        continue  # one kv shard: no collectives, nothing to draw on a log axis
      ax.plot(
        [r["n"] for r in sel],
        [r["sent_bytes_per_row"] for r in sel],
        marker="o",
        label=mesh,
      )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("keys n")
    ax.set_title(pol)
    ax.grid(True, alpha=0.3)
  axes[0][0].set_ylabel("bytes sent per query row\n(all devices, ring est.)")
  axes[0][-1].legend(fontsize=7)
  fig.suptitle(
    "Sharded decode step: collective bytes from the compiled HLO"
    " (meshes with one kv shard move none)"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(config, workdir, *, overwrite: bool = False, mesh: str = "") -> list:
  """Compiles (and runs) every (policy, mesh, n); writes the workdir.

  Args:
    config: experiments/configs/bench_scaling.py.
    workdir: the run directory (process 0 writes it).
    overwrite: replace an earlier run's outputs instead of refusing.
    mesh: one mesh spec to study instead of ``config.meshes``.

  Returns:
    The rows (one per compile).
  """
  cfg = config
  import jax

  from jaxtopk import parallel

  parallel.maybe_initialize_distributed()
  if cfg.simulated_devices:
    # Only affects the CPU backend; must run before the backend starts.
    jax.config.update("jax_num_cpu_devices", int(cfg.simulated_devices))
  writer = jax.process_index() == 0  # multi-host: one process writes
  wd = None
  if writer:
    wd = _common.Workdir(workdir, cfg, overwrite=overwrite)
  meshes = [mesh] if mesh else list(cfg.meshes)
  logging.info("devices: %s", jax.devices())
  rows, reference = [], {}
  total = len(cfg.policies) * len(meshes) * len(cfg.n_values)
  for pol_name, expr in cfg.policies.items():
    policy = _policy(expr)
    for mesh_spec in meshes:
      for n in cfg.n_values:
        row = _study_one(cfg, pol_name, policy, mesh_spec, n, reference)
        row["device_kind"] = jax.devices()[0].device_kind
        rows.append(row)
        if wd is not None:
          wd.metrics.write("scaling", **row)
        print(
          f"[{len(rows)}/{total}] {pol_name} {mesh_spec} n={n}:"
          f" {row['collectives']} collectives,"
          f" {row['sent_bytes_per_row']:.0f} B/row sent",
          flush=True,
        )
  if wd is not None:
    wd.write_json("results.json", dict(meta=_common.machine_info(), rows=rows))
    _plot(rows, wd.path / "scaling.png")
  return rows


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", ""))
  _CONFIG, _WORKDIR, _OVERWRITE = _common.define_flags(NAME)
  _MESH = flags.DEFINE_string(
    "mesh",
    "",
    "One mesh to study instead of config.meshes, e.g. 'data=2,kv=4'.",
  )

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    run(
      _CONFIG.value,
      _WORKDIR.value,
      overwrite=_OVERWRITE.value,
      mesh=_MESH.value,
    )

  app.run(main)
