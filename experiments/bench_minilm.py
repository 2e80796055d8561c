"""Benchmark: the real all-MiniLM-L6-v2 encoder in jaxtopk.models.

Times, on real text (Debian licence passages), the three things other
experiments pay for: loading the weights (``load_minilm``), the jitted dense
forward pass to sentence embeddings at ``[batch, max_len]`` tokens, and
``minilm_attention_rows`` (forward with every layer's logits, q, k, v, copied
to host numpy). Each figure is the median and min of ``--repeats`` runs after
one warm-up (compile) run; the machine is shared, so the min is the cleaner
figure. Writes one JSON file.

Launch:
  python -m experiments.bench_minilm --out=/tmp/bench_minilm.json
  python -m experiments.bench_minilm --out=/tmp/b.json --batch=2 --max_len=16 \
    --repeats=1   # smoke, seconds
"""

import json
import os
import platform

import jax
from absl import app
from absl import flags
from flax import nnx

from experiments import _attention_rows
from experiments import _common
from experiments import _real_text
from jaxtopk import models

FLAGS = flags.FLAGS


def _define_flags():
  """Flags, defined only when run as a script (importable beside others)."""
  flags.DEFINE_string("out", None, "JSON file to write.", required=True)
  flags.DEFINE_integer("batch", 8, "Passages per forward pass.")
  flags.DEFINE_integer("max_len", 256, "Tokens per passage (padded).")
  flags.DEFINE_integer("repeats", 5, "Timed runs after warm-up.")


@nnx.jit
def _embed(model, batch):
  return models.sentence_embedding(model, **batch)


def run(batch_size: int, max_len: int, repeats: int) -> dict:
  """Runs the benchmark and returns its record."""
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


def main(argv):
  del argv
  record = run(FLAGS.batch, FLAGS.max_len, FLAGS.repeats)
  with open(FLAGS.out, "w", encoding="utf-8") as f:
    json.dump(record, f, indent=2)
  print(json.dumps(record, indent=2))


if __name__ == "__main__":
  _define_flags()
  app.run(main)
