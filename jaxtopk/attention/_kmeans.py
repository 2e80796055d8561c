"""k-means of the content index: k-means++ seeding and Lloyd iterations per
row (``kmeans_row``), and the 2-means split of clusters larger than a group
(``bisect_oversized``). The assignment products only rank keys: any matmul
precision will do (no certificate rests on them).
"""

import jax
import jax.numpy as jnp

_ASSIGN_CHUNK = 2048  # keys per chunk of the k-means distance matrix


def kmeans_row(x, valid, num_clusters, iters, sample, rng):
  """k-means++ then Lloyd for one row; ``[n]`` cluster ids (invalid: K).

  Seeding (k-means++: each new centre drawn with probability proportional
  to the squared distance to the nearest centre so far) and the Lloyd
  iterations run on ``sample`` evenly spaced real keys (static), the final
  assignment on all of them. Plain random seeding leaves ~1/e of the
  clusters of clustered keys without a centre and merges them into loose
  groups.
  """
  n, d = x.shape
  k = num_clusters
  nv = jnp.sum(valid, dtype=jnp.int32)
  vidx = jnp.nonzero(valid, size=n, fill_value=0)[0]  # [n] positions
  spick = (jnp.arange(sample) * jnp.maximum(nv, 1)) // sample
  xs = x[vidx[spick]]  # [S, d]
  vs = jnp.arange(sample) < nv  # fewer real keys than samples: repeats off
  gumbel = jax.random.gumbel(rng, (k, sample), x.dtype)

  def seed(i, st):
    c, dmin = st
    logp = jnp.where(
      vs & (dmin > 0), jnp.log(jnp.maximum(dmin, 1e-30)), -jnp.inf
    )
    pick = jnp.argmax(jnp.where(i == 0, 0.0, logp) + gumbel[i])
    new = xs[pick]
    dmin = jnp.minimum(dmin, jnp.sum((xs - new) ** 2, -1))
    return c.at[i].set(new), dmin

  c0 = jnp.zeros((k, d), x.dtype)
  c, _ = jax.lax.fori_loop(
    0, k, seed, (c0, jnp.full((sample,), jnp.inf, x.dtype))
  )

  def assign(c, xx):
    m = xx.shape[0]
    chunk = min(m, _ASSIGN_CHUNK)
    pad = -m % chunk
    xp = jnp.pad(xx, ((0, pad), (0, 0))).reshape(-1, chunk, d)
    cn = jnp.sum(c * c, -1)  # [K]
    # RANK ONLY: the assignment orders centres by distance; the summaries
    # are computed from the members afterwards (``_group_summaries``), so
    # any precision is sound here (fast TF32 / bf16 passes are fine).
    near = lambda xc: jnp.argmin(cn - 2 * xc @ c.T, -1)  # [chunk]
    with jax.named_scope("rank_only"):
      return jax.lax.map(near, xp).reshape(-1)[:m]

  def step(_, c):
    a = assign(c, xs)
    w = vs.astype(x.dtype)
    tot = jax.ops.segment_sum(xs * w[:, None], a, k)  # [K, d]
    cnt = jax.ops.segment_sum(w, a, k)  # [K]
    return jnp.where(cnt[:, None] > 0, tot / jnp.maximum(cnt, 1)[:, None], c)

  c = jax.lax.fori_loop(0, iters, step, c)
  a = assign(c, x)
  return jnp.where(valid, a, k), c


def _seg_argmax(score, seg, num, valid):
  """Index of the largest ``score`` in each segment (first on ties)."""
  n = score.shape[0]
  score = jnp.where(valid, score, -jnp.inf)
  best = jax.ops.segment_max(score, seg, num)
  hit = valid & (score == best[seg])
  idx = jax.ops.segment_min(jnp.where(hit, jnp.arange(n), n), seg, num)
  return jnp.minimum(idx, n - 1)


def bisect_oversized(x, valid, a, c, c_sz, iters=3):
  """2-means split of every k-means cluster holding more than C keys.

  k-means leaves some pairs of true clusters merged; cutting such a cluster
  into C-key chunks by count would put a few keys of one cluster into the
  other's group and blow up its radius. Each oversized cluster is split by
  2-means seeded with its farthest key p and the key farthest from p.

  Returns:
    ``(sub, t)``: ``[n]`` sub-cluster ids 2a + side (invalid keys: 2K) and
    an order key within the sub-cluster (distance to p).
  """
  k = c.shape[0]
  a_c = jnp.minimum(a, k - 1)
  size = jax.ops.segment_sum(valid.astype(jnp.int32), a, k + 1)[:k]
  big = size > c_sz  # [K]
  d_c = jnp.sum((x - c[a_c]) ** 2, -1)
  p = x[_seg_argmax(d_c, a, k + 1, valid)[:k]]  # [K, d]
  d_p = jnp.sum((x - p[a_c]) ** 2, -1)
  p2 = x[_seg_argmax(d_p, a, k + 1, valid)[:k]]  # [K, d]
  cc = jnp.stack([p, p2], 1)  # [K, 2, d]

  def side_of(cc):
    d0 = jnp.sum((x - cc[a_c, 0]) ** 2, -1)
    d1 = jnp.sum((x - cc[a_c, 1]) ** 2, -1)
    return (d1 < d0) & big[a_c]

  def step(_, cc):
    sid = jnp.where(valid, 2 * a + side_of(cc), 2 * k)
    w = valid.astype(x.dtype)
    tot = jax.ops.segment_sum(x * w[:, None], sid, 2 * k + 1)[: 2 * k]
    cnt = jax.ops.segment_sum(w, sid, 2 * k + 1)[: 2 * k]
    new = tot / jnp.maximum(cnt, 1)[:, None]
    new = jnp.where(cnt[:, None] > 0, new, cc.reshape(2 * k, -1))
    return new.reshape(k, 2, -1)

  cc = jax.lax.fori_loop(0, iters, step, cc)
  sub = jnp.where(valid, 2 * a + side_of(cc), 2 * k)
  t = jnp.where(jnp.isfinite(d_p), d_p, 0.0)
  return sub, t
