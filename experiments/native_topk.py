r"""Native Top-k: train and decode small models with Top-k attention.

THEORY 8 ([NATIVE]). Trains a dense base decoder on seeded retrieval tasks
(jaxtopk.tasks: associative recall, multi-key lookup and needle, which one
kept key per head solves, and aggregate recall, whose answer sums the values
of several occurrences of a key and so needs several kept keys), fine-tunes
it twice with the same budget (dense, and with exact Top-k attention at
``train_rho`` in the forward pass), then decodes both fine-tunes (dense
prefill, selector at the answer positions) and writes:

- ratio sweep: accuracy vs exact Top-k ratio rho (THEORY 8.1, the paper's
  Figure 1 analogue);
- fidelity sweep: accuracy vs precision p of a mixed exact/random Top-k, and
  vs recall target of approx_max_k (XLA call and TPU-algorithm emulation)
  (THEORY 8.3);
- entropy: mean attention entropy per layer and head (THEORY 8.4);
- certificates: accuracy, kept fraction and sound TV bound of the certified
  top-p selector at each eps (THEORY 6.1).

Outputs in --workdir: config.json, metrics.jsonl (one JSON object per line,
``kind`` = train | eval | entropy | check), results.md (tables), fig_*.png,
ckpt/<phase>/ (orbax). Rerunning the same command resumes: each training
phase restores its last checkpoint (batches are a pure function of (seed,
phase, step), so a resumed run equals an uninterrupted one); SIGINT/SIGTERM
finish the current step, checkpoint it and exit, so no finished step is
lost; evaluation is recomputed. A workdir holding a different config is
refused.

  python -m experiments.native_topk \
    --config=experiments/configs/native_topk.py --workdir=/tmp/native_topk

Multi-host (README "Pods"): every process runs the same command (plus
``--coordinator_address/--num_processes/--process_id`` off TPU, see
``jaxtopk.parallel.maybe_initialize_distributed``); training is data
parallel over ``--mesh`` (default all devices on ``data``; parameters and
optimizer state by ``parallel``'s rules, attention heads over ``heads``),
each process handing over only its rows of every batch; checkpoints are
saved by all processes together (orbax) and restore into any process
count; the stop decision on a signal is agreed by all processes; every
process evaluates the trained weights (small models: no collectives), and
only process 0 writes config.json, metrics.jsonl, results.md and figures.
The workdir must be one shared filesystem for all processes.
"""

import json
import math
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import app
from absl import flags
from absl import logging
from flax import nnx
from ml_collections import config_flags

import jaxtopk
from experiments import _common
from experiments import _decoder_init
from experiments import _selectors
from jaxtopk import models
from jaxtopk import parallel
from jaxtopk import tasks

PHASES = ("base", "dense", "topk")
TASKS = ("recall", "lookup", "aggregate", "needle")


# ----------------------------------------------------------------- data


def _vocab(config) -> tasks.Vocab:
  return tasks.Vocab(**config.vocab.to_dict())


