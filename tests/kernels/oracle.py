"""float64 numpy oracle for certificates: exact tau and output error."""

import numpy as np


def exact(q, k, v, keep, visible, scale):
  """Exact tau and ||Attn - Attn_k|| in float64.

  Args:
    q: ``[b, h, q, d]``; k, v: ``[b, h_kv, s, d]``.
    keep: ``[b, h, q, s]`` bool kept keys (subset of visible is taken).
    visible: ``[b, 1 or h, q, s]`` bool real, visible keys.
    scale: logit scale.

  Returns:
    (tau ``[b, h, q]``, output error ``[b, h, q]``, n_visible ``[b, h, q]``).
  """
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  g = q.shape[1] // k.shape[1]
  k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
  s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
  vis = np.broadcast_to(np.asarray(visible, bool), s.shape)
  keep = np.asarray(keep, bool) & vis
  s = np.where(vis, s, -np.inf)
  mx = np.max(s, axis=-1, keepdims=True)
  mx = np.where(np.isfinite(mx), mx, 0.0)
  w = np.where(vis, np.exp(s - mx), 0.0)
  z = w.sum(-1)
  zt = np.where(keep, 0.0, w).sum(-1)
  with np.errstate(invalid="ignore", divide="ignore"):
    tau = zt / z
    dense = np.einsum("bhqk,bhkd->bhqd", w, v) / z[..., None]
    wh = np.where(keep, w, 0.0)
    sparse = np.einsum("bhqk,bhkd->bhqd", wh, v) / wh.sum(-1)[..., None]
  err = np.linalg.norm(dense - sparse, axis=-1)
  return tau, err, vis.sum(-1)
