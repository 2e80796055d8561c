"""Config of experiments/train_long_context.py (the long-context model).

Launch (the committed model; ~60-90 minutes on the shared 2-core CPU):

  python -m experiments.train_long_context \
    --config=experiments/configs/train_long_context.py \
    --workdir=/tmp/train_long_context \
    --config.export_dir=jaxtopk/models/weights/long_context_lm

Smoke variant (seconds; what the CI test runs):

  python -m experiments.train_long_context \
    --config=experiments/configs/train_long_context.py:smoke --workdir=/tmp/s
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Default config, or the ``smoke`` variant when ``arg == 'smoke'``."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # every batch is drawn from (seed, step)
  c.export_dir = ""  # also write the model directory here ("" = only workdir)

  # Token layout: specials, keys, values, then the 256 bytes of text.
  c.vocab = ml_collections.ConfigDict()
  # Few keys: the lookup circuit forms far later over 512 keys (no lookup
  # after 875 steps) than over 64 (~700 steps); recall and lookup rows,
  # whose pairs fill the context, are used up to 128 tokens.
  c.vocab.num_keys = 64  # key tokens
  c.vocab.num_values = 32  # value tokens

  # Architecture (jaxtopk.models.DecoderConfig; Llama 3 family).
  c.model = ml_collections.ConfigDict()
  c.model.num_layers = 3  # transformer blocks
  c.model.num_heads = 4  # query heads
  c.model.num_kv_heads = 2  # key/value heads (grouped-query attention)
  c.model.model_dim = 96  # residual width
  c.model.head_dim = 24  # per-head width
  c.model.mlp_dim = 256  # SwiGLU hidden width
  c.model.rope_theta = 500000.0  # rotary base (Llama 3's)
  # llama3 frequency scaling: wavelengths above the original context are
  # slowed by the factor, so those dimensions stay nearly position-free to
  # 32K (content matching); 0 turns the scaling off.
  c.model.rope_scaling_factor = 8.0
  c.model.rope_low_freq_factor = 1.0
  c.model.rope_high_freq_factor = 4.0
  c.model.rope_original_context = 4096
  c.model.tie_embeddings = False  # True: output projection = embedding

  # Structured initialisation (train_long_context.previous_token_init):
  # query heads 0.. of layer 0 start as heads attending `offsets` tokens
  # back; () turns it off.
  c.init = ml_collections.ConfigDict()
  c.init.offsets = (1, 2)  # one head per offset (kv head 0's group)
  c.init.embed_scale = 8.0  # embeddings x this (unit-size rows)
  c.init.constant = 0.4  # shared embedding component (dimension 0), x rms
  c.init.margin = 10.0  # logit margin of the offset over other positions
  c.init.span = 512  # positions over which the margin is maximised
  c.init.pairs = 6  # fastest rotary pairs used

  # Training (dense attention, AdamW, warmup then cosine decay).
  c.train = ml_collections.ConfigDict()
  c.train.steps = 2000  # optimizer steps
  # (first step, context, rows per step): short contexts first.
  c.train.curriculum = (
    (0, 64, 32),
    (900, 128, 16),
    (1100, 256, 8),
    (1300, 512, 4),
    (1500, 1024, 2),
    (1700, 2048, 1),
    (1850, 4096, 1),
  )  # fmt: skip
  c.train.learning_rate = 1e-3  # peak (3e-3 kept lookup from forming)
  c.train.warmup_steps = 50
  c.train.weight_decay = 0.01
  c.train.clip_norm = 1.0  # global gradient-norm clip
  c.train.lm_weight = 0.1  # loss weight of text positions (answers: 1)
  # Row kinds, cycled over the rows of each step (see _long_context_data).
  c.train.kinds = (
    "lookup",
    "copy",
    "niah_multiquery",
    "lookup",
    "recall",
    "niah_text",
    "variable_tracking",
    "niah_multikey",
    "lookup",
    "aggregation",
    "niah_noise",
    "niah_long_value",
    "niah_multiquery",
  )  # fmt: skip
  # The first steps train lookup alone (the induction circuit forms there).
  c.train.first_kinds = ("lookup",)
  c.train.first_kinds_steps = 800
  c.train.checkpoint_every = 50  # orbax checkpoints (resumable)
  c.train.log_every = 25  # steps per metrics.jsonl row

  # Final dense evaluation (teacher-forced answers, exact match per row);
  # the full study is experiments/long_context.py.
  c.eval = ml_collections.ConfigDict()
  c.eval.lengths = (1024, 4096)
  c.eval.tasks = ("niah_text", "niah_multikey", "variable_tracking",
                  "aggregation")  # fmt: skip
  c.eval.num_examples = 8  # rows per task and length
  c.eval.batch_size = 4  # rows per forward pass

  if arg == "smoke":
    c.vocab.num_keys = 64
    c.vocab.num_values = 32
    c.model.num_layers = 1
    c.model.num_heads = 2
    c.model.num_kv_heads = 1
    c.model.model_dim = 16
    c.model.head_dim = 8
    c.model.mlp_dim = 16
    c.model.rope_original_context = 64
    c.train.steps = 4
    c.train.curriculum = ((0, 64, 4),)  # one length: one compilation
    c.train.warmup_steps = 1
    c.train.first_kinds_steps = 1
    c.init.span = 64
    c.train.checkpoint_every = 2
    c.train.log_every = 2
    c.eval.lengths = (64,)
    c.eval.tasks = ("niah_text", "aggregation")
    c.eval.num_examples = 2
    c.eval.batch_size = 2
  elif arg:
    raise ValueError(f"unknown config variant {arg=}; use '' or 'smoke'")
  return c
