r"""How loose is each tail bound? bound / exact tau on synthetic and real rows.

THEORY 3.1-3.3 ([TV] names the hierarchy). For each row and kept fraction
rho, with topk = ceil(rho * n):

- single-gap, exact-head form and ratio form (3.1), for the exact Top-k set;
- multi-gap with doubling groups (3.2), for the exact Top-k set;
- blockwise (3.3) with box and with ball block bounds: key blocks are scored
  in descending order of their upper bound until at least
  scored_factor * topk keys are scored, the Top-k of the scored keys is kept,
  and the rest of the blocks enter the bound through |B_b| e^{u_b}.

Each bound is divided by the exact tau OF THE SAME KEPT SET, computed in
float64 (for blockwise, from float64 q.k, since the bound is computed from
q and k). A ratio >= 1 on every row is the soundness promise; the records
carry the fraction of sound rows beside the ratio's quantiles.

Outputs: config.json, metrics.jsonl (kind "tightness"), tightness.png,
summary.txt.

  python -m experiments.bound_tightness --workdir=workdirs/bound_tightness
"""

import jax.numpy as jnp
import numpy as np

from experiments import _common
from experiments import _data
from jaxtopk import theory

NAME = "bound_tightness"
BOUNDS = (
  "single_gap_exact_head",
  "single_gap_ratio",
  "multi_gap",
  "blockwise_box",
  "blockwise_ball",
)


def _topk_per_group(rows: _data.Rows, rho: float) -> np.ndarray:
  n = rows.key_mask.sum(-1)  # [G]
  return np.maximum(1, np.ceil(rho * n)).astype(np.int32)


def _by_topk(fn, topk: np.ndarray):
  """Calls ``fn(group_index_array, topk_value)`` once per distinct topk."""
  out = {}
  for t in np.unique(topk):
    out[int(t)] = (np.nonzero(topk == t)[0], fn(np.nonzero(topk == t)[0], t))
  return out


def _merge(parts, shape):
  out = np.empty(shape, np.float64)
  for idx, val in parts.values():
    out[idx] = val
  return out


def logit_bounds(rows: _data.Rows, rho: float) -> dict:
  """Log bounds from the logits alone (3.1, 3.2) and the float64 truth."""
  topk = _topk_per_group(rows, rho)
  mask = rows.real_row_mask()  # [G, q, s]
  shape = rows.logits.shape[:2]

  def one(idx, t):
    s = jnp.asarray(rows.logits[idx])  # [g, q, s]
    m = jnp.asarray(mask[idx])
    keep = np.asarray(theory.topk_mask(s, int(t), mask=m))
    res = {"exact": _data.np_log_tail_mass64(rows.logits[idx], keep, mask[idx])}
    for form in ("exact_head", "ratio"):
      b = theory.single_gap_bound(s, int(t), mask=m, form=form)
      res[f"single_gap_{form}"] = np.log(np.asarray(b, np.float64))
    b = theory.multi_gap_bound(s, int(t), mask=m)
    res["multi_gap"] = np.log(np.asarray(b, np.float64))
    return res

  parts = _by_topk(one, topk)
  names = ["exact", "single_gap_exact_head", "single_gap_ratio", "multi_gap"]
  return {
    name: _merge(
      {t: (idx, res[name]) for t, (idx, res) in parts.items()}, shape
    )
    for name in names
  }


def _scored_blocks(upper, count, target):
  """Blocks scored in descending ``upper`` until >= target keys are scored.

  Args:
    upper: ``[..., nb]`` block upper bounds (-inf for empty blocks).
    count: ``[..., nb]`` real keys per block.
    target: number of keys to reach (broadcastable to ``[...]``).

  Returns:
    ``[..., nb]`` bool, True for a scored block.
  """
  order = np.argsort(-upper, axis=-1, kind="stable")
  cnt_sorted = np.take_along_axis(count, order, -1)
  before = np.cumsum(cnt_sorted, -1) - cnt_sorted  # keys scored before it
  scored_sorted = before < np.asarray(target)[..., None]
  scored = np.empty_like(scored_sorted)
  np.put_along_axis(scored, order, scored_sorted, -1)
  return scored


