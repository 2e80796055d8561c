"""Config of experiments/long_context.py (RULER-style tasks, 4K-32K).

Launch (default: the packaged long-context model, 4K-32K tokens; 17 minutes
end to end on a 2-core CPU, RESULTS.md section 8):

  python -m experiments.long_context \
    --config=experiments/configs/long_context.py --workdir=/tmp/long_context

Another model directory (it must declare the task token layout in its
config.json, as models trained by experiments/train_long_context.py do):

  ... --config.model_dir=/path/to/model

Smoke variant (seconds; what the CI test runs):

  python -m experiments.long_context \
    --config=experiments/configs/long_context.py:smoke --workdir=/tmp/s
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Default config, or the ``smoke`` variant when ``arg == 'smoke'``."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # task batches are drawn from (seed, context, task)
  c.model_dir = ""  # "" = jaxtopk.models.long_context_lm_dir()
  c.lengths = (4096, 8192, 16384, 32768)  # contexts (tokens)
  c.tasks = (
    "niah_noise",
    "niah_text",
    "niah_multikey",
    "niah_multiquery",
    "niah_long_value",
    "variable_tracking",
    "aggregation",
  )  # fmt: skip
  c.num_examples = 8  # rows per task and context, at most
  # ... and at most row_tokens // context (prefill time grows as context^2):
  # 8, 8, 4 and 2 rows at 4K, 8K, 16K and 32K.
  c.row_tokens = 65536
  c.batch_size = 2  # rows per prefill / decode call
  c.block_size = 64  # cache summary block (and Delta-Search block)
  c.ratios = (1 / 64, 1 / 16)  # jaxtopk.Ratio: kept fraction
  c.eps = (0.1, 0.01)  # jaxtopk.Certified: TV budget
  # Certified searches: "auto" (Certified's default), "exact", "delta", "mc".
  c.certified_searches = ("auto", "exact", "delta")

  # Fixed arguments of the tasks (experiments/_long_context_data.TaskSpec).
  c.task_spec = ml_collections.ConfigDict()
  c.task_spec.num_needles_multikey = 4  # needles (1 queried + distractors)
  c.task_spec.num_queries_multiquery = 2  # needles queried
  c.task_spec.value_len = 4  # value tokens of the long-value needle
  c.task_spec.num_hops = 2  # variable tracking: assignments to resolve
  c.task_spec.num_chains = 2  # variable tracking: chains (1 queried)
  c.task_spec.num_occurrences = 4  # aggregation: pairs of the queried key
  c.task_spec.num_levels = 3  # aggregation: values 0..2
  c.task_spec.num_distractors = 4  # aggregation: pairs of other keys

  if arg == "smoke":
    c.lengths = (256,)
    c.tasks = ("niah_text", "variable_tracking")
    c.num_examples = 2
    c.batch_size = 2
    c.ratios = (1 / 16,)
    c.eps = (0.1,)
    c.certified_searches = ("exact", "delta")
  elif arg:
    raise ValueError(f"unknown config variant {arg=}; use '' or 'smoke'")
  return c
