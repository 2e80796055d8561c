"""One process of a multi-process jaxtopk run.

Started N times by ``jaxtopk.parallel.launch.LocalCluster`` (see
``multiprocess_test.py``), or once for the single-process reference. Each
process calls the library's multi-host start-up
(``parallel.maybe_initialize_distributed``, configured by the cluster's
environment variables), builds global arrays from the block of data it
loads itself (``parallel.make_global_array``), and runs:

- ``--prefill``: sharded certified prefill (``sharded_topk_attention``) on
  several meshes and policies (``--cases`` picks some of them by name);
- ``--decode``: sharded decode over a KV cache split along its positions
  across processes (``sharded_decode_attention``), after appending to the
  sharded cache;
- ``--train_workdir``: the native Top-k experiment's training
  (``experiments.native_topk.train_phase``: a dense base step, then the
  Top-k fine-tune, data parallel with heads sharded, orbax checkpoints every
  step) until ``--train_stop_at`` (resuming from the workdir's checkpoints,
  whatever process count wrote them).

After each stage every process writes ``<out>/process_<i>_<stage>.npz``
(its results, fetched to numpy on every process) and ``.json`` (its view
of the cluster, timings, collectives); the test compares them across
processes and with the single-process run. With ``--repeats`` each
program is also timed and its collectives read from the compiled HLO
(``benchmark.py``).

  python -m tests.parallel.multiprocess.worker --out=/tmp/w --prefill
"""

import dataclasses
import json
import pathlib
import time

import numpy as np
from absl import app
from absl import flags

# Problem sizes: every dimension a different size. N and MAX_LEN divide by
# the 8 kv shards.
B, T, H, D, E, N = 3, 6, 4, 5, 7, 56  # prefill (GQA case: 2 kv heads)
DB, DHK, DG, DD, MAX_LEN, FILLED = 2, 4, 3, 5, 96, 59  # decode (+2 appended)
TRAIN_MESH = {"data": 4, "heads": 2}
TRAIN_STEPS = 4  # Top-k fine-tune steps (after 1 dense base step)
CHECKPOINT_EVERY = 2


def prefill_cases():
  """(name, mesh axes, policy, kv_heads, masked, causal) of the prefill."""
  import jaxtopk

  return (
    ("prefill_kv8_fixedk", {"kv": 8}, jaxtopk.FixedK(5), H, True, False),
    (  # GQA: 2 kv heads for the 4 query heads, one per `heads` shard
      "prefill_heads2_kv4_certified_gqa",
      {"heads": 2, "kv": 4},
      jaxtopk.Certified(0.05),
      2,
      False,
      True,
    ),
  )


def decode_cases():
  """(name, mesh axes, policy) of the decode step."""
  import jaxtopk

  return (
    ("decode_kv8_certified", {"kv": 8}, jaxtopk.Certified(0.05)),
    ("decode_data2_kv4_fixedk", {"data": 2, "kv": 4}, jaxtopk.FixedK(6)),
  )


def wanted(name, cases):
  """Whether case ``name`` runs: ``cases`` lists names, empty: every case."""
  return not cases or name in cases


def prefill_inputs(seed, kv_heads):
  """Host data of one prefill case, ``[batch, seq, heads, dim]`` numpy."""
  rng = np.random.default_rng(seed)
  q = (rng.standard_normal((B, T, H, D)) * 2).astype(np.float32)
  k = rng.standard_normal((B, N, kv_heads, D)).astype(np.float32)
  v = rng.standard_normal((B, N, kv_heads, E)).astype(np.float32)
  mask = rng.random((B, 1, 1, N)) > 0.2  # key padding
  return q, k, v, mask


def decode_inputs(seed):
  """(keys, values, query, new keys, new values) of one decode case.

  keys/values ``[batch, FILLED, kv_heads, dim]`` fill the cache before it
  is sharded; the two new positions are appended to the sharded cache.
  """
  rng = np.random.default_rng(seed)
  f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
  k, v = f32(DB, FILLED, DHK, DD), f32(DB, FILLED, DHK, DD)
  q = f32(DB, 1, DHK * DG, DD) * 3
  k_new, v_new = f32(DB, 2, DHK, DD), f32(DB, 2, DHK, DD)
  return k, v, q, k_new, v_new


