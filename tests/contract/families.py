"""Adversarial input families of the contract test (hypothesis strategies).

Every family fills the SAME fixed shapes (so each variant x policy compiles
once): queries ``[B, T, H, D]``, keys ``[B, N, HK, D]`` (GQA: 2 query heads
per kv head), values ``[B, N, HK, E]`` whose first N columns are the
identity (value j = e_j: the output's first N columns ARE the computed
P_hat, so the kept set is read off the output on every path, whatever it
returns) followed by ``ER`` ordinary value columns; an optional boolean
mask ``[B, 1, T, N]`` (True = attend, shared by the heads) and an optional
bias ``[B, H, T, N]`` (-inf allowed).

Families: normal rows; magnitudes 1e-38..1e38 with products of
order one; subnormal components against huge ones; huge and tiny values
mixed in one vector; ties; one dominant key; a tail far below the head; -inf
bias; key-padding masks and per-row masks (empty rows, one real key);
values near overflow and tiny values; non-finite values (rows attending
to one must be invalid; one held by a masked key changes nothing). Each
dtype (float32, bfloat16, float16) keeps the values inside its range.

The second audit's families: tiny NORMAL queries (~1.5e-38: scale ||q|| is
subnormal) against keys ~1e38 (logits of order one, ball terms of order
one); keys below 1e-19 (their squares underflow) against queries ~1e19;
values near the float32 maximum (norms above it).
"""

import dataclasses

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

B, T, H, HK, D, N = 1, 3, 2, 1, 5, 7
ER = 3  # ordinary value columns after the N identity columns
E = N + ER

DTYPES = {
  "float32": np.float32,
  "bfloat16": ml_dtypes.bfloat16,
  "float16": np.float16,
}

FAMILIES = (
  "normal",
  "magnitude",
  "subnormal",
  "mixed",
  "ties",
  "dominant",
  "deep_tail",
  "neg_inf_bias",
  "padding",
  "row_masks",
  "big_values",
  "nonfinite_values",
  "tiny_query",
  "tiny_keys",
  "near_max_values",
)

# Families out of float16's range (|v| ~ 3e37, 1e38 keys, 1e-38 queries).
_F16_OUT = {"big_values", "tiny_query", "tiny_keys", "near_max_values"}


@dataclasses.dataclass(frozen=True)
class Case:
  """One contract input, already cast to ``dtype`` (numpy arrays).

  Attributes:
    family: the family's name.
    dtype: numpy dtype of q, k, v (float32, bfloat16 or float16).
    q: ``[B, T, H, D]``.
    k: ``[B, N, HK, D]``.
    v: ``[B, N, HK, E]``, identity columns first.
    mask: ``[B, 1, T, N]`` bool or None.
    bias: ``[B, H, T, N]`` float32 or None.
    padding_only: the mask is a key-padding mask (the same for every row).
  """

  family: str
  dtype: type
  q: np.ndarray
  k: np.ndarray
  v: np.ndarray
  mask: np.ndarray | None = None
  bias: np.ndarray | None = None

  @property
  def padding_only(self) -> bool:
    if self.mask is None:
      return True
    return bool(np.all(self.mask == self.mask[:, :, :1, :]))


def _cast(x, dtype):
  info = np.finfo(np.float32 if dtype is ml_dtypes.bfloat16 else dtype)
  x = np.asarray(x, np.float64)
  big = float(info.max)
  x = np.where(np.isfinite(x), np.clip(x, -big, big), x)  # inf / NaN kept
  with np.errstate(over="ignore", under="ignore"):
    return x.astype(dtype)


def identity_values(rng, dtype, scale=1.0):
  """``[B, N, HK, E]``: identity columns, then ``ER`` normal columns."""
  eye = np.broadcast_to(np.eye(N)[None, :, None, :], (B, N, HK, N))
  rand = rng.standard_normal((B, N, HK, ER)) * scale
  return np.concatenate([eye, rand], axis=-1)


def _subnormal_pool(dtype):
  if dtype is np.float16:
    return [3e-6, -6e-8, 1e-7]
  return [1e-39, -1e-40, 1e-42, 3e-45]


def _huge(dtype):
  return 6e4 if dtype is np.float16 else 1e38