def make_task(config, name, seed, batch_size, depth=None, seq_len=None):
  """One task's :class:`jaxtopk.tasks.RetrievalBatch`."""
  common = dict(
    batch_size=batch_size,
    seq_len=seq_len or config.seq_len,
    vocab=_vocab(config),
  )
  if name == "recall":
    return tasks.associative_recall(seed, **common)
  if name == "lookup":
    queries = min(config.train.lookup_queries, (common["seq_len"] - 1) // 4)
    return tasks.multi_key_lookup(seed, num_queries=queries, **common)
  if name == "needle":
    return tasks.needle_in_haystack(seed, depth=depth, **common)
  if name == "aggregate":
    return tasks.aggregate_recall(
      seed,
      num_occurrences=config.train.aggregate_occurrences,
      num_levels=config.train.aggregate_levels,
      **common,
    )
  raise ValueError(f"unknown task {name=}")


def train_seq_len(config, phase: str, step: int) -> int:
  """Context length of a training step: the base run's curriculum, else full.

  The model's rotary positions are relative, so it runs at any length; the base
  run starts short because retrieval is learned far faster there (attention
  is uniform over all keys at initialisation, so the signal falls with
  length), then grows to ``config.seq_len``.
  """
  seq_len = config.seq_len
  if phase == "base":
    for start, length in config.train.curriculum:
      if step >= start:
        seq_len = min(length, config.seq_len)
  return seq_len


def train_batch(config, phase: str, step: int):
  """(inputs, targets, weights) mixing the tasks; pure in its args."""
  seq_len = train_seq_len(config, phase, step)
  sizes = np.full(len(TASKS), config.train.batch_size // len(TASKS))
  sizes[0] += config.train.batch_size - sizes.sum()
  parts = [
    make_task(
      config,
      name,
      (config.seed, PHASES.index(phase), step, i),
      int(size),
      seq_len=seq_len,
    )
    for i, (name, size) in enumerate(zip(TASKS, sizes, strict=True))
  ]
  inputs = np.concatenate([p.inputs for p in parts])
  targets = np.concatenate([p.targets for p in parts])
  weights = np.concatenate([p.answer_mask for p in parts]).astype(np.float32)
  return inputs, targets, weights


# ------------------------------------------------------------- metrics


class Metrics:
  """Append-only metrics.jsonl that drops lines a resumed run will redo.

  Multi-host: only process 0 writes the file.
  """

  def __init__(self, path):
    self.path = path
    self.rows = []
    if os.path.exists(path):
      with open(path) as f:
        self.rows = [json.loads(line) for line in f if line.strip()]

  def drop(self, predicate):
    self.rows = [r for r in self.rows if not predicate(r)]
    self._rewrite()

  def _rewrite(self):
    if not parallel.is_main_process():
      return
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      for row in self.rows:
        f.write(json.dumps(row) + "\n")
    os.replace(tmp, self.path)

  def write(self, **row):
    self.rows.append(row)
    if not parallel.is_main_process():
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")


# ------------------------------------------------------------- training


def _model(config, seed) -> models.TopKDecoder:
  dcfg = models.DecoderConfig(
    vocab_size=_vocab(config).size, **config.model.to_dict()
  )
  return models.TopKDecoder(dcfg, rngs=nnx.Rngs(seed))


def _optimizer(model, config, phase):
  t = config.train
  if phase == "base":
    steps, peak, warmup = t.base_steps, t.learning_rate, t.warmup_steps
  else:
    steps, peak = t.finetune_steps, t.finetune_learning_rate
    warmup = max(1, steps // 10)
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, peak, warmup, max(steps, warmup + 1), end_value=0.1 * peak
  )
  tx = optax.chain(
    optax.clip_by_global_norm(t.clip_norm),
    optax.adamw(schedule, weight_decay=t.weight_decay),
  )
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


def _flat(tree):
  # Arrays stay jax.Arrays: orbax saves a global array from every process
  # (each writes its shards) and restores into a template's sharding.
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p): x for p, x in leaves}


def _unflat(template, flat):
  paths, treedef = jax.tree_util.tree_flatten_with_path(template)
  leaves = [jnp.asarray(flat[jax.tree_util.keystr(p)]) for p, _ in paths]
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _save(manager, step, model, optimizer):
  manager.save(
    step,
    args=ocp.args.Composite(
      model=ocp.args.StandardSave(_flat(nnx.to_pure_dict(nnx.state(model)))),
      opt=ocp.args.StandardSave(_flat(nnx.to_pure_dict(nnx.state(optimizer)))),
    ),
    force=True,
  )
  manager.wait_until_finished()


def _restore_into(module, flat):
  state = nnx.state(module)
  pure = _unflat(nnx.to_pure_dict(state), flat)
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(module, state)


def _restore(manager, step, model, optimizer=None):
  """Restores the model (and the optimizer, if given) saved at ``step``."""
  items = (
    dict(model=model) if optimizer is None else dict(model=model, opt=optimizer)
  )
  restored = manager.restore(
    step,
    args=ocp.args.Composite(
      **{
        name: ocp.args.StandardRestore(_flat(nnx.to_pure_dict(nnx.state(m))))
        for name, m in items.items()
      }
    ),
  )
  for name, module in items.items():
    _restore_into(module, restored[name])


def _manager(workdir, phase):
  return ocp.CheckpointManager(
    os.path.join(os.path.abspath(workdir), "ckpt", phase),
    options=ocp.CheckpointManagerOptions(max_to_keep=2),
  )


def _loss_fn(model, inputs, targets, weights, attention):
  logits, _ = model(inputs, attention=attention)  # [b, s, vocab]
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  loss = jnp.sum(ce * weights) / jnp.sum(weights)
  hit = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  return loss, jnp.sum(hit * weights) / jnp.sum(weights)