def train_config():
  """The native Top-k smoke config, shrunk for several processes."""
  from experiments.configs import native_topk as native_topk_config

  config = native_topk_config.get_config("smoke")
  with config.unlocked():
    config.seq_len = 32
    config.vocab.num_keys = 16
    config.train.batch_size = 16  # divides the 4-way data axis
    config.train.base_steps = 1
    config.train.finetune_steps = TRAIN_STEPS
    config.train.checkpoint_every = CHECKPOINT_EVERY
    config.train.log_every = 1
    config.train.curriculum = ((0, 32),)
  return config


def _global(mesh, spec, x):
  """A global array from the block of ``x`` this process loads."""
  from jax.sharding import NamedSharding

  from jaxtopk import parallel

  return parallel.make_global_array(
    lambda sl: x[sl], NamedSharding(mesh, spec), x.shape
  )


def _time(fn, repeats):
  import jax

  jax.block_until_ready(fn())  # compile
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return dict(min_ms=1e3 * min(times), median_ms=1e3 * float(np.median(times)))


def run_prefill(results, bench, repeats, cases=()):
  import jax

  from jaxtopk import parallel

  for seed, (name, axes, policy, kv_heads, masked, causal) in enumerate(
    prefill_cases()
  ):
    if not wanted(name, cases):
      continue
    mesh = parallel.make_mesh(axes)
    q_spec, kv_spec = parallel.attention_specs(mesh)
    q, k, v, mask = prefill_inputs(seed, kv_heads)
    args = (
      _global(mesh, q_spec, q),
      _global(mesh, kv_spec, k),
      _global(mesh, kv_spec, v),
    )
    fn = parallel.make_sharded_attention(
      mesh,
      policy=policy,
      kv_len=N,
      head_dim=D,
      mask_shape=mask.shape if masked else None,
      batch_heads_qlen=(B, H, T),
      is_causal=causal,
    )
    # The mask is replicated: every process passes the whole [b,1,1,n] one.
    mask_arg = (
      _global(mesh, jax.sharding.PartitionSpec(), mask) if masked else None
    )
    out, cert = fn(*args, mask_arg)
    results[f"{name}/out"] = out
    for field in ("tv_bound", "k_kept", "keys_scored"):
      results[f"{name}/{field}"] = getattr(cert, field)
    results[f"{name}/output_error_bound"] = cert.output_error_bound
    results[f"{name}/valid"] = cert.valid
    if repeats:
      hlo = fn.lower(*args, mask_arg).compile().as_text()
      bench[name] = dict(
        comm=parallel.communication_summary(hlo),
        **_time(lambda: fn(*args, mask_arg), repeats),  # noqa: B023
      )


def run_decode(results, bench, repeats, cases=()):
  import jax

  import jaxtopk
  from jaxtopk import parallel

  for seed, (name, axes, policy) in enumerate(decode_cases()):
    if not wanted(name, cases):
      continue
    mesh = parallel.make_mesh(axes)
    k, v, q, k_new, v_new = decode_inputs(seed)
    cache = jaxtopk.KVCache.create(DB, MAX_LEN, DHK, DD, block_size=16)
    cache = jax.device_get(cache.append(k, v))
    shardings = parallel.cache_shardings(mesh, cache)
    # Each process loads only its positions (and batch rows) of the cache.
    cache_s = jax.tree.map(
      lambda x, s: parallel.make_global_array(
        lambda sl: np.asarray(x)[sl],  # noqa: B023
        s,
        np.shape(x),
      ),
      cache,
      shardings,
    )
    append = jax.jit(lambda c, k, v: c.append(k, v), out_shardings=shardings)
    cache_s = append(cache_s, k_new, v_new)  # a decode step's append
    q_arg = _global(mesh, jax.sharding.PartitionSpec(), q)

    def step(q_arg=q_arg, cache_s=cache_s, mesh=mesh, policy=policy):
      return parallel.sharded_decode_attention(
        q_arg, cache_s, policy=policy, mesh=mesh
      )

    out, cert = step()
    results[f"{name}/out"] = out
    results[f"{name}/length"] = cache_s.length
    for field in (
      "tv_bound",
      "k_kept",
      "keys_scored",
      "output_error_bound",
      "valid",
    ):
      results[f"{name}/{field}"] = getattr(cert, field)
    if repeats:
      lowered = jax.jit(
        lambda q_, c_, mesh=mesh, policy=policy: (
          parallel.sharded_decode_attention(q_, c_, policy=policy, mesh=mesh)
        )
      ).lower(q_arg, cache_s)
      bench[name] = dict(
        comm=parallel.communication_summary(lowered.compile().as_text()),
        **_time(step, repeats),
      )


