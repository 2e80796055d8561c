"""float64 numpy ground truth for the theory tests (THEORY 1-4, 7, 8.4).

Everything here is written from the definitions, row by row, in float64,
independently of jaxtopk's code paths (no shared helpers).
"""

import numpy as np
from scipy.special import logsumexp


def as64(x):
  """float64 copy of a (possibly bf16/f16/f32 jax) array."""
  return np.asarray(np.asarray(x, np.float32) if _is_low(x) else x, np.float64)


def _is_low(x):
  return str(getattr(x, "dtype", "")) in ("bfloat16", "float16")


def _lse_ld(x):
  """logsumexp in extended precision (np.longdouble, 80-bit on x86)."""
  x = np.asarray(x, np.longdouble)
  m = np.max(x)
  return m + np.log(np.sum(np.exp(x - m)))


def log_tau(s, keep, valid):
  """Log tail mass of one row (THEORY 2.5), in extended precision.

  Computed in np.longdouble so that it is more accurate than a float64
  bound, which can then be checked against it with no tolerance.
  """
  s = np.asarray(s, np.float64)
  real = s[valid]
  tail = s[valid & ~keep]
  if tail.size == 0:
    return -np.inf
  return _lse_ld(tail) - _lse_ld(real)


def topk_keep(s, topk, valid):
  """Top-k kept set, ties by lowest index (stable sort on -s)."""
  s = np.asarray(s, np.float64)
  order = np.argsort(np.where(valid, -s, np.inf), kind="stable")
  keep = np.zeros(s.shape, bool)
  keep[order[: min(topk, int(valid.sum()))]] = True
  return keep & valid


def probs(s, valid):
  s = np.asarray(s, np.float64)
  p = np.zeros(s.shape)
  p[valid] = np.exp(s[valid] - logsumexp(s[valid]))
  return p


def truncated(p, keep):
  q = np.where(keep, p, 0.0)
  return q / q.sum()


def output_error(s, keep, v, valid):
  """||Attn - Attn_k||_2 of one row, in extended precision (np.longdouble).

  Written as ``(W_drop / W) * (mu_drop - mu_keep)`` (the two outputs'
  difference in closed form), so equal values give exactly 0 instead of
  the rounding noise of two separately rounded outputs (~1e-16, which a
  tight bound on a tiny true error can sit below). Attn_k = 0 when nothing
  is kept.
  """
  s = np.asarray(s, np.longdouble)[valid]
  v = np.asarray(v, np.longdouble)[valid]
  h = np.asarray(keep)[valid]
  w = np.exp(s - s.max())
  if not h.any():
    attn = (w[:, None] * v).sum(0) / w.sum()
    return float(np.sqrt((attn * attn).sum()))
  if h.all():
    return 0.0
  w_keep, w_drop = w[h].sum(), w[~h].sum()
  if w_drop == 0:  # below the extended range: the difference is too
    return 0.0
  mu_keep = (w[h, None] * v[h]).sum(0) / w_keep
  mu_drop = (w[~h, None] * v[~h]).sum(0) / w_drop
  d = (w_drop / (w_keep + w_drop)) * (mu_drop - mu_keep)
  return float(np.sqrt((d * d).sum()))


def k_eps(s, eps, valid):
  """Minimal number of largest logits with tail mass <= eps (THEORY 6.1)."""
  s = np.sort(np.asarray(s, np.float64)[valid])[::-1]
  for k in range(1, s.size + 1):
    tail = s[k:]
    lt = -np.inf if tail.size == 0 else logsumexp(tail) - logsumexp(s)
    if lt <= np.log(eps):
      return k
  return s.size
