r"""Trains the small long-context model (Llama architecture) on this machine.

A ``jaxtopk.models.TopKDecoder`` of the Llama 3 family (grouped-query
attention, rotary positions with llama3 frequency scaling, tied embeddings)
learns, with dense attention through the library's own ``topk_attention``,
to read real text and to retrieve from it: RULER-style tasks of
``jaxtopk.tasks`` over haystacks of the shipped public-domain text and
noise, plus copy rows (a span of the context repeated: every token of the
repeat is a long-range lookup) and dense key-value recall. Rotary positions
let one set of weights run at any length, so the context grows by a
curriculum: many cheap steps at short contexts learn the lookups, few
expensive ones at 2,048-4,096 tokens extend them
(``experiments/_long_context_data.py`` has the data).

Outputs in --workdir: config.json, metrics.jsonl (``train`` rows per log
interval, ``eval`` rows: dense accuracy per task and context at the end),
training.png, summary.txt, ckpt/ (orbax; a rerun of the same command
resumes from the last checkpoint, batches being a pure function of (seed,
step)), and model/: the trained model as a Hugging Face directory
(config.json, model.safetensors, tokenizer.json) that
``jaxtopk.models.load_pretrained`` (and transformers) read. With
``--config.export_dir`` the model directory is also written there (the
committed one is ``jaxtopk/models/weights/long_context_lm``).

Launch: see experiments/configs/train_long_context.py.
"""

import os
import shutil
import time

import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx

from experiments import _common
from experiments import _decoder_init
from experiments import _long_context_data as data
from experiments import native_topk as nt
from jaxtopk import models

NAME = "train_long_context"


def decoder_config(config) -> models.DecoderConfig:
  """The model's architecture from ``config.model``."""
  m = config.model
  scaling = None
  if m.rope_scaling_factor:
    scaling = models.RopeScaling(
      "llama3",
      m.rope_scaling_factor,
      low_freq_factor=m.rope_low_freq_factor,
      high_freq_factor=m.rope_high_freq_factor,
      original_max_position_embeddings=m.rope_original_context,
    )
  vocab = data.vocab_of(config.vocab.num_keys, config.vocab.num_values)
  return models.DecoderConfig(
    vocab_size=vocab.size,
    num_layers=m.num_layers,
    num_heads=m.num_heads,
    num_kv_heads=m.num_kv_heads,
    model_dim=m.model_dim,
    head_dim=m.head_dim,
    mlp_dim=m.mlp_dim,
    rope_theta=m.rope_theta,
    rope_scaling=scaling,
    tie_embeddings=m.tie_embeddings,
    # The context the frequencies are scaled for (informational; as Llama
    # 3.1 declares original x factor), else the longest trained one.
    max_position_embeddings=(
      int(m.rope_original_context * m.rope_scaling_factor)
      if scaling
      else max(length for _, length, _ in config.train.curriculum)
    ),
  )


def schedule(config, step: int) -> tuple[int, int]:
  """``(seq_len, batch_size)`` of a step from the curriculum."""
  out = None
  for start, seq_len, batch_size in config.train.curriculum:
    if step >= start:
      out = (seq_len, batch_size)
  if out is None:
    raise ValueError("config.train.curriculum must start at step 0")
  return out


def _optimizer(model, config):
  t = config.train
  lr = optax.warmup_cosine_decay_schedule(
    0.0,
    t.learning_rate,
    t.warmup_steps,
    max(t.steps, t.warmup_steps + 1),
    end_value=0.1 * t.learning_rate,
  )
  tx = optax.chain(
    optax.clip_by_global_norm(t.clip_norm),
    optax.adamw(lr, weight_decay=t.weight_decay),
  )
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


def _loss(model, inputs, targets, weights, answers):
  logits, _ = model(inputs)  # dense: jaxtopk.topk_attention(Dense())
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  loss = jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1e-6)
  hits = (jnp.argmax(logits, -1) == targets) & answers  # [b, s]
  return loss, (jnp.sum(hits, 1), jnp.sum(ce * answers) / jnp.sum(answers))