def run_decode_large(results, bench, repeats):
  """A larger decode step (timed only): 2 x 8 heads x 32,768 positions."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxtopk
  from jaxtopk import parallel

  del results
  b, hk, n, d = 2, 8, 32768, 64
  mesh = parallel.make_mesh({"kv": 8})
  policy = jaxtopk.Certified(0.01)
  rng = np.random.default_rng(7)
  cache = jaxtopk.KVCache.create(b, n, hk, d, block_size=64)
  shardings = parallel.cache_shardings(mesh, cache)

  def load(shape, scale=1.0):  # each process draws only its own block
    sharding = NamedSharding(mesh, P(None, None, "kv", None))
    return parallel.make_global_array(
      lambda sl: (
        np.random.default_rng([7, sl[2].start])
        .standard_normal([x.stop - x.start for x in sl])
        .astype(np.float32)
        * scale
      ),
      sharding,
      shape,
    )

  small = dict(
    length=np.full((b,), n, np.int32),
    kmin=cache.kmin,
    kmax=cache.kmax,
    vnorm=cache.vnorm,
  )  # block summaries stay empty: the sharded decode does not read them
  small = parallel.put_global(small, {k: getattr(shardings, k) for k in small})
  cache = dataclasses.replace(
    cache, keys=load((b, hk, n, d)), values=load((b, hk, n, d)), **small
  )
  q = rng.standard_normal((b, 1, hk, d)).astype(np.float32) * 4
  q = parallel.make_global_array(
    lambda sl: q[sl], NamedSharding(mesh, P()), q.shape
  )
  fn = jax.jit(
    lambda q_, c_: parallel.sharded_decode_attention(
      q_, c_, policy=policy, mesh=mesh
    )
  )
  hlo = fn.lower(q, cache).compile().as_text()
  bench["decode_large_kv8_certified"] = dict(
    comm=parallel.communication_summary(hlo),
    keys=n,
    **_time(lambda: fn(q, cache), repeats),
  )


def run_train(results, bench, workdir, stop_at, repeats):
  import jax
  from flax import nnx

  import jaxtopk
  from experiments import native_topk
  from jaxtopk import parallel

  config = train_config()
  mesh = parallel.make_mesh(TRAIN_MESH)
  pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
  native_topk._check_workdir(config, workdir)
  metrics = native_topk.Metrics(str(pathlib.Path(workdir, "metrics.jsonl")))
  manager = native_topk._manager(workdir, "topk")
  start = manager.latest_step() or 0
  manager.close()
  calls = [start]

  def stop_topk():  # called once after every finished step
    calls[0] += 1
    return stop_at is not None and calls[0] >= stop_at

  model = None
  for phase in ("base", "topk"):
    stop = stop_topk if phase == "topk" else (lambda: False)
    model, finished = native_topk.train_phase(
      config, workdir, phase, metrics, stop, mesh
    )
    if not finished:
      break
  state = parallel.fetch(nnx.state(model, nnx.Param))
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    results["train_param" + jax.tree_util.keystr(path)] = leaf
  results["train_start_step"] = np.asarray(start)
  if repeats:  # one more Top-k step, timed, on the trained weights
    optimizer = native_topk._optimizer(model, config, "topk")
    native_topk._shard(optimizer, mesh)
    batch = [
      parallel.global_batch(a, mesh)
      for a in native_topk.train_batch(config, "topk", 0)
    ]
    selector = jaxtopk.Ratio(config.train.train_rho)
    lowered = native_topk._train_step.lower(model, optimizer, *batch, selector)
    bench["train_step_topk"] = dict(
      comm=parallel.communication_summary(lowered.compile().as_text()),
      **_time(
        lambda: native_topk._train_step(model, optimizer, *batch, selector),
        repeats,
      ),
    )


def _define_flags():
  flags.DEFINE_string("out", None, "Output directory.", required=True)
  flags.DEFINE_bool("prefill", False, "Run the sharded prefill cases.")
  flags.DEFINE_bool("decode", False, "Run the sharded decode cases.")
  flags.DEFINE_list(
    "cases", [], "Prefill and decode cases to run, by name (default: all)."
  )
  flags.DEFINE_string("train_workdir", None, "Run native Top-k training.")
  flags.DEFINE_integer(
    "train_stop_at", None, "Stop the Top-k fine-tune after this step."
  )
  flags.DEFINE_integer("repeats", 0, "Time each program this many times.")
  flags.DEFINE_bool("decode_large", False, "Time a 32,768-position decode.")
  flags.DEFINE_integer(
    "crash_process", None, "This process raises before its first stage."
  )


def _write(out, stage, results, info):
  """Writes one stage's results: npz on every process, plus a json."""
  import jax

  from jaxtopk import parallel

  results = parallel.fetch(results)  # numpy on every process
  pid = jax.process_index()
  np.savez(out / f"process_{pid}_{stage}.npz", **results)
  (out / f"process_{pid}_{stage}.json").write_text(json.dumps(info, indent=1))
  print(f"worker {pid}: wrote {stage}", flush=True)


