r"""Output error of Top-k attention on MiniLM: the identity and three bounds.

THEORY 4 ([TV]). For every layer, head and query row of all-MiniLM-L6-v2 on
real text, and each kept fraction rho (exact Top-k, topk = ceil(rho * n)):

- the real error ||Attn - Attn_k||_2, computed densely in float64;
- the head-tail identity Attn - Attn_k = tau (mu_tail - mu_head) (4.1), as
  computed by the library, and its largest absolute deviation from the real
  error vector (a check, should be float32 round-off);
- the diameter bound tau * max_{i in H, j in T} ||v_i - v_j|| (4.2), the
  value-norm bound tau (||mu_head|| + max_j ||v_j||) (4.2) and the variance
  bound sqrt(tau / (1 - tau) Var_P(V)) (4.3): bound / real error quantiles
  and the fraction of rows where the bound holds.

Outputs: config.json, metrics.jsonl (kinds "identity", "output_bound"),
output_error.png, summary.txt.

  python -m experiments.output_error --workdir=workdirs/output_error
"""

import jax.numpy as jnp
import numpy as np

from experiments import _common
from experiments import _data
from jaxtopk import theory

NAME = "output_error"
BOUNDS = ("diameter", "value_norm", "variance")


# Groups of query rows handled per library call (bounds memory: the values
# are broadcast to [chunk, q, s, dv]).
_CHUNK = 16
# Relative round-up of float32 tau and norms fed to value_norm_bound, so its
# arguments are upper bounds as it requires (THEORY 4.4).
_ROUND_UP = 1e-5


def dense_errors64(logits, key_mask, keep, values):
  """float64 ||Attn - Attn_k||_2 two ways, ``[g, q]`` each.

  - naive: the two attention outputs computed densely and subtracted, as
    a user would check it; loses all accuracy once tau is below ~1e-12
    (the two outputs agree to float64 round-off);
  - stable: sum_i c_i v_i with per-key coefficients c_i = P_i - P_hat_i
    written without cancellation: P_i on the tail, -P_i Z_T / Z_H on the
    head (THEORY 2.3). Accurate for any tau; the truth the bounds are held
    to.

  Args:
    logits: ``[g, q, s]``; key_mask: ``[g, s]``; keep: ``[g, q, s]`` bool;
    values: ``[g, s, dv]``.

  Returns:
    ``(naive, stable)``.
  """
  s = logits.astype(np.float64)
  mask = np.broadcast_to(key_mask[:, None, :], s.shape)
  keep = keep & mask
  tail = mask & ~keep
  m = np.max(np.where(mask, s, -np.inf), -1, keepdims=True)
  e = np.where(mask, np.exp(s - m), 0.0)  # [g, q, s]
  z = e.sum(-1, keepdims=True)
  z_head = np.where(keep, e, 0.0).sum(-1, keepdims=True)
  z_tail = np.where(tail, e, 0.0).sum(-1, keepdims=True)
  p = e / z
  pk = np.where(keep, e, 0.0) / np.maximum(z_head, 1e-300)
  v = values.astype(np.float64)  # [g, s, dv]
  naive = np.einsum("gqs,gsd->gqd", p - pk, v)  # [g, q, dv]
  coef = np.where(tail, p, 0.0) - np.where(
    keep, p * z_tail / np.maximum(z_head, 1e-300), 0.0
  )  # [g, q, s]
  stable = np.einsum("gqs,gsd->gqd", coef, v)  # [g, q, dv]
  return np.linalg.norm(naive, axis=-1), np.linalg.norm(stable, axis=-1)


def _chunk_errors(rows: _data.Rows, idx, topk: int) -> dict:
  """Real error, identity and the three bounds for groups ``idx``."""
  s = jnp.asarray(rows.logits[idx])  # [g, q, s]
  g, nq, n = s.shape
  m = jnp.asarray(rows.real_row_mask()[idx])
  v = jnp.broadcast_to(
    jnp.asarray(rows.values[idx])[:, None], (g, nq, n, rows.values.shape[-1])
  )  # [g, q, s, dv]
  keep = theory.topk_mask(s, topk, mask=m)
  naive, stable = dense_errors64(
    rows.logits[idx], rows.key_mask[idx], np.asarray(keep), rows.values[idx]
  )
  out = {
    "naive": naive,
    "real": stable,
    "identity": theory.head_tail_error(s, keep, v, mask=m),
    "diameter": theory.diameter_bound(s, keep, v, mask=m),
    "variance": theory.variance_bound(s, keep, v, mask=m),
  }
  # Value-norm form (4.2, no tail value): t (||mu_head|| + max_j ||v_j||),
  # with t, ||mu_head|| and max_j ||v_j|| rounded up.
  ht = theory.head_tail_means(s, keep, v, mask=m)
  up = 1.0 + _ROUND_UP
  vnorm = jnp.linalg.norm(jnp.asarray(rows.values[idx]), axis=-1)  # [g, s]
  vmax = jnp.max(jnp.where(rows.key_mask[idx], vnorm, 0.0), -1)  # [g]
  out["value_norm"] = theory.value_norm_bound(
    jnp.minimum(ht.tau * up, 1.0),
    jnp.linalg.norm(ht.mu_head, axis=-1) * up,
    vmax[:, None] * up,
  )
  return {k: np.asarray(x, np.float64) for k, x in out.items()}