def blockwise_bounds(rows: _data.Rows, rho: float, block_size: int, factor):
  """Log blockwise bounds (box, ball) and the float64 truth of each H."""
  topk = _topk_per_group(rows, rho)
  keys = jnp.asarray(rows.keys)  # [G, s, d]
  kmask = jnp.asarray(rows.key_mask)  # [G, s]
  q = jnp.asarray(rows.queries)  # [G, q, d]
  g, nq, n = rows.logits.shape
  s64 = _data.logits64(rows)  # [G, q, s]
  mask = rows.real_row_mask()
  summaries = {
    "box": (
      theory.box_summary(keys, block_size=block_size, mask=kmask),
      theory.box_upper_bound,
    ),
    "ball": (
      theory.ball_summary(keys, block_size=block_size, mask=kmask),
      theory.ball_upper_bound,
    ),
  }
  out = {}
  for name, (summary, upper_fn) in summaries.items():
    # Summaries are [G, nb, ...]; add the query axis to broadcast.
    summary_q = type(summary)(
      *(
        jnp.expand_dims(x, 1)
        for x in (getattr(summary, f) for f in summary.__dataclass_fields__)
      )
    )
    upper = np.asarray(upper_fn(q, summary_q, scale=rows.scale))  # [G,q,nb]
    count = np.broadcast_to(np.asarray(summary.count)[:, None], upper.shape)
    target = np.ceil(factor * topk)[:, None]  # [G, 1]
    scored_blk = _scored_blocks(upper, count, target)  # [G, q, nb]
    blk_of_key = np.arange(n) // block_size
    scored = scored_blk[..., blk_of_key] & mask  # [G, q, s]
    bound = np.empty((g, nq))
    exact = np.empty((g, nq))
    for t in np.unique(topk):
      idx = np.nonzero(topk == t)[0]
      s = jnp.asarray(rows.logits[idx])
      keep = np.asarray(
        theory.topk_mask(s, int(t), mask=jnp.asarray(scored[idx]))
      )
      lb = theory.blockwise_log_bound(
        s,
        keep,
        scored[idx],
        np.where(scored_blk[idx], -np.inf, upper[idx]),
        np.where(scored_blk[idx], 0, count[idx]),
        mask=mask[idx],
      )
      bound[idx] = np.asarray(lb, np.float64)
      exact[idx] = _data.np_log_tail_mass64(s64[idx], keep, mask[idx])
    out[f"blockwise_{name}"] = (bound, exact)
  return out


def tightness_records(writer, source, rho, logb, rows: _data.Rows):
  """One record per bound: quantiles of bound / exact and soundness."""
  qmask = rows.query_mask  # [G, q]
  records = []
  for name in BOUNDS:
    if name not in logb:
      continue
    bound, exact = logb[name]
    bound, exact = bound[qmask], exact[qmask]
    # Rows whose exact tail is 0 (nothing outside H) carry no ratio.
    has_tail = np.isfinite(exact)
    log_ratio = (bound - exact)[has_tail]
    ratio = np.exp(log_ratio)
    records.append(
      writer.write(
        "tightness",
        source=source,
        rho=rho,
        bound=name,
        rows=int(qmask.sum()),
        rows_with_tail=int(has_tail.sum()),
        sound_frac=float(np.mean(bound >= exact)),
        ratio_min=ratio.min() if ratio.size else float("nan"),
        ratio_p10=np.quantile(ratio, 0.1) if ratio.size else float("nan"),
        ratio_median=np.median(ratio) if ratio.size else float("nan"),
        ratio_p90=np.quantile(ratio, 0.9) if ratio.size else float("nan"),
        ratio_max=ratio.max() if ratio.size else float("nan"),
        exact_median=float(np.median(np.exp(exact))),
      )
    )
  return records