@nnx.jit(static_argnames=("attention",))
def _train_step(model, optimizer, inputs, targets, weights, attention):
  grad_fn = nnx.value_and_grad(_loss_fn, has_aux=True)
  (loss, acc), grads = grad_fn(model, inputs, targets, weights, attention)
  optimizer.update(model, grads)
  return loss, acc


def _shard(module, mesh):
  """Places all of ``module``'s state on ``mesh`` by parallel's rules."""
  state = nnx.state(module)
  shardings = parallel.param_shardings(state, mesh)
  nnx.update(module, parallel.put_global(state, shardings))


def train_phase(config, workdir, phase, metrics, should_stop, mesh=None):
  """Runs (or resumes) one training phase; returns (model, finished).

  With a ``mesh``, training is data parallel over its ``data`` axis (and
  attention heads over ``heads``), across processes when multi-host.
  """
  t = config.train
  steps = t.base_steps if phase == "base" else t.finetune_steps
  attention = jaxtopk.Ratio(t.train_rho) if phase == "topk" else None
  model = _model(config, config.seed)
  manager = _manager(workdir, phase)
  start = manager.latest_step()
  if start is None and phase == "base" and config.init.offsets:
    # previous-token heads at step 0 (experiments/_decoder_init.py)
    _decoder_init.previous_token_init(model, config.init)
  optimizer = _optimizer(model, config, phase)
  if mesh is not None:
    _shard(model, mesh)
    _shard(optimizer, mesh)
  if start is not None:
    _restore(manager, start, model, optimizer)
    logging.info("%s: resumed at step %d of %d", phase, start, steps)
  else:
    start = 0
    if phase != "base":  # fine-tunes start from the finished base model
      base = _manager(workdir, "base")
      _restore(base, base.latest_step(), model)
  metrics.drop(
    lambda r: (
      r.get("kind") == "train" and r["phase"] == phase and r["step"] > start
    )
  )
  tick = time.time()
  for step in range(start, steps):
    batch = train_batch(config, phase, step)
    if mesh is None:
      batch = [jnp.asarray(a) for a in batch]
    else:  # each process hands over only its rows
      batch = [parallel.global_batch(a, mesh) for a in batch]
    loss, acc = _train_step(model, optimizer, *batch, attention)
    done = step + 1
    if done % t.log_every == 0 or done == steps or done == 1:
      secs = (time.time() - tick) / (done - start)
      metrics.write(
        kind="train",
        phase=phase,
        step=done,
        loss=float(loss),
        acc=float(acc),
        sec_per_step=secs,
      )
      logging.info(
        "%s step %d/%d loss %.4f acc %.3f (%.2f s/step, eta %.0f s)",
        phase,
        done,
        steps,
        float(loss),
        float(acc),
        secs,
        secs * (steps - done),
      )
    stop = parallel.any_process(should_stop())  # one decision for all
    if done % t.checkpoint_every == 0 or done == steps or stop:
      _save(manager, done, model, optimizer)
    if stop and done < steps:
      logging.warning("%s: stopped after step %d (checkpointed)", phase, done)
      manager.close()
      return model, False
  manager.close()
  return model, True


# ----------------------------------------------------------- evaluation

_decode = nnx.jit(
  models.decode_teacher_forced,
  static_argnames=("prompt_len", "attention", "block_size"),
)


@nnx.jit
def _dense_entropy(model, inputs):
  _, info = model(inputs, attention=_selectors.DENSE_STATS)
  return [layer["entropy"] for layer in info]  # per layer [b, s, h]


def eval_sets(config):
  """[(name, RetrievalBatch)] with seeds disjoint from training."""
  n = config.eval.num_examples
  sizes = dict(recall=n, lookup=n, aggregate=config.eval.aggregate_examples)
  sets = [
    (name, make_task(config, name, (config.seed, 99, i), sizes[name]))
    for i, name in enumerate(("recall", "lookup", "aggregate"))
  ]
  for j, depth in enumerate(config.eval.needle_depths):
    batch = make_task(config, "needle", (config.seed, 99, 10 + j), n, depth)
    sets.append((f"needle@{depth:g}", batch))
  return sets


