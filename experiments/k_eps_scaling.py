r"""k_eps / n observed vs predicted: Gaussian logits and real MiniLM rows.

THEORY 5.3-5.5 ([TV]). k_eps is the fewest kept keys whose discarded tail
mass tau is at most eps. For iid Gaussian logits of spread sigma the rule
k_eps / n ~ Phi_c(sigma + Phi^{-1}(eps)) (5.3) holds only while sigma is well
below sqrt(2 ln n) (5.4); beyond it the largest logits dominate Z. This binary

1. sweeps sigma, n (512 to 131,072) and eps (0.001 to 0.2) on Gaussian rows,
   and records the observed k_eps / n (mean over rows), the asymptotic rule
   and the library's exact finite-n expectation, and the sigma where the rule
   and the finite-n expectation part, beside sqrt(2 ln n);
2. runs all-MiniLM-L6-v2 on real text and, for every layer, head and query
   row, fits sigma (sample std of the row's logits, 5.5), predicts k_eps with
   the rule and measures the real k_eps; reports the prediction error and the
   average reduction in kept keys at each eps ([TV]'s BERT experiment).

Outputs in the workdir: config.json, metrics.jsonl (kinds "gaussian",
"gaussian_part", "minilm_summary"), k_eps_vs_sigma.png,
minilm_pred_vs_obs.png, summary.txt.

Default run (a few minutes on a 2-core CPU; workdir ./workdirs/k_eps_scaling):
  python -m experiments.k_eps_scaling
Smoke run (seconds):
  python -m experiments.k_eps_scaling \
    --config=experiments/configs/k_eps_scaling.py:smoke \
    --workdir=/tmp/k_eps_smoke --overwrite
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from experiments import _common
from experiments import _data
from jaxtopk import theory

NAME = "k_eps_scaling"
DEFAULT_WORKDIR = "./workdirs/k_eps_scaling"


def _rows_per_point(cfg, n: int) -> int:
  return max(cfg.min_rows, cfg.elements_per_point // n)


@functools.cache
def _k_eps_all(epss):
  """jit of k_eps at every eps; XLA shares the one sort among them."""
  return jax.jit(lambda s: jnp.stack([theory.k_eps(s, e) for e in epss]))


def _observed_k_eps(key, n, sigma, epss, num_rows):
  """Mean and std error of k_eps / n over ``num_rows`` Gaussian rows."""
  logits = sigma * jax.random.normal(key, (num_rows, n), jnp.float32)
  k = np.asarray(_k_eps_all(tuple(epss))(logits), np.float64)  # [eps, rows]
  fracs = k / n
  mean = fracs.mean(axis=1)
  se = fracs.std(axis=1, ddof=1) / math.sqrt(num_rows)
  return mean, se


def gaussian_sweep(config, writer) -> list[dict]:
  """THEORY 5.3-5.4 on synthetic rows; one metrics record per point."""
  cfg = config.gaussian
  key = jax.random.key(config.seed)
  records = []
  progress = _common.Progress("gaussian", len(cfg.ns) * len(cfg.sigmas))
  for n in cfg.ns:
    num_rows = _rows_per_point(cfg, n)
    for sigma in cfg.sigmas:
      key, k_obs, k_fin = jax.random.split(key, 3)
      obs, obs_se = _observed_k_eps(k_obs, n, sigma, config.epss, num_rows)
      for i, eps in enumerate(config.epss):
        rule = float(theory.gaussian_k_eps_rule(sigma, eps))
        k_fin, sub = jax.random.split(k_fin)
        fin, fin_se, fin_lo, fin_hi = (
          float(x)
          for x in theory.gaussian_k_eps_finite_n(
            sub, n, sigma, eps, num_samples=cfg.finite_n_samples
          )
        )
        records.append(
          writer.write(
            "gaussian",
            n=n,
            sigma=sigma,
            eps=eps,
            sqrt_2ln_n=math.sqrt(2 * math.log(n)),
            rows=num_rows,
            observed=obs[i],
            observed_se=obs_se[i],
            rule=rule,
            finite_n=fin,
            finite_n_se=fin_se,
            finite_n_ci_low=fin_lo,
            finite_n_ci_high=fin_hi,
          )
        )
      progress.update(1, f"n={n} sigma={sigma}")
  return records


def part_points(config, records, writer) -> list[dict]:
  """Smallest sigma per (n, eps) where the rule leaves the finite-n value."""
  cfg = config.gaussian
  out = []
  for n in cfg.ns:
    for eps in config.epss:
      pts = sorted(
        (r for r in records if r["n"] == n and r["eps"] == eps),
        key=lambda r: r["sigma"],
      )
      # Parted: the rule lies outside the finite-n confidence interval
      # widened by the relative margin part_rtol.
      parted = [
        r["sigma"]
        for r in pts
        if r["rule"] * (1 + cfg.part_rtol) < r["finite_n_ci_low"]
        or r["rule"] > r["finite_n_ci_high"] * (1 + cfg.part_rtol)
      ]
      out.append(
        writer.write(
          "gaussian_part",
          n=n,
          eps=eps,
          sqrt_2ln_n=math.sqrt(2 * math.log(n)),
          part_sigma=parted[0] if parted else float("nan"),
        )
      )
  return out


def minilm_rows(cfg):
  """Every real query row of every MiniLM layer and head on real text.

  Returns:
    ``(logits, mask, layer)``: ``[rows, max_len]`` float32 logits,
    ``[rows, max_len]`` bool key mask (True = real key), ``[rows]`` layer
    index; only rows whose query is a real token are kept.
  """
  rows = _data.minilm_rows(cfg.num_passages, cfg.max_len)
  sel = rows.query_mask  # [G, q]
  layer = np.broadcast_to(rows.layer[:, None], sel.shape)
  return rows.logits[sel], rows.real_row_mask()[sel], layer[sel]


def minilm_fit(config, writer):
  """THEORY 5.5 on real rows: fitted sigma, predicted vs observed k_eps."""
  cfg = config.minilm
  logits, mask, layer = minilm_rows(cfg)
  n = mask.sum(-1)  # [rows]
  keep = n >= cfg.min_keys
  logits, mask, layer, n = logits[keep], mask[keep], layer[keep], n[keep]
  logging.info("minilm: %d rows (n from %d to %d)", len(n), n.min(), n.max())
  # Sample std over real keys (ddof=1): the fitted sigma of THEORY 5.5.
  sigma = np.sqrt(
    np.var(logits, axis=-1, where=mask, ddof=1, dtype=np.float64)
  )  # [rows]
  rng = np.random.default_rng(config.seed)
  draw = rng.permutation(len(n))[: cfg.scatter_points]
  summaries, scatter = [], {}
  progress = _common.Progress("minilm", len(config.epss))
  for eps in config.epss:
    observed = np.asarray(
      theory.k_eps(jnp.asarray(logits), eps, mask=jnp.asarray(mask)),
      np.float64,
    )  # [rows]
    rule = np.asarray(theory.gaussian_k_eps_rule(sigma, eps), np.float64)
    predicted = np.clip(np.ceil(rule * n), 1, n)  # [rows]
    obs_frac, pred_frac = observed / n, predicted / n
    err = pred_frac - obs_frac
    by_layer = [
      float(obs_frac[layer == i].mean()) for i in range(layer.max() + 1)
    ]
    summaries.append(
      writer.write(
        "minilm_summary",
        eps=eps,
        rows=len(n),
        mean_n=n.mean(),
        mean_sigma=sigma.mean(),
        observed_frac=obs_frac.mean(),
        predicted_frac=pred_frac.mean(),
        mean_abs_err=np.abs(err).mean(),
        mean_err=err.mean(),
        corr=np.corrcoef(pred_frac, obs_frac)[0, 1],
        median_ratio=np.median(predicted / observed),
        within_2x=np.mean(
          (predicted <= 2 * observed) & (observed <= 2 * predicted)
        ),
        # Fraction of keys dropped on average, and total keys over total
        # kept keys (the compute saving), and the per-row mean of n / k.
        reduction=1.0 - obs_frac.mean(),
        n_over_mean_k=n.mean() / observed.mean(),
        mean_n_over_k=(n / observed).mean(),
        observed_frac_by_layer=by_layer,
        k_in_range=bool(np.all((observed >= 1) & (observed <= n))),
      )
    )
    scatter[eps] = (pred_frac[draw], obs_frac[draw])
    progress.update(1, f"eps={eps}")
  return summaries, scatter, sigma


def plot_gaussian(config, records, workdir):
  """k_eps/n vs sigma per eps: rule curve, observed points, finite-n."""
  epss = config.epss
  fig, axes = _common.new_figure(ncols=len(epss), size=(3.6, 3.2))
  grid = np.linspace(0.0, max(config.gaussian.sigmas) + 0.25, 200)
  colors = ["C0", "C1", "C2", "C3", "C4", "C5"]
  for ax, eps in zip(axes[0], epss, strict=True):
    ax.plot(
      grid,
      np.asarray(theory.gaussian_k_eps_rule(grid, eps)),
      "k-",
      lw=1.2,
      label="rule 5.3",
    )
    for j, n in enumerate(config.gaussian.ns):
      pts = sorted(
        (r for r in records if r["n"] == n and r["eps"] == eps),
        key=lambda r: r["sigma"],
      )
      c = colors[j % len(colors)]
      s = [r["sigma"] for r in pts]
      ax.plot(s, [r["finite_n"] for r in pts], "--", color=c, lw=0.9)
      ax.plot(
        s, [r["observed"] for r in pts], "o", color=c, ms=3, label=f"n={n}"
      )
      ax.axvline(math.sqrt(2 * math.log(n)), color=c, lw=0.5, ls=":")
    ax.set_yscale("log")
    ax.set_ylim(max(0.5 / max(config.gaussian.ns), 1e-6), 1.1)
    ax.set_xlabel("sigma")
    ax.set_title(f"eps={eps}")
  axes[0][0].set_ylabel("k_eps / n  (o observed, -- finite-n)")
  axes[0][0].legend(fontsize=6)
  return _common.save_figure(fig, workdir, "k_eps_vs_sigma")


def plot_minilm(scatter, workdir):
  """Predicted (rule with fitted sigma) vs observed k_eps/n per row."""
  fig, axes = _common.new_figure(size=(4.2, 4.0))
  ax = axes[0][0]
  for i, (eps, (pred, obs)) in enumerate(scatter.items()):
    ax.scatter(pred, obs, s=2, alpha=0.3, color=f"C{i}", label=f"eps={eps}")
  ax.plot([1e-3, 1], [1e-3, 1], "k-", lw=0.8)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("predicted k_eps/n (rule, fitted sigma)")
  ax.set_ylabel("observed k_eps/n")
  ax.set_title("MiniLM rows, all layers and heads")
  ax.legend(fontsize=6, markerscale=4)
  return _common.save_figure(fig, workdir, "minilm_pred_vs_obs")


def summary_text(config, records, parts, minilm) -> str:
  lines = []
  if records:
    rows = []
    for n in config.gaussian.ns:
      for sigma in config.gaussian.sigmas:
        row = {"n": n, "sigma": sigma}
        for r in records:
          if r["n"] == n and r["sigma"] == sigma:
            row[f"eps={r['eps']}"] = (
              f"{r['observed']:.3g}/{r['finite_n']:.3g}/{r['rule']:.3g}"
            )
        rows.append(row)
    cols = ["n", "sigma"] + [f"eps={e}" for e in config.epss]
    lines += [
      "Gaussian logits: k_eps/n as observed / finite-n / rule (THEORY 5.3-5.4)",
      _common.format_table(rows, cols),
      "",
      "Smallest sigma where rule and finite-n part, vs sqrt(2 ln n):",
      _common.format_table(parts, ["n", "eps", "sqrt_2ln_n", "part_sigma"]),
      "",
    ]
  if minilm:
    lines += [
      "MiniLM (all layers, heads, real query rows): fitted-sigma rule vs"
      " observed k_eps (THEORY 5.5)",
      _common.format_table(
        minilm,
        [
          "eps",
          "rows",
          "mean_sigma",
          "observed_frac",
          "predicted_frac",
          "mean_abs_err",
          "corr",
          "within_2x",
          "reduction",
          "n_over_mean_k",
          "mean_n_over_k",
        ],
      ),
    ]
  return "\n".join(lines)


def run(config, workdir, *, overwrite: bool = False) -> dict:
  """Runs the experiment into ``workdir``; returns the summary records."""
  workdir = _common.prepare_workdir(workdir, overwrite=overwrite)
  _common.write_config(workdir, config)
  writer = _common.MetricWriter(workdir)
  records, parts, minilm = [], [], []
  if config.gaussian.enabled:
    records = gaussian_sweep(config, writer)
    parts = part_points(config, records, writer)
    plot_gaussian(config, records, workdir)
  if config.minilm.enabled:
    minilm, scatter, _ = minilm_fit(config, writer)
    plot_minilm(scatter, workdir)
  _common.write_summary(workdir, summary_text(config, records, parts, minilm))
  return {"gaussian": records, "parts": parts, "minilm": minilm}


if __name__ == "__main__":
  _common.app_main(NAME, run, default_workdir=DEFAULT_WORKDIR)
