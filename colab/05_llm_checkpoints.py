# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · LLM checkpoints: load, swap in certified attention, generate
#
# **Purpose.** Run certified Top-k attention inside a real decoder
# checkpoint and read what it certifies, layer by layer:
#
# 1. load a Hugging Face-format checkpoint of the Llama 3 / Qwen3 family
#    with `jaxtopk.models.load_pretrained` (by default the small
#    long-context model trained by `python -m experiments.train_long_context`
#    and shipped with the package; any Llama 3.x or Qwen3 directory with
#    `config.json`, safetensors weights and `tokenizer.json` works the same);
# 2. generate with dense attention, then with `jaxtopk.Certified(eps)` and
#    `jaxtopk.Ratio(rho)` swapped in per call (`models.generate(...,
#    attention=...)`: prefill through `jaxtopk.topk_attention`, decode steps
#    through `jaxtopk.decode_attention` over the library's KV cache);
# 3. look at the certificates per layer and head: the bound on the softmax
#    mass each attention dropped, and how many keys it kept.
#
# The task is a needle in real text: a key-value pair hidden in a
# public-domain book, then the key asked for. The full study over
# RULER-style tasks at 4K-32K tokens is `python -m experiments.long_context`.

# %% [markdown]
# ## Install and parameters
#
# The parameters cell below is tagged `parameters` (papermill's convention):
# `SMALL = True` shrinks the context so the notebook runs in seconds; the
# tests and the committed outputs use it. `MODEL_DIR = ""` loads the
# packaged model; set it to your own checkpoint directory to run yours
# (its prompts then come from its own tokenizer; the needle task below
# needs the packaged model's task tokens).
#
# The cell after it installs jaxtopk only when it is not importable already:
# in a clone it runs `pip install -e "..[all]"`; on Colab it installs from a
# git URL that **you fill in** (`JAXTOPK_REPO`; the placeholder is not a
# real address).

# %% tags=["parameters"]
SMALL = False  # True: small sizes (seconds); the tests inject True
MODEL_DIR = ""  # "" = the packaged long-context model

# %%
import importlib
import os
import subprocess
import sys

# Placeholder: the repository URL is yours to fill in (jaxtopk is not on PyPI).
JAXTOPK_REPO = os.environ.get(
  "JAXTOPK_REPO", "https://github.com/YOUR_ORG/jaxtopk"
)


def pip_install(*args):
  subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *args])


try:
  import jaxtopk
except ImportError:
  if os.path.exists(os.path.join("..", "jaxtopk", "__init__.py")):
    pip_install("-e", "..[all]")  # a clone: editable, with every extra
    sys.path.insert(0, os.path.abspath(".."))
  else:  # Colab or elsewhere: the git URL above
    pip_install(f"jaxtopk[all] @ git+{JAXTOPK_REPO}")
  importlib.invalidate_caches()
  import jaxtopk
print("jaxtopk", jaxtopk.__version__, "| small sizes:", SMALL)

# %%
# %matplotlib inline
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

plt.rcParams.update(
  {
    "figure.dpi": 72,
    "figure.figsize": (7.5, 3.6),
    "figure.constrained_layout.use": True,
  }
)
print("jax", jax.__version__, "| devices:", jax.devices())
import jaxtopk
from jaxtopk import models
from jaxtopk import tasks

# %% [markdown]
# ## 1. Load the checkpoint
#
# `load_pretrained` reads `config.json` (Llama or Qwen3, rope scaling
# included), the safetensors weights (sharded or not) and `tokenizer.json`,
# without torch. It returns the model (a Flax NNX `TopKDecoder`) and what it
# read besides the weights.

# %%
path = MODEL_DIR or models.long_context_lm_dir()
model, checkpoint = models.load_pretrained(path)
print(checkpoint.decoder)
print(f"{checkpoint.decoder.num_params:,} parameters")
print("tokenizer:", checkpoint.tokenizer is not None)

# %% [markdown]
# ## 2. A needle in real text
#
# The packaged model reads text as bytes and has special tokens for keys
# (`<k0>`...), values (`<v0>`...) and the query marker `<Q>`; its
# `config.json` declares that layout (`jaxtopk_task_vocab`). The haystack is
# the last fifth of the public-domain book jaxtopk ships
# (`jaxtopk.models.public_domain_text`, text the training never read);
# `jaxtopk.tasks.needle_task` hides a `<k> <v>` needle in it and ends the
# prompt with `<Q> <k>`.

# %%
context = 512 if SMALL else 4096
layout = checkpoint.hf_config.get("jaxtopk_task_vocab")
if layout is None:
  raise SystemExit("set MODEL_DIR to a model with a jaxtopk_task_vocab")
