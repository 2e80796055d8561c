"""Config of experiments/native_topk.py (native Top-k, THEORY 8).

Launch (default, 15.5 minutes measured on the shared 2-core CPU at load
average 10-13; up to ~40 under heavier load, see BUILD_NOTES):

  python -m experiments.native_topk \
    --config=experiments/configs/native_topk.py --workdir=/tmp/native_topk

Smoke variant (seconds; what the CI test runs):

  python -m experiments.native_topk \
    --config=experiments/configs/native_topk.py:smoke --workdir=/tmp/smoke
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Default config, or the ``smoke`` variant when ``arg == 'smoke'``."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # every batch is drawn from (seed, phase, step, task)
  c.seq_len = 256  # context length of every training and eval sequence

  # Token layout (jaxtopk.tasks.Vocab); num_keys >= (seq_len - 2) // 2.
  c.vocab = ml_collections.ConfigDict()
  c.vocab.num_keys = 128  # distinct key tokens
  c.vocab.num_values = 64  # value tokens
  c.vocab.num_filler = 64  # haystack filler tokens

  # Model (jaxtopk.models.DecoderConfig).
  c.model = ml_collections.ConfigDict()
  c.model.num_layers = 2  # transformer blocks
  c.model.num_heads = 4  # heads per block
  c.model.model_dim = 64  # residual width
  c.model.mlp_dim = 128  # MLP hidden width
  c.model.rope_theta = 10000.0  # rotary base (Llama-style decoder)

  # Structured initialisation of the base run (experiments/_decoder_init):
  # query heads 0.. of layer 0 start attending `offsets` tokens back, the
  # half of the lookup circuit a rotary decoder otherwise learns slowly;
  # () turns it off.
  c.init = ml_collections.ConfigDict()
  c.init.offsets = (1,)  # one head per offset
  c.init.embed_scale = 8.0  # embeddings x this (unit-size rows)
  c.init.constant = 0.4  # shared embedding component (dimension 0), x rms
  c.init.margin = 10.0  # logit margin of the offset over other positions
  c.init.span = 256  # positions over which the margin is maximised
  c.init.pairs = 6  # fastest rotary pairs used

  # Training. Protocol of THEORY 8.2: a dense base model, then two
  # fine-tunes from it with the same budget, one dense and one with Top-k
  # attention (jaxtopk.Ratio(train_rho)) in the forward pass.
  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 24  # rows per step, split evenly over the 4 tasks
  c.train.base_steps = 600  # dense pre-training steps
  c.train.finetune_steps = 100  # steps of EACH fine-tune (same budget)
  c.train.train_rho = 1 / 16  # kept fraction in the Top-k fine-tune
  # AdamW peak learning rate (cosine decay); 3e-3 kept the lookup circuit
  # of the rotary decoder from forming (experiments/_decoder_init.py).
  c.train.learning_rate = 1e-3
  c.train.finetune_learning_rate = 1e-3  # peak for the fine-tunes
  c.train.warmup_steps = 40  # linear warmup of the base run
  c.train.weight_decay = 0.01  # AdamW weight decay
  c.train.clip_norm = 1.0  # global gradient-norm clip
  c.train.checkpoint_every = 25  # steps between orbax checkpoints
  c.train.log_every = 10  # steps between metrics.jsonl lines
  c.train.lookup_queries = 4  # queried keys per multi-key lookup row
  # aggregate task: the queried key occurs this often; answer = sum of its
  # values, each in [0, aggregate_levels).
  c.train.aggregate_occurrences = 4
  c.train.aggregate_levels = 3
  # Base-run length curriculum: (first step, context length) pairs; lengths
  # are capped at seq_len and the fine-tunes always use seq_len.
  c.train.curriculum = ((0, 16), (150, 32), (250, 64), (350, 128), (450, 256))

  # Evaluation (prefill dense, decode the answer positions with a selector).
  c.eval = ml_collections.ConfigDict()
  c.eval.num_examples = 96  # rows per task (and per needle depth)
  # The aggregate task is the one below ceiling: 3x the rows (binomial
  # standard error 0.024 at accuracy 0.8).
  c.eval.aggregate_examples = 288
  c.eval.batch_size = 96  # rows per jitted decode call
  c.eval.needle_depths = (0.0, 0.5, 1.0)  # needle positions
  # Ratio sweep (THEORY 8.1): exact Top-k at these kept fractions.
  c.eval.rhos = (
    1 / 256,
    1 / 128,
    1 / 64,
    1 / 32,
    1 / 16,
    1 / 8,
    1 / 4,
    1 / 2,
    1.0,
  )
  c.eval.fidelity_rho = 1 / 16  # budget of the fidelity sweep (THEORY 8.3)
  c.eval.precisions = (0.3, 0.5, 0.7, 0.9, 1.0)  # MixedTopK
  c.eval.recall_targets = (0.3, 0.6, 0.9)  # ApproxMaxK
  c.eval.approx_xla = True  # also sweep jax.lax.approx_max_k itself
  c.eval.eps = (0.5, 0.1, 0.01, 0.001)  # jaxtopk.Certified budgets

  if arg == "smoke":
    c.seq_len = 64
    c.vocab.num_keys = 32
    c.vocab.num_values = 16
    c.vocab.num_filler = 16
    c.model.num_layers = 1
    c.model.num_heads = 2
    c.model.model_dim = 16
    c.model.mlp_dim = 16
    c.train.batch_size = 12
    c.train.base_steps = 40
    c.train.finetune_steps = 6
    c.train.train_rho = 1 / 8
    c.train.learning_rate = 1e-2
    c.train.warmup_steps = 4
    c.train.checkpoint_every = 10
    c.train.log_every = 5
    c.train.lookup_queries = 2
    c.train.curriculum = ((0, 64),)  # one length: one compile
    c.eval.num_examples = 12
    c.eval.aggregate_examples = 12
    c.eval.batch_size = 12
    c.eval.needle_depths = (0.0, 1.0)
    c.eval.rhos = (1.0,)
    c.eval.approx_xla = False
    c.eval.fidelity_rho = 1 / 8
    c.eval.precisions = (0.5,)
    c.eval.recall_targets = (0.5,)
    c.eval.eps = (0.1,)
  elif arg:
    raise ValueError(f"unknown config variant {arg=}; use '' or 'smoke'")
  return c