@nnx.jit
def _train_step(model, optimizer, inputs, targets, weights, answers):
  grad_fn = nnx.value_and_grad(_loss, has_aux=True)
  (loss, (hits, answer_ce)), grads = grad_fn(
    model, inputs, targets, weights, answers
  )
  optimizer.update(model, grads)
  return loss, answer_ce, hits


@nnx.jit
def _answer_hits(model, inputs, targets, answers):
  """Per row: answers right, and answers (dense teacher forcing)."""
  logits, _ = model(inputs)
  hits = (jnp.argmax(logits, -1) == targets) & answers
  return jnp.sum(hits, 1), jnp.sum(answers, 1)


def train(config, workdir, metrics):
  """Runs (or resumes) training; returns the model."""
  t = config.train
  vocab = data.vocab_of(config.vocab.num_keys, config.vocab.num_values)
  text = data.text_tokens(data.TRAIN_PART, vocab)
  model = models.TopKDecoder(decoder_config(config), rngs=nnx.Rngs(config.seed))
  if config.init.offsets:
    heads = _decoder_init.previous_token_init(model, config.init)
    logging.info("previous-token heads: %s", heads)
  optimizer = _optimizer(model, config)
  manager = nt._manager(workdir, "train")
  start = manager.latest_step()
  if start is not None:
    nt._restore(manager, start, model, optimizer)
    logging.info("resumed at step %d of %d", start, t.steps)
  start = start or 0
  metrics.drop(lambda r: r.get("kind") == "train" and r["step"] > start)
  kinds = tuple(t.kinds)
  first = tuple(t.first_kinds) or kinds
  names = tuple(dict.fromkeys(first + kinds))  # each kind once, for metrics
  window = {"loss": [], "answer_ce": [], "hits": np.zeros(len(names)),
            "total": np.zeros(len(names))}  # fmt: skip
  progress = _common.Progress("train", t.steps - start, every_s=60)
  tick = time.time()
  for step in range(start, t.steps):
    seq_len, batch_size = schedule(config, step)
    now = first if step < t.first_kinds_steps else kinds
    inputs, targets, weights, answers, kind_ids = data.train_batch(
      config.seed, step, seq_len, batch_size, now, vocab, text, t.lm_weight
    )
    kind_ids = np.asarray([names.index(now[i]) for i in kind_ids])
    loss, answer_ce, hits = _train_step(
      model, optimizer, inputs, targets, weights, answers
    )
    window["loss"].append(float(loss))
    window["answer_ce"].append(float(answer_ce))
    np.add.at(window["hits"], kind_ids, np.asarray(hits))
    np.add.at(window["total"], kind_ids, answers.sum(1))
    done = step + 1
    if done % t.log_every == 0 or done == t.steps:
      acc = window["hits"] / np.maximum(window["total"], 1)
      metrics.write(
        kind="train",
        step=done,
        seq_len=seq_len,
        batch_size=batch_size,
        loss=float(np.mean(window["loss"])),
        answer_ce=float(np.mean(window["answer_ce"])),
        answer_acc={k: float(a) for k, a in zip(names, acc, strict=True)},
        seconds=time.time() - tick,
      )
      window = {"loss": [], "answer_ce": [], "hits": np.zeros(len(names)),
                "total": np.zeros(len(names))}  # fmt: skip
    if done % t.checkpoint_every == 0 or done == t.steps:
      nt._save(manager, done, model, optimizer)
    progress.update(1, f"L={seq_len} loss {float(loss):.3f}")
  manager.close()
  return model