def analyse(rows: _data.Rows, rho: float, writer):
  """Identity and bound records for one kept fraction ``rho``."""
  n = rows.key_mask.sum(-1)  # [G]
  topk = np.maximum(1, np.ceil(rho * n)).astype(int)  # [G]
  qmask = rows.query_mask
  names = ("naive", "real", "identity", *BOUNDS)
  res = {k: np.zeros(qmask.shape) for k in names}
  for t in np.unique(topk):
    groups = np.nonzero(topk == t)[0]
    for start in range(0, groups.size, _CHUNK):
      idx = groups[start : start + _CHUNK]
      for k, x in _chunk_errors(rows, idx, int(t)).items():
        res[k][idx] = x
  real = res["real"][qmask]  # [rows]
  ident = res["identity"][qmask]
  dev = np.abs(ident - real)
  big = real > 1e-3  # rows where a relative deviation is meaningful
  ident = writer.write(
    "identity",
    rho=rho,
    rows=int(qmask.sum()),
    # Library identity (float32) vs the naive dense float64 subtraction.
    max_abs_dev_naive=np.abs(ident - res["naive"][qmask]).max(),
    # ... and vs the cancellation-free float64 error.
    max_abs_dev=dev.max(),
    max_rel_dev=(dev[big] / real[big]).max() if big.any() else 0.0,
    max_real_error=real.max(),
    mean_real_error=real.mean(),
  )
  out, scatter = [], {}
  for name in BOUNDS:
    b = res[name][qmask]
    pos = real > 0
    ratio = b[pos] / real[pos]
    out.append(
      writer.write(
        "output_bound",
        rho=rho,
        bound=name,
        rows=int(qmask.sum()),
        sound_frac=float(np.mean(b >= real)),
        ratio_min=ratio.min(),
        ratio_median=np.median(ratio),
        ratio_p90=np.quantile(ratio, 0.9),
        mean_bound=b.mean(),
        mean_real_error=real.mean(),
      )
    )
    scatter[name] = (real, b)
  return ident, out, scatter


def plot(scatters, workdir, points, seed):
  fig, axes = _common.new_figure(ncols=len(BOUNDS), size=(3.6, 3.4))
  rng = np.random.default_rng(seed)
  for ax, name in zip(axes[0], BOUNDS, strict=True):
    for i, (rho, sc) in enumerate(scatters.items()):
      real, b = sc[name]
      draw = rng.permutation(real.size)[:points]
      ax.scatter(
        real[draw], b[draw], s=2, alpha=0.3, color=f"C{i}", label=f"rho={rho}"
      )
    reals = np.concatenate([sc[name][0] for sc in scatters.values()])
    lo, hi = reals[reals > 0].min(), reals.max()
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.7)  # bound = real error
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("real ||Attn - Attn_k||")
    ax.set_ylabel(f"{name} bound")
    ax.set_title(name)
  axes[0][0].legend(fontsize=6, markerscale=4)
  return _common.save_figure(fig, workdir, "output_error")


def run(config, workdir, *, overwrite: bool = False) -> dict:
  """Runs the experiment into ``workdir``; returns the records."""
  workdir = _common.prepare_workdir(workdir, overwrite=overwrite)
  _common.write_config(workdir, config)
  writer = _common.MetricWriter(workdir)
  rows = _data.minilm_rows(config.minilm.num_passages, config.minilm.max_len)
  idents, bounds, scatters = [], [], {}
  progress = _common.Progress("rho", len(config.rhos))
  for rho in config.rhos:
    ident, out, scatter = analyse(rows, rho, writer)
    idents.append(ident)
    bounds += out
    scatters[rho] = scatter
    progress.update(1, f"rho={rho}")
  plot(scatters, workdir, config.scatter_points, config.seed)
  text = "\n".join(
    [
      "Head-tail identity (THEORY 4.1, float32) vs dense float64 error,"
      " MiniLM rows (max_rel_dev over rows with error > 1e-3)",
      _common.format_table(
        idents,
        [
          "rho",
          "rows",
          "max_abs_dev_naive",
          "max_abs_dev",
          "max_rel_dev",
          "mean_real_error",
        ],
      ),
      "",
      "Output-error bounds (THEORY 4.2-4.3) / real error",
      _common.format_table(
        bounds,
        [
          "rho",
          "bound",
          "sound_frac",
          "ratio_min",
          "ratio_median",
          "ratio_p90",
          "mean_bound",
          "mean_real_error",
        ],
      ),
    ]
  )
  _common.write_summary(workdir, text)
  return {"identity": idents, "output_bound": bounds}


if __name__ == "__main__":
  _common.app_main(NAME, run)
