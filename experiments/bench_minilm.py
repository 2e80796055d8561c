"""Benchmark: the real all-MiniLM-L6-v2 encoder in jaxtopk.models.

Times, on real text (the public-domain book jaxtopk ships), the three things
other experiments pay for: loading the weights (``load_minilm``), the jitted
dense forward pass to sentence embeddings at ``[batch, max_len]`` tokens, and
``minilm_attention_rows`` (forward with every layer's logits, q, k, v, copied
to host numpy). Each figure is the median and min of ``--repeats`` runs after
one warm-up (compile) run; the machine is shared, so the min is the cleaner
figure. Writes one JSON file.

Launch (experiments/README.md; ``:smoke`` for a run of seconds):
  python -m experiments.bench_minilm \
    --config=experiments/configs/bench_minilm.py --workdir=/tmp/bench_minilm
"""

import os
import platform

import jax
from flax import nnx

from experiments import _attention_rows
from experiments import _common
from experiments import _real_text
from jaxtopk import models

NAME = "bench_minilm"


@nnx.jit
def _embed(model, batch):
  return models.sentence_embedding(model, **batch)


def measure(batch_size: int, max_len: int, repeats: int) -> dict:
  """Times loading, the forward pass and the rows; returns the record."""
  texts, sources = _real_text.real_text_passages(
    batch_size, max_len, seed=0, return_sources=True
  )
  load = _common.time_call(lambda: models.load_minilm()[0], repeats)
  model, tokenizer = models.load_minilm()
  batch = models.minilm_tokenize(
    tokenizer, texts, max_len=max_len, pad_to_max_len=True
  )
  forward = _common.time_call(lambda: _embed(model, batch), repeats)
  tokens = batch_size * max_len
  forward["tokens_per_s_at_min"] = tokens / forward["min_s"]
  rows = _common.time_call(
    lambda: _attention_rows.minilm_attention_rows(
      texts,
      max_len,
      model=model,
      tokenizer=tokenizer,
      pad_to_max_len=True,
      batch_size=batch_size,
    )["logits"],
    repeats,
  )
  return dict(
    benchmark="minilm",
    batch=batch_size,
    max_len=max_len,
    text_sources=sources,
    load_minilm=load,
    embed_forward_jit=forward,
    minilm_attention_rows=rows,
    machine=dict(
      platform=platform.platform(),
      cpu_count=os.cpu_count(),
      devices=[str(d) for d in jax.devices()],
      jax=jax.__version__,
    ),
  )


def run(config, workdir, *, overwrite: bool = False) -> dict:
  """Runs the benchmark; writes results.json, metrics.jsonl and a figure."""
  wd = _common.Workdir(workdir, config, overwrite=overwrite)
  record = measure(config.batch, config.max_len, config.repeats)
  record["meta"] = _common.machine_info()
  names = ("load_minilm", "embed_forward_jit", "minilm_attention_rows")
  for name in names:
    wd.metrics.write("timing", name=name, **record[name])
  wd.write_json("results.json", record)
  _common.bar_figure(
    wd.path,
    "timings",
    {name: {"min": record[name]["min_s"]} for name in names},
    ylabel="seconds (min)",
    title=f"MiniLM, {config.batch} x {config.max_len} tokens",
  )
  return record


if __name__ == "__main__":
  _common.app_main(NAME, run)