def main(argv):
  from jaxtopk import parallel

  initialized = parallel.maybe_initialize_distributed()  # the library's
  with parallel.fail_fast():  # an error ends this process at once
    _main(argv, initialized)


def _main(argv, initialized):
  del argv
  tick = time.time()
  import jax

  FLAGS = flags.FLAGS
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  info = dict(
    initialized=initialized,
    process_index=jax.process_index(),
    process_count=jax.process_count(),
    device_count=jax.device_count(),
    local_device_count=jax.local_device_count(),
    cpu_collectives=jax.config.jax_cpu_collectives_implementation,
  )
  print(f"worker {info}", flush=True)
  if FLAGS.crash_process == jax.process_index():
    raise RuntimeError(f"injected failure in process {jax.process_index()}")
  stages = (
    (
      "prefill",
      FLAGS.prefill,
      lambda r, b: run_prefill(r, b, FLAGS.repeats, FLAGS.cases),
    ),
    (
      "decode",
      FLAGS.decode,
      lambda r, b: run_decode(r, b, FLAGS.repeats, FLAGS.cases),
    ),
    (
      "decode_large",
      FLAGS.decode_large,
      lambda r, b: run_decode_large(r, b, max(FLAGS.repeats, 1)),
    ),
    (
      "train",
      bool(FLAGS.train_workdir),
      lambda r, b: run_train(
        r, b, FLAGS.train_workdir, FLAGS.train_stop_at, FLAGS.repeats
      ),
    ),
  )
  for stage, wanted, fn in stages:
    if not wanted:
      continue
    t0 = time.time()
    results, bench = {}, {}
    fn(results, bench)
    _write(
      out, stage, results, dict(info, bench=bench, wall_s=time.time() - t0)
    )
  print(
    f"worker {jax.process_index()} done in {time.time() - tick:.1f} s",
    flush=True,
  )


if __name__ == "__main__":
  _define_flags()
  app.run(main)
