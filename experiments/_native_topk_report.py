"""Figures and markdown tables of experiments/native_topk.py (THEORY 8).

Reads the metrics.jsonl rows of one run and writes fig_training.png,
fig_ratio.png, fig_fidelity.png, fig_entropy.png, fig_certificate.png and
results.md into the workdir.
"""

import collections
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

MODELS = ("dense", "topk")
LABEL = {"dense": "dense fine-tune", "topk": "Top-k fine-tune"}
AGGREGATE = "aggregate"  # jaxtopk.tasks.aggregate_recall, plotted alone too


def _eval(rows, sweep):
  """{(model, task): [(param, row)]} for one sweep, sorted by param."""
  out = collections.defaultdict(list)
  for r in rows:
    if r.get("kind") == "eval" and r["sweep"] == sweep:
      out[(r["model"], r["task"])].append((r["param"], r))
  return {k: sorted(v, key=lambda x: x[0]) for k, v in out.items()}


def _tasks(rows):
  seen = []
  for r in rows:
    if r.get("kind") == "eval" and r["task"] not in seen:
      seen.append(r["task"])
  return seen


def _mean_over_tasks(table, model, tasks, key="acc"):
  params = [p for p, _ in table[(model, tasks[0])]]
  vals = np.mean(
    [[row[key] for _, row in table[(model, t)]] for t in tasks], axis=0
  )
  return params, vals


def _fig_training(rows, path):
  fig, ax = plt.subplots(figsize=(5, 3.2))
  offset = 0
  for phase in ("base", "dense", "topk"):
    pts = [
      (r["step"], r["loss"])
      for r in rows
      if r.get("kind") == "train" and r["phase"] == phase
    ]
    if not pts:
      continue
    steps, losses = zip(*pts, strict=True)
    start = 0 if phase == "base" else offset
    ax.plot(np.array(steps) + start, losses, label=phase)
    if phase == "base":
      offset = max(steps)
  ax.set(xlabel="step", ylabel="answer loss", yscale="log")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


def _fig_sweep(rows, sweep, path, xlabel, logx=False, extra=None):
  table = _eval(rows, sweep)
  tasks = _tasks(rows)
  fig, ax = plt.subplots(figsize=(5, 3.2))
  for model in MODELS:
    if (model, tasks[0]) not in table:
      continue
    params, acc = _mean_over_tasks(table, model, tasks)
    ax.plot(params, acc, "o-", label=f"{LABEL[model]} ({sweep}, mean)")
    if AGGREGATE in tasks:  # the task below ceiling, on its own
      params, acc = _mean_over_tasks(table, model, [AGGREGATE])
      ax.plot(params, acc, "^:", label=f"{LABEL[model]} ({sweep}, aggregate)")
    if extra:
      xt = _eval(rows, extra)
      p2, a2 = _mean_over_tasks(xt, model, tasks, key="acc")
      prec = _mean_over_tasks(xt, model, tasks, key="precision")[1]
      ax.plot(prec, a2, "s--", label=f"{LABEL[model]} ({extra}, x=precision)")
  if logx:
    ax.set_xscale("log")
  ax.set(xlabel=xlabel, ylabel="accuracy", ylim=(0, 1.02))
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


def _entropy(rows):
  return [r for r in rows if r.get("kind") == "entropy"]


def _fig_entropy(rows, path):
  ent = _entropy(rows)
  fig, ax = plt.subplots(figsize=(5, 3.2))
  width = 0.4
  for i, model in enumerate(MODELS):
    mine = [r for r in ent if r["model"] == model]
    x = np.arange(len(mine))
    ax.bar(
      x + i * width, [r["entropy_all"] for r in mine], width, label=LABEL[model]
    )
    ax.set_xticks(x + width / 2, [f"L{r['layer']}H{r['head']}" for r in mine])
  ax.set(ylabel="mean attention entropy (nats)")
  ax.tick_params(axis="x", labelsize=7)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


def _fig_certificate(rows, path):
  table = _eval(rows, "certified")
  tasks = _tasks(rows)
  fig, ax = plt.subplots(figsize=(5, 3.2))
  for model in MODELS:
    if (model, tasks[0]) not in table:
      continue
    eps, acc = _mean_over_tasks(table, model, tasks)
    ax.plot(eps, acc, "o-", label=f"{LABEL[model]} (mean)")
    if AGGREGATE in tasks:
      eps, acc = _mean_over_tasks(table, model, [AGGREGATE])
      ax.plot(eps, acc, "^:", label=f"{LABEL[model]} (aggregate)")
  ax.set(
    xscale="log",
    xlabel="certified TV budget eps",
    ylabel="accuracy",
    ylim=(0, 1.02),
  )
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