def sweep_selectors(config):
  """[(sweep, parameter, attention)] decoded for each model and task.

  Dense, ratio and certified sweeps run the library's own decode path
  (``jaxtopk.decode_attention`` with a policy, certificates included); the
  fidelity sweeps plug the experiment's selectors in through the decoder's
  attention hook (``_selectors.SelectorAttention``).
  """
  e = config.eval
  hook = _selectors.SelectorAttention
  out = [("dense", None, None)]
  out += [("ratio", r, jaxtopk.Ratio(r)) for r in e.rhos]
  out += [
    ("mixed", p, hook(_selectors.MixedTopK(e.fidelity_rho, p)))
    for p in e.precisions
  ]
  out += [
    ("approx_emulated", r, hook(_selectors.ApproxMaxK(e.fidelity_rho, r)))
    for r in e.recall_targets
  ]
  if e.approx_xla:
    out += [
      (
        "approx_xla",
        r,
        hook(_selectors.ApproxMaxK(e.fidelity_rho, r, emulate=False)),
      )
      for r in e.recall_targets
    ]
  out += [("certified", eps, jaxtopk.Certified(eps)) for eps in e.eps]
  return out


def _row_stats(aux):
  """``(kept, tv_bound, precision)`` of one layer's decode statistics.

  A Certificate (policy sweeps) has no precision: the library keeps an exact
  upper set of the logits, so precision is not measured there (None).
  """
  if isinstance(aux, jaxtopk.Certificate):
    return aux.k_kept, aux.tv_bound, None
  return aux["kept"], aux["tv_bound"], aux["precision"]


def decode_eval(config, model, batch, prompt, selector, rng):
  """Accuracy and answer-row statistics of one selector on one batch."""
  cols = np.flatnonzero(batch.answer_mask[0])
  steps = cols - prompt
  logits_all, hits, kept, tv, prec = [], [], [], [], []
  size = config.eval.batch_size
  for lo in range(0, batch.inputs.shape[0], size):
    inputs = jnp.asarray(batch.inputs[lo : lo + size])
    targets = batch.targets[lo : lo + size]
    logits, infos = _decode(
      model, inputs, prompt_len=prompt, attention=selector, rng=rng
    )
    logits = np.asarray(logits)[:, steps]  # [b, answers, vocab]
    logits_all.append(logits)
    hits.append(np.argmax(logits, -1) == targets[:, cols])
    for layer in infos:  # leaves [b, decode steps, h]
      k_kept, tv_bound, precision = _row_stats(layer)
      filled = (cols + 1)[None, :, None]  # keys in the cache at each answer
      kept.append(np.asarray(k_kept)[:, steps] / filled)
      tv.append(np.asarray(tv_bound)[:, steps])
      if precision is not None:
        prec.append(np.asarray(precision)[:, steps])
  tv = np.concatenate([x.ravel() for x in tv])
  return np.concatenate(logits_all), dict(
    acc=float(np.mean(np.concatenate(hits))),
    kept_frac=float(np.mean(np.concatenate([x.ravel() for x in kept]))),
    tv_bound_mean=float(np.mean(tv)),
    tv_bound_max=float(np.max(tv)),
    precision=(
      float(np.mean(np.concatenate([x.ravel() for x in prec])))
      if prec
      else None
    ),
  )


