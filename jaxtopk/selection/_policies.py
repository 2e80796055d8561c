"""Selection policies: which keys a Top-k attention row keeps.

Frozen, hashable dataclasses, so a policy can be a static argument of jit and
a field of a Flax module. Each validates itself on construction and names the
bad value.

- ``FixedK(topk)``: the ``topk`` largest logits.
- ``Ratio(rho)``: the ``ceil(rho * n)`` largest logits (THEORY 8.1).
- ``PowerLaw(alpha, c)``: the ``ceil(alpha * n**c)`` largest (THEORY 7.1).
- ``Certified(eps, search=...)``: the smallest set whose dropped mass is
  certified ``<= eps`` (THEORY 6.1-6.3).
- ``Dense()``: every key (the dense reference, with a certificate of 0).

Here ``n`` is the number of real (unmasked) keys of the row when the policy is
evaluated per row, or the static key length when a static count is needed.
"""

import dataclasses
import math
from typing import Literal

SEARCHES = ("exact", "delta", "mc")
BOUNDS = ("box", "lowrank")


class Policy:
  """Base class of selection policies."""

  def num_kept(self, n: int) -> int | None:
    """Static number of kept keys for a row of ``n`` keys; None if dynamic."""
    return None


@dataclasses.dataclass(frozen=True)
class Dense(Policy):
  """Keep every key: dense attention with a (zero) certificate."""

  def num_kept(self, n: int) -> int:
    return n


@dataclasses.dataclass(frozen=True)
class FixedK(Policy):
  """Keep the ``topk`` largest logits of each row (fewer if the row is short).

  Attributes:
    topk: number of kept keys, >= 1.
  """

  topk: int

  def __post_init__(self):
    if isinstance(self.topk, bool) or not isinstance(self.topk, int):
      raise TypeError(f"FixedK.topk must be an int; got {self.topk!r}")
    if self.topk < 1:
      raise ValueError(f"FixedK.topk={self.topk} must be >= 1")

  def num_kept(self, n: int) -> int:
    return min(self.topk, n)


@dataclasses.dataclass(frozen=True)
class Ratio(Policy):
  """Keep the ``ceil(rho * n)`` largest logits (at least one).

  Attributes:
    rho: kept fraction in (0, 1]; rho = 1 is dense.
  """

  rho: float

  def __post_init__(self):
    if not (isinstance(self.rho, int | float) and 0.0 < self.rho <= 1.0):
      raise ValueError(f"Ratio.rho={self.rho!r} must be in (0, 1]")

  def num_kept(self, n: int) -> int:
    return max(1, min(n, math.ceil(self.rho * n - 1e-9)))


@dataclasses.dataclass(frozen=True)
class PowerLaw(Policy):
  """Dynamic window k = ceil(alpha * n**c) of [NC] (THEORY 7.1).

  Attributes:
    alpha: positive multiplier.
    c: exponent in (0, 1].
  """

  alpha: float
  c: float

  def __post_init__(self):
    if not (isinstance(self.alpha, int | float) and self.alpha > 0):
      raise ValueError(f"PowerLaw.alpha={self.alpha!r} must be > 0")
    if not (isinstance(self.c, int | float) and 0.0 < self.c <= 1.0):
      raise ValueError(f"PowerLaw.c={self.c!r} must be in (0, 1]")

  def num_kept(self, n: int) -> int:
    return max(1, min(n, math.ceil(self.alpha * n**self.c - 1e-9)))


@dataclasses.dataclass(frozen=True)
class Certified(Policy):
  """Keep the fewest keys whose dropped mass is certified <= eps.

  THEORY 6.1-6.3. The certificate's tv_bound is <= eps on every valid row.

  Attributes:
    eps: TV budget in (0, 1).
    search: 'exact' (all logits scored, minimal certified set by threshold
      search), 'delta' (Delta-Search: blocks scored in order of their upper
      bounds until the blockwise bound certifies eps), or 'mc' (MC-Search:
      sampled block masses, certificate holds with probability >= 1 - delta).
    block_size: keys per block for 'delta' and 'mc'.
    delta: failure probability of the 'mc' certificate, in (0, 1).
    num_samples: keys sampled per block by 'mc'.
    max_topk: optional static cap on the kept set (for fixed-shape outputs);
      a row that cannot meet eps within it reports its true (larger) bound.
    bound: how 'delta' bounds unscored keys: 'box' (block box and ball
      summaries, THEORY 3.3) or 'lowrank' (per-key bounds from a rank-
      ``rank`` projection of the keys, ``certified_search`` only; its
      projected dot products are counted in ``keys_scored``).
    rank: rank of the 'lowrank' projection (capped at head_dim).
  """

  eps: float
  search: Literal["exact", "delta", "mc"] = "exact"
  block_size: int = 64
  delta: float = 0.01
  num_samples: int = 8
  max_topk: int | None = None
  bound: Literal["box", "lowrank"] = "box"
  rank: int = 16

  def __post_init__(self):
    if not (isinstance(self.eps, int | float) and 0.0 < self.eps < 1.0):
      raise ValueError(f"Certified.eps={self.eps!r} must be in (0, 1)")
    if self.search not in SEARCHES:
      raise ValueError(
        f"Certified.search={self.search!r} must be one of {SEARCHES}"
      )
    if not (isinstance(self.block_size, int) and self.block_size >= 1):
      raise ValueError(f"Certified.block_size={self.block_size!r} must be >= 1")
    if not (isinstance(self.delta, int | float) and 0.0 < self.delta < 1.0):
      raise ValueError(f"Certified.delta={self.delta!r} must be in (0, 1)")
    if not (isinstance(self.num_samples, int) and self.num_samples >= 1):
      raise ValueError(
        f"Certified.num_samples={self.num_samples!r} must be >= 1"
      )
    if self.max_topk is not None and not (
      isinstance(self.max_topk, int) and self.max_topk >= 1
    ):
      raise ValueError(f"Certified.max_topk={self.max_topk!r} must be >= 1")
    if self.bound not in BOUNDS:
      raise ValueError(
        f"Certified.bound={self.bound!r} must be one of {BOUNDS}"
      )
    if self.bound == "lowrank" and self.search != "delta":
      raise ValueError(
        f"Certified.bound='lowrank' needs search='delta'; got {self.search=}"
      )
    if not (isinstance(self.rank, int) and self.rank >= 1):
      raise ValueError(f"Certified.rank={self.rank!r} must be an int >= 1")