def _table(rows, sweep, pname, keys):
  table = _eval(rows, sweep)
  tasks = _tasks(rows)
  if not table:
    return "(not run in this config)"
  lines = [
    f"| model | {pname} | "
    + " | ".join(tasks)
    + " | "
    + " | ".join(keys)
    + " |",
    "|" + " --- |" * (2 + len(tasks) + len(keys)),
  ]
  for model in MODELS:
    if (model, tasks[0]) not in table:
      continue
    for i, (param, _) in enumerate(table[(model, tasks[0])]):
      accs = [table[(model, t)][i][1]["acc"] for t in tasks]
      stats = [[table[(model, t)][i][1][k] for t in tasks] for k in keys]
      # None: not measured for this sweep (precision of a library policy).
      stats = [
        np.nan if any(v is None for v in vals) else np.mean(vals)
        for vals in stats
      ]
      if keys and keys[-1] == "tv_bound_max":
        stats[-1] = max(table[(model, t)][i][1]["tv_bound_max"] for t in tasks)
      lines.append(
        f"| {model} | {param if param is None else format(param, '.4g')} | "
        + " | ".join(f"{a:.3f}" for a in accs)
        + " | "
        + " | ".join("-" if np.isnan(s) else f"{s:.3g}" for s in stats)
        + " |"
      )
  return "\n".join(lines)


def write_report(config, workdir, rows):
  """Writes the figures and results.md of one run."""
  _fig_training(rows, os.path.join(workdir, "fig_training.png"))
  _fig_sweep(
    rows,
    "ratio",
    os.path.join(workdir, "fig_ratio.png"),
    "kept fraction rho (exact Top-k at decode)",
    logx=True,
  )
  _fig_sweep(
    rows,
    "mixed",
    os.path.join(workdir, "fig_fidelity.png"),
    f"precision p (budget rho = {config.eval.fidelity_rho:.4g})",
    extra="approx_emulated",
  )
  _fig_entropy(rows, os.path.join(workdir, "fig_entropy.png"))
  _fig_certificate(rows, os.path.join(workdir, "fig_certificate.png"))
  stats = ["kept_frac", "precision", "tv_bound_mean", "tv_bound_max"]
  checks = [r for r in rows if r.get("kind") == "check"]
  worst = max((r["rho1_vs_dense_max_abs_diff"] for r in checks), default=None)
  train = [r for r in rows if r.get("kind") == "train"]
  secs = sum(
    r["sec_per_step"]
    * (
      config.train.base_steps
      if r["phase"] == "base"
      else config.train.finetune_steps
    )
    for r in train
    if r["step"]
    == (
      config.train.base_steps
      if r["phase"] == "base"
      else config.train.finetune_steps
    )
  )
  last = {r["phase"]: r for r in train}
  ent_lines = [
    "| model | layer | head | entropy (all rows) | entropy (answer rows) |",
    "| --- | --- | --- | --- | --- |",
  ]
  for r in _entropy(rows):
    ent_lines.append(
      f"| {r['model']} | {r['layer']} | {r['head']} | "
      f"{r['entropy_all']:.3f} | {r['entropy_answer']:.3f} |"
    )
  text = [
    "# Native Top-k results",
    "",
    f"Context length {config.seq_len}; train rho {config.train.train_rho:.4g};"
    f" base {config.train.base_steps} steps, each fine-tune "
    f"{config.train.finetune_steps} steps; {config.eval.num_examples} eval "
    "rows per task. Accuracy = next-token argmax at the answer positions, "
    "decoded from a dense prefill with the selector. Stats are means over "
    "answer rows, layers and heads (tv_bound_max: max).",
    "",
    f"Training time (sum of phases, approx.): {secs:.0f} s. Final train "
    "loss: " + ", ".join(f"{p} {r['loss']:.4f}" for p, r in last.items()) + ".",
    f"rho = 1 vs dense decode, max |logit diff| over all tasks: {worst}.",
    "",
    "## Ratio sweep (exact Top-k at decode)",
    _table(rows, "ratio", "rho", stats),
    "",
    "## Dense decode",
    _table(rows, "dense", "-", stats[:1]),
    "",
    "## Fidelity: mixed exact/random Top-k at precision p",
    _table(rows, "mixed", "p", stats),
    "",
    "## Fidelity: approx_max_k, TPU algorithm emulated (recall target)",
    _table(rows, "approx_emulated", "recall", stats),
    "",
    "## Fidelity: jax.lax.approx_max_k on this backend (recall target)",
    _table(rows, "approx_xla", "recall", stats),
    "",
    "## Certificates: certified top-p (exact search) at eps",
    _table(rows, "certified", "eps", stats),
    "",
    "## Attention entropy (dense softmax)",
    "\n".join(ent_lines),
    "",
  ]
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write("\n".join(text))