def _build(family, rng, dtype):
  """(q, k, v, mask, bias) float64 arrays of the family."""
  q = rng.standard_normal((B, T, H, D))
  k = rng.standard_normal((B, N, HK, D))
  v = identity_values(rng, dtype)
  mask = bias = None
  f16 = dtype is np.float16
  if family == "normal":
    q = q * 10.0 ** rng.uniform(-1, 0.7)
  elif family == "magnitude":
    lim = 4 if f16 else 37
    e = rng.integers(-lim, lim + 1)
    q = q * 10.0**e
    k = k * 10.0 ** (-e + rng.integers(-1, 2))
  elif family == "subnormal":
    pool = _subnormal_pool(dtype)
    huge = _huge(dtype)
    c = rng.integers(D)
    if rng.random() < 0.5:  # subnormal q component x huge key component
      q[..., c] = rng.choice(pool, size=q.shape[:-1])
      k[..., c] = rng.choice([-1, 1], size=k.shape[:-1]) * huge
    else:  # huge q component x subnormal key components
      q[..., c] = rng.choice([-1, 1], size=q.shape[:-1]) * huge
      k[..., c] = rng.choice(pool, size=k.shape[:-1])
  elif family == "mixed":
    if f16:
      pool_q = [6e4, -1e-4, 3e-6, 1.0, -5.0, 0.0, 100.0]
      pool_k = [1e-4, -1.0, 3e-6, 0.0, 2.0, 1e-3]
    else:
      pool_q = [3e38, -1e30, 1e-38, 1.4e-45, 1.0, -5.0, 0.0, 1e-20]
      pool_k = [1e-38, -1e-30, 1e-40, 0.0, 2.0, 1e20, -3e-39]
    q = rng.choice(pool_q, size=q.shape)
    k = rng.choice(pool_k, size=k.shape)
  elif family == "ties":
    q = rng.integers(-2, 3, size=q.shape).astype(np.float64)
    base = rng.integers(-1, 2, size=(B, 2, HK, D)).astype(np.float64)
    k = base[:, rng.integers(0, 2, size=N)]
  elif family == "dominant":
    j = rng.integers(N)
    q = q * 0.1
    q[..., 0] = 30.0 if not f16 else 10.0
    k[:, j, :, 0] = 6.0 if not f16 else 4.0
  elif family == "deep_tail":
    q = np.zeros(q.shape)
    q[..., 0] = 1.0
    k = np.zeros(k.shape)
    k[:, 1:, :, 0] = -(rng.uniform(80, 120, size=(B, N - 1, HK)))
    if f16:
      k[:, 1:, :, 0] = -(rng.uniform(10, 18, size=(B, N - 1, HK)))
    k = k * np.sqrt(D)  # the default scale is 1 / sqrt(D)
  elif family == "neg_inf_bias":
    bias = rng.standard_normal((B, H, T, N))
    bias[rng.random(bias.shape) < 0.3] = -np.inf
    if rng.random() < 0.5:
      bias[:, :, rng.integers(T)] = -np.inf  # a row with no key of mass
  elif family == "padding":
    mask = np.broadcast_to(rng.random((B, 1, 1, N)) < 0.6, (B, 1, T, N))
    if rng.random() < 0.25:
      mask = np.zeros_like(mask)
  elif family == "row_masks":
    mask = rng.random((B, 1, T, N)) < 0.5
    mask[:, :, 0] = False  # an empty row
    mask[:, :, 1] = False
    mask[:, :, 1, rng.integers(N)] = True  # one real key (n = 1)
  elif family == "big_values":
    mag = rng.choice([3e37, 1e36, 1e-30, 1.0], size=(B, N, HK, ER))
    v[..., N:] = mag * rng.choice([-1, 1], size=mag.shape)
  elif family == "nonfinite_values":
    j = rng.integers(N)
    v[:, j, :, N] = rng.choice([np.nan, np.inf, -np.inf])
    # A key nobody attends to holds a non-finite value too: it must change
    # nothing (no 0 * NaN in an output). Key j stays real or not by chance.
    j2 = (j + 1 + rng.integers(N - 1)) % N
    v[:, j2, :, N + 1] = rng.choice([np.nan, np.inf, -np.inf])
    mask = rng.random((B, 1, 1, N)) < (0.7 if rng.random() < 0.5 else 1.0)
    mask[..., j2] = False
    mask = np.broadcast_to(mask, (B, 1, T, N))
  elif family == "tiny_query":
    # ||q|| ~ 1.5e-38 (normal): scale ||q|| is subnormal. Keys spread
    # +-2.5e38 along q's first axis, so a ball of them is worth logits.
    q = rng.choice([0.0, 1.2e-38, -1.2e-38, 1.5e-38, -1.5e-38], size=q.shape)
    q[..., 0] = rng.choice([1.2e-38, -1.5e-38, 1.5e-38], size=q.shape[:-1])
    k = k * 3e37
    k[..., 0] = rng.choice([2.5e38, -2.5e38, 1e38, -1e38], size=k.shape[:-1])
  elif family == "tiny_keys":
    # |k_c| <= 1e-19: squares underflow (radii of 0 when not scaled).
    k = np.clip(k, -1, 1) * 1e-19
    q = np.clip(q, -2, 2) * 0.9e19 / np.sqrt(D)
  elif family == "near_max_values":
    # Values whose norms exceed the largest float32 (3.4e38).
    mag = rng.choice([3.4e38, 3e38, 2e38, 1.0], size=(B, N, HK, ER))
    v[..., N:] = mag * rng.choice([-1, 1], size=mag.shape)
    q = q * 2.0
  else:
    raise ValueError(f"unknown {family=}")
  return q, k, v, mask, bias


@st.composite
def cases(draw, dtype_name="float32", families=FAMILIES):
  """A ``Case`` of one of ``families`` in ``dtype_name``."""
  dtype = DTYPES[dtype_name]
  fams = [f for f in families if not (dtype is np.float16 and f in _F16_OUT)]
  family = draw(st.sampled_from(fams))
  seed = draw(st.integers(0, 2**32 - 1))
  rng = np.random.default_rng(seed)
  q, k, v, mask, bias = _build(family, rng, dtype)
  return Case(
    family=family,
    dtype=dtype,
    q=_cast(q, dtype),
    k=_cast(k, dtype),
    v=_cast(v, dtype),
    mask=None if mask is None else np.ascontiguousarray(mask),
    bias=None if bias is None else bias.astype(np.float32),
  )


def fixed_case(family, dtype_name="float32", seed=0) -> Case:
  """A deterministic case (for checks that need one example)."""
  dtype = DTYPES[dtype_name]
  if dtype is np.float16 and family in _F16_OUT:
    family = "normal"
  q, k, v, mask, bias = _build(family, np.random.default_rng(seed), dtype)
  return Case(
    family=family,
    dtype=dtype,
    q=_cast(q, dtype),
    k=_cast(k, dtype),
    v=_cast(v, dtype),
    mask=None if mask is None else np.ascontiguousarray(mask),
    bias=None if bias is None else bias.astype(np.float32),
  )
