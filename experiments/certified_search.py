r"""Certified search: keys scored by Delta-Search and MC-Search vs eps.

THEORY 6 ([TV]). For each row (one query over its keys), TV budget eps and
search method ('exact' scores every key; 'delta' scores key blocks in order
of their box/ball logit bound until the blockwise bound certifies eps;
'mc' replaces unscored blocks by a Hoeffding estimate from sampled keys),
``jaxtopk.selection.certified_search`` returns the kept set and a
Certificate. We record

- keys scored per row (q.k products, THEORY 6.4) and the reduction
  n / keys_scored, the [TV] claim being 2-4x fewer scored keys at the budget;
- keys kept, beside the minimal k_eps (``theory.k_eps`` on the dense row);
- soundness on EVERY row: the certificate's tv_bound is >= the float64 tau
  of its kept set (from float64 q.k), and tv_bound <= eps; for 'mc' the
  empirical failure rate is compared with its delta.

Sources: synthetic Gaussian q, k (logit std ~ sigma) and all-MiniLM-L6-v2
on real text (every layer, head and real query row).

Outputs: config.json, metrics.jsonl (kind "search"), certified_search.png,
summary.txt.

  python -m experiments.certified_search --workdir=workdirs/certified_search
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl import app

import jaxtopk
from experiments import _common
from experiments import _data
from jaxtopk import theory
from jaxtopk.selection import certified_search

NAME = "certified_search"
# Query groups per certified_search call (keys are broadcast per query row,
# [chunk, q, s, d], so this bounds memory).
_CHUNK = 8


def search_rows(rows: _data.Rows, policy, key):
  """Runs ``certified_search`` on every row; returns per-row numpy arrays."""
  g, nq, n = rows.logits.shape
  out = {k: np.zeros((g, nq)) for k in ("tv_bound", "scored", "kept", "tau")}
  out["valid"] = np.zeros((g, nq), bool)
  s64 = _data.logits64(rows)  # [G, q, s]
  mask = rows.real_row_mask()
  for start in range(0, g, _CHUNK):
    idx = slice(start, start + _CHUNK)
    q = jnp.asarray(rows.queries[idx])  # [c, q, d]
    k = jnp.asarray(rows.keys[idx])[:, None]  # [c, 1, s, d]
    k = jnp.broadcast_to(k, (q.shape[0], nq, *k.shape[2:]))  # [c, q, s, d]
    key, sub = jax.random.split(key)
    sel = certified_search(
      q,
      k,
      policy=policy,
      mask=jnp.asarray(mask[idx]),
      scale=rows.scale,
      key=sub,
    )
    cert = sel.certificate
    keep = np.asarray(sel.keep)
    out["tv_bound"][idx] = np.asarray(cert.tv_bound, np.float64)
    out["scored"][idx] = np.asarray(cert.keys_scored)
    out["kept"][idx] = np.asarray(cert.k_kept)
    out["valid"][idx] = np.asarray(cert.valid)
    out["tau"][idx] = np.exp(
      _data.np_log_tail_mass64(s64[idx], keep, mask[idx])
    )
  return out, key


def analyse(rows: _data.Rows, config, block_size, source, writer, key):
  records = []
  n = np.broadcast_to(rows.key_mask.sum(-1)[:, None], rows.query_mask.shape)
  qm = rows.query_mask
  for eps in config.epss:
    k_min = np.asarray(
      theory.k_eps(
        jnp.asarray(rows.logits), eps, mask=jnp.asarray(rows.real_row_mask())
      )
    )  # [G, q]
    for search in config.searches:
      policy = jaxtopk.Certified(
        eps,
        search=search,
        block_size=block_size,
        delta=config.delta,
        num_samples=config.num_samples,
      )
      res, key = search_rows(rows, policy, key)
      v = res["valid"][qm]
      tv, tau = res["tv_bound"][qm], res["tau"][qm]
      scored, kept, nn = res["scored"][qm], res["kept"][qm], n[qm]
      sound = tv >= tau
      records.append(
        writer.write(
          "search",
          source=source,
          eps=eps,
          search=search,
          rows=int(qm.sum()),
          valid_frac=v.mean(),
          mean_n=nn.mean(),
          scored_frac=scored.mean() / nn.mean(),
          reduction=nn.mean() / scored.mean(),
          kept_frac=kept.mean() / nn.mean(),
          k_eps_frac=k_min[qm].mean() / nn.mean(),
          sound_frac=sound[v].mean(),
          within_budget_frac=(tv[v] <= eps).mean(),
          failure_rate=1.0 - sound[v].mean(),
          failure_prob=config.delta if search == "mc" else 0.0,
          mean_tv_bound=tv[v].mean(),
          mean_tau=tau[v].mean(),
        )
      )
  return records, key


def plot(records, workdir):
  sources = sorted({r["source"] for r in records})
  fig, axes = _common.new_figure(ncols=len(sources), size=(3.8, 3.3))
  for ax, source in zip(axes[0], sources, strict=True):
    for i, search in enumerate(dict.fromkeys(r["search"] for r in records)):
      pts = [
        r for r in records if r["source"] == source and r["search"] == search
      ]
      ax.plot(
        [r["eps"] for r in pts],
        [r["reduction"] for r in pts],
        "o-",
        color=f"C{i}",
        label=search,
      )
    ax.axhspan(2, 4, color="0.9", zorder=0, label="[TV]: 2-4x")
    ax.set_xscale("log")
    ax.set_xlabel("eps (TV budget)")
    ax.set_ylabel("n / keys scored")
    ax.set_title(source, fontsize=8)
  axes[0][0].legend(fontsize=6)
  return _common.save_figure(fig, workdir, "certified_search")


def run(config, workdir, *, overwrite: bool = False) -> dict:
  """Runs the experiment into ``workdir``; returns the records."""
  workdir = _common.prepare_workdir(workdir, overwrite=overwrite)
  _common.write_config(workdir, config)
  writer = _common.MetricWriter(workdir)
  key, data_key = jax.random.split(jax.random.key(config.seed))
  records = []
  if config.synthetic.enabled:
    cfg = config.synthetic
    progress = _common.Progress("synthetic", len(cfg.sigmas))
    for sigma in cfg.sigmas:
      data_key, sub = jax.random.split(data_key)
      rows = _data.gaussian_qk(
        sub,
        groups=cfg.groups,
        queries=cfg.queries,
        n=cfg.n,
        head_dim=cfg.head_dim,
        sigma=sigma,
      )
      recs, key = analyse(
        rows, config, cfg.block_size, f"gaussian sigma={sigma}", writer, key
      )
      records += recs
      progress.update(1, f"sigma={sigma}")
  if config.minilm.enabled:
    cfg = config.minilm
    rows = _data.minilm_rows(cfg.num_passages, cfg.max_len)
    recs, key = analyse(rows, config, cfg.block_size, "minilm", writer, key)
    records += recs
  plot(records, workdir)
  cols = [
    "source",
    "eps",
    "search",
    "mean_n",
    "scored_frac",
    "reduction",
    "kept_frac",
    "k_eps_frac",
    "sound_frac",
    "within_budget_frac",
    "failure_prob",
  ]
  _common.write_summary(
    workdir,
    "Certified search (THEORY 6): keys scored, kept, soundness on every row\n"
    + _common.format_table(records, cols),
  )
  return {"search": records}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  run(_CONFIG.value, _WORKDIR.value, overwrite=_OVERWRITE.value)


if __name__ == "__main__":
  _CONFIG, _WORKDIR, _OVERWRITE = _common.define_flags(NAME)
  app.run(main)