def evaluate(config, trained_models, metrics):
  """Runs every sweep; writes eval, check and entropy rows."""
  metrics.drop(lambda r: r.get("kind") in ("eval", "entropy", "check"))
  sets = eval_sets(config)
  # One dense prefill length for every task, so each selector compiles once.
  prompt = min(batch.first_answer for _, batch in sets)
  selectors = sweep_selectors(config)
  rng = jax.random.key(config.seed)
  total, count, tick = len(trained_models) * len(selectors), 0, time.time()
  # Every model is evaluated through one module object: its weights are
  # swapped in, so the jitted decode compiles once per selector, not once per
  # model (a new TopKDecoder has a new graphdef: CertifiedTopKAttention
  # holds a per-instance attention_fn closure as a static attribute).
  model = _model(config, config.seed)
  for model_name, trained in trained_models.items():
    nnx.update(model, nnx.state(trained))
    dense_logits = {}
    for sweep, param, selector in selectors:
      for task, batch in sets:
        logits, row = decode_eval(config, model, batch, prompt, selector, rng)
        metrics.write(
          kind="eval",
          model=model_name,
          sweep=sweep,
          param=param,
          task=task,
          **row,
        )
        if sweep == "dense":
          dense_logits[task] = logits
        if sweep == "ratio" and param == 1.0:
          diff = float(np.max(np.abs(logits - dense_logits[task])))
          metrics.write(
            kind="check",
            model=model_name,
            task=task,
            rho1_vs_dense_max_abs_diff=diff,
          )
      count += 1
      logging.info(
        "eval %d/%d (%s %s=%s) %.0f s",
        count,
        total,
        model_name,
        sweep,
        param,
        time.time() - tick,
      )
    # Entropy over recall, lookup, aggregate and the first needle depth.
    inputs = np.concatenate([b.inputs for _, b in sets[:4]])
    answer = np.concatenate([b.answer_mask for _, b in sets[:4]])
    for layer, ent in enumerate(_dense_entropy(model, jnp.asarray(inputs))):
      ent = np.asarray(ent)  # [b, s, h]
      for head in range(ent.shape[2]):
        metrics.write(
          kind="entropy",
          model=model_name,
          layer=layer,
          head=head,
          entropy_all=float(np.mean(ent[:, 1:, head])),
          entropy_answer=float(np.mean(ent[:, :, head][answer])),
          log_context=float(math.log(config.seq_len)),
        )


# --------------------------------------------------------- workdir, main


def _check_workdir(config, workdir):
  """Resumes a workdir of the same config, refuses another; else starts.

  Only process 0 of a multi-host run writes (``_common.Workdir``).
  """
  return _common.Workdir(workdir, config, resumable=True)


def _host_local(model):
  """``model`` with its (global, sharded) weights copied to this host."""
  state = parallel.fetch(nnx.state(model))  # numpy, on every process
  nnx.update(model, jax.tree.map(jnp.asarray, state))
  return model


def run(config, workdir, should_stop=lambda: False, mesh=None):
  """Trains, evaluates and reports; returns False if stopped early.

  ``mesh``: train data parallel on it (see ``train_phase``); evaluation
  then runs on host-local copies of the weights on every process.
  """
  _check_workdir(config, workdir)
  metrics = Metrics(os.path.join(workdir, "metrics.jsonl"))
  trained = {}
  for phase in PHASES:
    model, finished = train_phase(
      config, workdir, phase, metrics, should_stop, mesh
    )
    if not finished:
      return False
    if phase != "base":
      trained[phase] = model if mesh is None else _host_local(model)
  tick = time.time()
  evaluate(config, trained, metrics)
  logging.info("evaluation took %.0f s", time.time() - tick)
  if parallel.is_main_process():
    from experiments import _native_topk_report as report  # matplotlib

    report.write_report(config, workdir, metrics.rows)
  return True


def main(argv):
  del argv
  stop = threading.Event()

  def handler(signum, frame):
    del frame
    logging.warning("signal %d: stopping after the current step", signum)
    stop.set()

  _INIT_DISTRIBUTED()  # multi-host start-up (no-op on one process)
  mesh = None
  if _MESH.value or jax.process_count() > 1:
    mesh = parallel.mesh_from_flag(_MESH.value)
    logging.info(
      "process %d of %d, mesh %s",
      jax.process_index(),
      jax.process_count(),
      dict(mesh.shape),
    )
  signal.signal(signal.SIGTERM, handler)
  signal.signal(signal.SIGINT, handler)
  tick = time.time()
  with parallel.fail_fast():  # multi-host: a failed process ends at once
    finished = run(_CONFIG.value, _WORKDIR.value, stop.is_set, mesh)
  logging.info(
    "%s in %.0f s", "finished" if finished else "stopped", time.time() - tick
  )


def _define_flags():
  """Defines the binary's flags (only when run as a script, so that other
  binaries can import this module: experiments/kv_retrieval trains its
  decoder with ``train_phase``)."""
  global _CONFIG, _WORKDIR, _MESH, _INIT_DISTRIBUTED
  _CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "Path to experiments/configs/native_topk.py[:smoke].",
    lock_config=True,
  )
  _WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")
  # Empty: no mesh on one process; all devices on `data` on several.
  _MESH = parallel.flags.define_mesh_flag()
  _INIT_DISTRIBUTED = parallel.flags.define_distributed_flags()
  flags.mark_flags_as_required(["config", "workdir"])


if __name__ == "__main__":
  _define_flags()
  app.run(main)