def evaluate(config, model, metrics):
  """Dense accuracy per task and context (teacher-forced answers)."""
  e = config.eval
  vocab = data.vocab_of(config.vocab.num_keys, config.vocab.num_values)
  text = data.text_tokens(data.EVAL_PART, vocab)
  metrics.drop(lambda r: r.get("kind") == "eval")
  rows = []
  progress = _common.Progress("eval", len(e.lengths) * len(e.tasks))
  for seq_len in e.lengths:
    for i, task in enumerate(e.tasks):
      batch = data.eval_task(
        task, (config.seed, 999, seq_len, i), e.num_examples, seq_len, vocab,
        text,
      )  # fmt: skip
      hits, total = [], []
      for lo in range(0, e.num_examples, e.batch_size):
        sl = slice(lo, lo + e.batch_size)
        h, n = _answer_hits(
          model,
          jnp.asarray(batch.inputs[sl]),
          jnp.asarray(batch.targets[sl]),
          jnp.asarray(batch.answer_mask[sl]),
        )
        hits.append(np.asarray(h))
        total.append(np.asarray(n))
      hits, total = np.concatenate(hits), np.concatenate(total)
      row = dict(
        seq_len=seq_len,
        task=task,
        exact_match=float(np.mean(hits == total)),
        token_acc=float(hits.sum() / total.sum()),
        num_examples=int(e.num_examples),
      )
      metrics.write(kind="eval", **row)
      rows.append(dict(kind="eval", **row))
      progress.update(1, f"{task}@{seq_len}: {row['exact_match']:.2f}")
  return rows


def _figure(wd, rows, evals):
  fig, axes = _common.new_figure(ncols=2, size=(5.0, 3.6))
  ax = axes[0][0]
  train = [r for r in rows if r["kind"] == "train"]
  steps = [r["step"] for r in train]
  ax.plot(steps, [r["loss"] for r in train], label="loss")
  ax.plot(steps, [r["answer_ce"] for r in train], label="answer CE")
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax2 = ax.twinx()
  ax2.plot(steps, [r["seq_len"] for r in train], "k:", label="context")
  ax2.set_yscale("log", base=2)
  ax2.set_ylabel("context (tokens)")
  ax.legend(fontsize=7, loc="lower left")
  ax.set_title("training (dense attention)", fontsize=9)
  ax = axes[0][1]
  for task in sorted({r["task"] for r in evals}):
    pts = sorted(
      (r["seq_len"], r["exact_match"]) for r in evals if r["task"] == task
    )
    ax.plot(*zip(*pts, strict=True), "o-", label=task)
  ax.set_xscale("log", base=2)
  ax.set_ylim(-0.05, 1.05)
  ax.set_xlabel("context (tokens)")
  ax.set_ylabel("exact match (dense)")
  ax.legend(fontsize=6)
  wd.save_figure(fig, "training")


def run(config, workdir, *, overwrite=False):
  """Trains, exports and evaluates; returns the eval rows."""
  wd = _common.Workdir(workdir, config, overwrite=overwrite, resumable=True)
  metrics = nt.Metrics(os.path.join(workdir, "metrics.jsonl"))
  tick = time.time()
  model = train(config, workdir, metrics)
  train_seconds = time.time() - tick
  vocab = data.vocab_of(config.vocab.num_keys, config.vocab.num_values)
  model_dir = os.path.join(workdir, "model")
  extra = dict(
    jaxtopk_task_vocab=dict(
      num_keys=vocab.num_keys,
      num_values=vocab.num_values,
      num_filler=vocab.num_filler,
    ),
    jaxtopk_text="bytes",  # the filler range is the 256 bytes of UTF-8 text
    jaxtopk_trained_context=max(
      length for _, length, _ in config.train.curriculum
    ),
  )
  models.save_pretrained(
    model, model_dir, tokenizer=data.build_tokenizer(vocab), **extra
  )
  if config.export_dir:
    shutil.copytree(model_dir, config.export_dir, dirs_exist_ok=True)
  metrics.write(
    kind="timing",
    train_seconds=train_seconds,
    load_average_1_5_15=list(os.getloadavg()),
  )
  evals = evaluate(config, model, metrics)
  _figure(wd, metrics.rows, evals)
  total = sum(r["train_seconds"] for r in metrics.rows if r["kind"] == "timing")
  summary = _common.format_table(
    evals, ["task", "seq_len", "exact_match", "token_acc", "num_examples"]
  )
  wd.write_summary(
    f"parameters: {model.config.num_params}\n"
    f"training: {config.train.steps} steps, {total:.0f} s of wall time in"
    f" all runs (this one {train_seconds:.0f} s)\n"
    f"machine: {_common.machine_info()}\n\n{summary}"
  )
  return evals


if __name__ == "__main__":
  _common.app_main(NAME, run)