vocab = tasks.Vocab(**layout)
words = models.public_domain_text().split()
text = " ".join(words[int(0.8 * len(words)) :])
haystack = checkpoint.encode(text)
batch = tasks.needle_task(
  7, batch_size=4, seq_len=context, vocab=vocab, haystack=haystack, depth=0.3
)
prompt = jnp.asarray(batch.inputs[:, : batch.first_answer + 1])
answer = batch.targets[:, batch.first_answer]
needle = int(np.flatnonzero(batch.inputs[0] == batch.inputs[0, -1])[0])
print(f"prompt: {prompt.shape[1]} tokens; needle at position {needle}:")
print(repr(checkpoint.decode(batch.inputs[0, needle - 40 : needle + 42])))
print("prompt ends with:", repr(checkpoint.decode(prompt[0, -20:])))

# %% [markdown]
# ## 3. Generate: dense, then certified and Top-k attention swapped in
#
# The same weights, three attentions, chosen per call. `dense_prefill=True`
# is the native Top-k protocol (THEORY 8.1): the prompt is prefilled
# densely, every generated token attends through the policy.
# `certificates` holds, per layer, a `jaxtopk.Certificate` per query row
# and head: the prompt's rows, then one row per decode step.

# %%
runs = {
  "dense": None,
  "Certified(0.01)": jaxtopk.Certified(0.01),
  "Ratio(1/64)": jaxtopk.Ratio(1 / 64),
}
results = {}
for name, attention in runs.items():
  tokens, certs = models.generate(
    model,
    prompt,
    max_new_tokens=2,
    attention=attention,
    dense_prefill=True,
  )
  got = np.asarray(tokens[:, prompt.shape[1]])
  results[name] = (tokens, certs)
  print(
    f"{name:16s} answers {checkpoint.decode(got)!r:28} truth"
    f" {checkpoint.decode(answer)!r}: {np.mean(got == answer):.0%} right"
  )

# %% [markdown]
# ## 4. The certificates per layer and head
#
# At the first generated token (the answer), for every layer and head:
# the certified bound on the total variation between the attention it ran
# and dense attention (`tv_bound`, never below the truth) and the fraction
# of the keys it kept. Certified(eps) keeps, per head, the fewest keys whose
# dropped mass is certified <= eps; Ratio keeps a fixed fraction whatever
# mass it drops.

# %%
step = prompt.shape[1]  # the certificate row of the first decode step
fig, axes = plt.subplots(2, 2, figsize=(7.5, 4.6))
for col, name in enumerate(["Certified(0.01)", "Ratio(1/64)"]):
  _, certs = results[name]
  tv = np.stack([np.asarray(c.tv_bound[:, step]) for c in certs])  # [L, b, h]
  kept = np.stack([np.asarray(c.k_kept[:, step]) for c in certs]) / (step + 1)
  for row, (grid, label) in enumerate(
    [(tv.mean(1), "mean tv_bound"), (kept.mean(1), "kept fraction")]
  ):
    ax = axes[row][col]
    im = ax.imshow(grid, cmap="viridis", aspect="auto")
    ax.set_title(f"{name}: {label}", fontsize=9)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    fig.colorbar(im, ax=ax)
plt.show()

# %% [markdown]
# Over the whole prompt (prefilled through `topk_attention` with the policy
# this time, `dense_prefill=False`), the certified bound per layer along the
# positions: attention that is spread (early layers, text positions) needs
# more keys for the same eps than a retrieval head that has found its
# needle.

# %%
eps = 0.01
_, certs = models.generate(
  model, prompt, max_new_tokens=1, attention=jaxtopk.Certified(eps)
)
fig, axes = plt.subplots(1, 2, figsize=(7.5, 3.0))
for layer, cert in enumerate(certs):
  kept = np.asarray(cert.k_kept[0]).mean(-1)  # [positions], mean over heads
  tv = np.asarray(cert.tv_bound[0]).max(-1)
  positions = np.arange(1, kept.size + 1)
  axes[0].plot(positions, kept, label=f"layer {layer}", lw=0.8)
  axes[1].plot(positions, tv, label=f"layer {layer}", lw=0.8)
axes[0].plot(positions, positions, "k:", lw=0.8, label="all keys")
axes[0].set(xlabel="position", ylabel="keys kept (mean over heads)")
axes[0].set_yscale("log")
axes[1].axhline(eps, color="k", ls=":", lw=0.8)
axes[1].set(xlabel="position", ylabel="tv_bound (max over heads)")
axes[0].legend(fontsize=7)
plt.show()
valid = all(bool(np.all(c.valid)) for c in certs)
worst = max(float(np.nanmax(c.tv_bound)) for c in certs)
print(f"every row valid: {valid}; largest tv_bound {worst:.4f} <= {eps}")
