r"""Attention is n^C-sparse: effective entries, collapse and window policies.

THEORY 7 ([NC]). Two parts:

1. The synthetic setup of [NC]: inputs X [n, d] with iid N(0, 1) entries
   clipped to [-B, B], one attention layer with random W_Q, W_K, W_V. W_Q
   and W_K are rescaled at each n so the logit spread is
   sigma(n) = sqrt(2 a ln n), so R = B^2 ||W_Q W_K^T||_F grows like
   sqrt(ln n) (7.4-7.5). Over n we record the eps-effective entries
   |S_eps| = #{i : P_i >= eps} and the ineffective fraction 1 - |S_eps|/n
   (7.3, "attention collapse"), and compare kept sets: Top-k with
   topk = ceil(alpha n^C) (jaxtopk.PowerLaw), a fixed Top-k window and a
   fixed positional window (the last W keys, StreamingLLM-style without
   sinks) with W chosen for EQUAL AVERAGE COMPUTE over the n sweep, and a
   window topk = ceil(sqrt(ln n)) that is o(log n). Errors: TV = tau, the
   [NC] row error ||P - P_hat|| (7.2) and the output error ||Attn - Attn_k||.
2. all-MiniLM-L6-v2 on real text at several passage lengths n: |S_eps| and
   the ineffective fraction per layer, and R = B^2 ||W_Q^h W_K^h^T||_F per
   layer and head from the real weights, B the largest |entry| of the
   layer's input on these passages.

Outputs: config.json, metrics.jsonl (kinds "synthetic_sparsity",
"synthetic_policy", "minilm_sparsity", "minilm_R"), nc_sparsity.png,
summary.txt.

  python -m experiments.nc_sparsity --workdir=workdirs/nc_sparsity
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

import jaxtopk
from experiments import _common
from experiments import _data
from jaxtopk import theory

NAME = "nc_sparsity"


def policies(cfg) -> dict:
  """Kept-set size rule per policy name: ``n -> (topk, positional?)``."""
  out = {}
  for c in cfg.powers:
    pol = jaxtopk.PowerLaw(cfg.alpha, c)
    out[f"n^{c}"] = (lambda n, pol=pol: int(pol.num_kept(n)), False)
  eq = jaxtopk.PowerLaw(cfg.alpha, cfg.equal_compute_power)
  window = int(round(np.mean([eq.num_kept(n) for n in cfg.ns])))
  out[f"fixed_topk={window}"] = (lambda n: min(window, n), False)
  out[f"fixed_window={window}"] = (lambda n: min(window, n), True)
  out["sqrt(ln n)"] = (
    lambda n: int(math.ceil(cfg.small_scale * math.sqrt(math.log(n)))),
    False,
  )
  return out


def _clipped_normal_var(b: float) -> float:
  """Var of clip(Z, -b, b), Z ~ N(0, 1) (mean 0 by symmetry)."""
  phi = math.exp(-0.5 * b * b) / math.sqrt(2 * math.pi)
  inside = math.erf(b / math.sqrt(2))  # P(|Z| < b)
  return inside - 2 * b * phi + b * b * (1 - inside)


def synthetic_layer(key, weights, cfg, n, a):
  """One [NC] attention layer on clipped Gaussian inputs.

  Args:
    key: PRNG key for the inputs X.
    weights: ``(w_q, w_k, w_v)``, each ``[d_model, head_dim]``, fixed across
      n so that only their scale changes with n.
    cfg: the synthetic config.
    n: sequence length.
    a: growth, sigma(n) = sqrt(2 a ln n).

  Returns:
    ``(logits [q, n], values [n, dv], R, target_sigma)``. W_Q and W_K are
    scaled by c with c^2 var_x ||W_Q W_K^T||_F / sqrt(head_dim) =
    sqrt(2 a ln n): the standard deviation of x^T W_Q W_K^T y / sqrt(d_h)
    for independent inputs x, y with entry variance var_x.
  """
  b = cfg.input_bound
  x = jnp.clip(jax.random.normal(key, (n, cfg.d_model)), -b, b)  # [n, d]
  w_q, w_k, w_v = weights
  target = math.sqrt(2 * a * math.log(n))
  m_norm = float(jnp.linalg.norm(w_q @ w_k.T))
  c2 = target * math.sqrt(cfg.head_dim) / (_clipped_normal_var(b) * m_norm)
  w_q, w_k = math.sqrt(c2) * w_q, math.sqrt(c2) * w_k
  scale = 1.0 / math.sqrt(cfg.head_dim)
  xq = x[-cfg.queries :]  # [q, d]: the last rows see every key
  logits = (xq @ w_q) @ (x @ w_k).T * scale  # [q, n]
  r = float(theory.weight_scale_R(w_q, w_k, b))
  return logits, x @ w_v, r, target


def synthetic(config, writer):
  cfg = config.synthetic
  pols = policies(cfg)
  key, w_key = jax.random.split(jax.random.key(config.seed))
  sparsity, policy_recs = [], []
  progress = _common.Progress(
    "synthetic", len(cfg.growth) * len(cfg.ns) * cfg.draws
  )
  for a in cfg.growth:
    for n in cfg.ns:
      eff = {e: [] for e in config.effective_eps}
      ineff = {e: [] for e in config.effective_eps}
      errs = {p: {"tv": [], "nc": [], "out": []} for p in pols}
      rs, sigmas = [], []
      for draw in range(cfg.draws):
        key, sub = jax.random.split(key)
        init = lambda k: (
          jax.random.normal(k, (cfg.d_model, cfg.head_dim))
          / math.sqrt(cfg.d_model)
        )
        weights = tuple(
          init(k) for k in jax.random.split(jax.random.fold_in(w_key, draw), 3)
        )
        logits, values, r, _ = synthetic_layer(sub, weights, cfg, n, a)
        rs.append(r)
        sigmas.append(float(jnp.std(logits)))
        for e in config.effective_eps:
          eff[e].append(np.asarray(theory.effective_entries(logits, e)))
          ineff[e].append(np.asarray(theory.ineffective_fraction(logits, e)))
        vals = jnp.broadcast_to(values, (logits.shape[0], *values.shape))
        for name, (rule, positional) in pols.items():
          topk = rule(n)
          if positional:
            keep = jnp.broadcast_to(jnp.arange(n) >= n - topk, logits.shape)
          else:
            keep = theory.topk_mask(logits, topk)
          errs[name]["tv"].append(np.asarray(theory.tail_mass(logits, keep)))
          errs[name]["nc"].append(np.asarray(theory.row_l2_error(logits, keep)))
          errs[name]["out"].append(
            np.asarray(theory.head_tail_error(logits, keep, vals))
          )
        progress.update(1, f"a={a} n={n}")
      rec = dict(
        a=a,
        n=n,
        R=np.mean(rs),
        sigma=np.mean(sigmas),
        sigma_target=math.sqrt(2 * a * math.log(n)),
      )
      for e in config.effective_eps:
        rec[f"effective@{e}"] = np.concatenate(eff[e]).mean()
        rec[f"ineffective@{e}"] = np.concatenate(ineff[e]).mean()
      sparsity.append(writer.write("synthetic_sparsity", **rec))
      for name, (rule, _) in pols.items():
        policy_recs.append(
          writer.write(
            "synthetic_policy",
            a=a,
            n=n,
            policy=name,
            topk=rule(n),
            tv=np.concatenate(errs[name]["tv"]).mean(),
            nc_error=np.concatenate(errs[name]["nc"]).mean(),
            output_error=np.concatenate(errs[name]["out"]).mean(),
          )
        )
  return sparsity, policy_recs


def minilm_part(config, writer):
  cfg = config.minilm
  sparsity = []
  progress = _common.Progress("minilm", len(cfg.max_lens))
  for max_len in cfg.max_lens:
    rows = _data.minilm_rows(cfg.num_passages, max_len)
    mask = rows.real_row_mask()
    n = rows.key_mask.sum(-1)  # [G]
    for layer in range(rows.layer.max() + 1):
      sel = rows.layer == layer
      qm = rows.query_mask[sel]
      rec = dict(max_len=max_len, layer=layer, mean_n=n[sel].mean())
      for e in config.effective_eps:
        s = jnp.asarray(rows.logits[sel])
        m = jnp.asarray(mask[sel])
        rec[f"effective@{e}"] = np.asarray(
          theory.effective_entries(s, e, mask=m)
        )[qm].mean()
        rec[f"ineffective@{e}"] = np.asarray(
          theory.ineffective_fraction(s, e, mask=m)
        )[qm].mean()
      sparsity.append(writer.write("minilm_sparsity", **rec))
    progress.update(1, f"max_len={max_len}")
  # R per layer and head from the real weights (biases left out, as in
  # [NC]'s definition); B = largest |entry| of the layer's real inputs.
  a = _data.minilm_arrays(cfg.num_passages, max(cfg.max_lens))
  key_mask = np.asarray(a["key_mask"], bool)  # [B, S]
  # Each head's mean ineffective fraction at the longest n, beside its R.
  rows = _data.minilm_rows(cfg.num_passages, max(cfg.max_lens))
  e0 = config.effective_eps[0]
  ineff = np.asarray(
    theory.ineffective_fraction(
      jnp.asarray(rows.logits), e0, mask=jnp.asarray(rows.real_row_mask())
    )
  )  # [G, q]
  num_layers, num_heads = a["w_q"].shape[:2]
  per_group = np.nanmean(np.where(rows.query_mask, ineff, np.nan), -1)
  per_head = per_group.reshape(num_layers, -1, num_heads).mean(1)  # [L, H]
  r_recs = []
  for layer in range(num_layers):
    b = float(np.abs(a["inputs"][layer][key_mask]).max())
    rs = np.asarray(theory.weight_scale_R(a["w_q"][layer], a["w_k"][layer], b))
    for h, r in enumerate(rs):
      r_recs.append(
        writer.write(
          "minilm_R",
          layer=layer,
          head=h,
          B=b,
          R=r,
          **{f"ineffective@{e0}": per_head[layer, h]},
        )
      )
  return sparsity, r_recs


def plot(config, sparsity, policy_recs, minilm, workdir):
  e0 = config.effective_eps[0]
  fig, axes = _common.new_figure(ncols=4, size=(3.6, 3.2))
  ax = axes[0][0]
  for a in config.synthetic.growth:
    pts = [r for r in sparsity if r["a"] == a]
    ax.plot(
      [r["n"] for r in pts],
      [r[f"effective@{e0}"] for r in pts],
      "o-",
      label=f"a={a}",
    )
  ax.set_xscale("log")
  ax.set_xlabel("n")
  ax.set_ylabel(f"|S_eps|, eps={e0}")
  ax.set_title("synthetic: effective entries")
  ax.legend(fontsize=6)
  ax = axes[0][1]
  for a in config.synthetic.growth:
    pts = [r for r in sparsity if r["a"] == a]
    ax.plot(
      [r["n"] for r in pts],
      [r[f"ineffective@{e0}"] for r in pts],
      "o-",
      label=f"a={a}",
    )
  ax.set_xscale("log")
  ax.set_xlabel("n")
  ax.set_ylabel("ineffective fraction")
  ax.set_title("synthetic: collapse")
  ax = axes[0][2]
  a = max(config.synthetic.growth)
  for name in dict.fromkeys(r["policy"] for r in policy_recs):
    pts = [r for r in policy_recs if r["policy"] == name and r["a"] == a]
    ax.plot([r["n"] for r in pts], [r["tv"] for r in pts], "o-", label=name)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("n")
  ax.set_ylabel("mean TV = tau")
  ax.set_title(f"synthetic: kept sets, a={a}")
  ax.legend(fontsize=5)
  ax = axes[0][3]
  if minilm:
    for layer in sorted({r["layer"] for r in minilm}):
      pts = [r for r in minilm if r["layer"] == layer]
      ax.plot(
        [r["mean_n"] for r in pts],
        [r[f"effective@{e0}"] for r in pts],
        "o-",
        label=f"layer {layer}",
      )
    ax.set_xscale("log", base=2)
    lens = sorted({r["mean_n"] for r in minilm})
    ax.set_xticks(lens, [f"{x:.0f}" for x in lens])
    ax.minorticks_off()
    ax.legend(fontsize=5)
  ax.set_xlabel("n (tokens)")
  ax.set_ylabel(f"|S_eps|, eps={e0}")
  ax.set_title("MiniLM: effective entries")
  return _common.save_figure(fig, workdir, "nc_sparsity")


def run(config, workdir, *, overwrite: bool = False) -> dict:
  """Runs the experiment into ``workdir``; returns the records."""
  workdir = _common.prepare_workdir(workdir, overwrite=overwrite)
  _common.write_config(workdir, config)
  writer = _common.MetricWriter(workdir)
  sparsity, policy_recs = synthetic(config, writer)
  minilm, r_recs = [], []
  if config.minilm.enabled:
    minilm, r_recs = minilm_part(config, writer)
  plot(config, sparsity, policy_recs, minilm, workdir)
  eff = [f"effective@{e}" for e in config.effective_eps]
  ineff = [f"ineffective@{e}" for e in config.effective_eps]
  lines = [
    "Synthetic [NC] layer: sigma(n) = sqrt(2 a ln n), R = B^2 ||W_Q W_K^T||_F",
    _common.format_table(sparsity, ["a", "n", "R", "sigma"] + eff + ineff),
    "",
    "Kept sets (mean over query rows): TV, [NC] row error, output error",
    _common.format_table(
      policy_recs,
      ["a", "n", "policy", "topk", "tv", "nc_error", "output_error"],
    ),
  ]
  if minilm:
    rs = np.array([r["R"] for r in r_recs])
    e0 = config.effective_eps[0]
    fr = np.array([r[f"ineffective@{e0}"] for r in r_recs])
    rank = lambda x: np.argsort(np.argsort(x))
    spearman = np.corrcoef(rank(rs), rank(fr))[0, 1]
    lines += [
      "",
      "MiniLM per layer (real text)",
      _common.format_table(
        minilm, ["max_len", "layer", "mean_n"] + eff + ineff
      ),
      "",
      f"MiniLM R = B^2 ||W_Q^h W_K^h^T||_F over {len(rs)} heads: min"
      f" {rs.min():.4g}, median {np.median(rs):.4g}, max {rs.max():.4g};"
      f" Spearman correlation of R with the head's ineffective fraction"
      f" (eps={e0}, n={max(config.minilm.max_lens)}): {spearman:.3f}",
    ]
  _common.write_summary(workdir, "\n".join(lines))
  return {
    "synthetic_sparsity": sparsity,
    "synthetic_policy": policy_recs,
    "minilm_sparsity": minilm,
    "minilm_R": r_recs,
  }


if __name__ == "__main__":
  _common.app_main(NAME, run)