def analyse(writer, source, rows, config, block_size):
  records = []
  for rho in config.rhos:
    logb = logit_bounds(rows, rho)
    exact = logb.pop("exact")
    logb = {k: (v, exact) for k, v in logb.items()}
    if rows.keys is not None:
      logb.update(blockwise_bounds(rows, rho, block_size, config.scored_factor))
    records += tightness_records(writer, source, rho, logb, rows)
  return records


def plot(records, workdir):
  """Median bound / exact per bound and rho, bars from p10 to p90."""
  sources = list(dict.fromkeys(r["source"] for r in records))
  rhos = sorted({r["rho"] for r in records})
  ncols = min(2, len(sources))
  nrows = -(-len(sources) // ncols)
  fig, axes = _common.new_figure(ncols=ncols, nrows=nrows, size=(5.0, 3.2))
  flat = [ax for row in axes for ax in row]
  width = 0.8 / len(rhos)
  for ax, source in zip(flat, sources, strict=False):
    for j, rho in enumerate(rhos):
      pts = {
        r["bound"]: r
        for r in records
        if r["source"] == source and r["rho"] == rho
      }
      xs = [i + (j - (len(rhos) - 1) / 2) * width for i in range(len(BOUNDS))]
      med = np.array([pts[b]["ratio_median"] for b in BOUNDS])
      lo = np.array([pts[b]["ratio_p10"] for b in BOUNDS])
      hi = np.array([pts[b]["ratio_p90"] for b in BOUNDS])
      ax.errorbar(
        xs,
        med,
        yerr=[med - lo, hi - med],
        fmt="o",
        ms=3,
        capsize=2,
        color=f"C{j}",
        label=f"rho={rho}",
      )
    ax.set_yscale("log")
    ax.axhline(1.0, color="k", lw=0.7)
    ax.set_xticks(range(len(BOUNDS)))
    ax.set_xticklabels(
      [
        b.replace("single_gap_", "1gap ")
        .replace("blockwise_", "block ")
        .replace("multi_gap", "multi-gap")
        .replace("exact_head", "head")
        for b in BOUNDS
      ],
      fontsize=7,
    )
    ax.set_ylabel("bound / exact tau")
    ax.set_title(source, fontsize=9)
    ax.legend(fontsize=6)
  for ax in flat[len(sources) :]:
    ax.axis("off")
  return _common.save_figure(fig, workdir, "tightness")


def run(config, workdir, *, overwrite: bool = False) -> dict:
  """Runs the experiment into ``workdir``; returns the records."""
  import jax

  workdir = _common.prepare_workdir(workdir, overwrite=overwrite)
  _common.write_config(workdir, config)
  writer = _common.MetricWriter(workdir)
  records = []
  if config.synthetic.enabled:
    cfg = config.synthetic
    key = jax.random.key(config.seed)
    progress = _common.Progress("synthetic", len(cfg.sigmas))
    for sigma in cfg.sigmas:
      key, sub = jax.random.split(key)
      rows = _data.gaussian_qk(
        sub,
        groups=cfg.groups,
        queries=cfg.queries,
        n=cfg.n,
        head_dim=cfg.head_dim,
        sigma=sigma,
      )
      records += analyse(
        writer, f"gaussian sigma={sigma}", rows, config, config.block_size
      )
      progress.update(1, f"sigma={sigma}")
  if config.minilm.enabled:
    rows = _data.minilm_rows(config.minilm.num_passages, config.minilm.max_len)
    records += analyse(writer, "minilm", rows, config, config.minilm_block_size)
  plot(records, workdir)
  cols = [
    "source",
    "rho",
    "bound",
    "sound_frac",
    "ratio_min",
    "ratio_median",
    "ratio_p90",
    "ratio_max",
    "exact_median",
  ]
  _common.write_summary(
    workdir,
    "bound / exact tau (THEORY 3.1-3.3), float64 truth of the same kept set\n"
    + _common.format_table(records, cols),
  )
  return {"tightness": records}


if __name__ == "__main__":
  _common.app_main(NAME, run)
