"""Search strategies of ``Certified`` and the key bounds of Delta-Search.

THEORY 6.1-6.3. A ``Certified(eps)`` policy states WHAT is promised (tv <= eps
on every valid row); its ``search`` strategy states HOW the kept set is
found, and carries the fields that only that search reads:

- ``Auto(block_size)`` (the default of ``Certified(eps)``): the cheapest
  sound strategy the backend has for the inputs. A backend that knows no
  cheaper one runs it as ``Exact`` (its capability is 'search=exact':
  whatever honours the exact search honours Auto); the XLA decode over a
  ``KVCache`` or a content index bounds each key from its 8-bit code
  (``Codes``) where a small sample of code estimates says the row is
  concentrated enough to pay, and keeps every key where it says the row is
  flat (no search can pay there: tv_bound 0 at dense cost; over a
  ``KVCache`` the batch as one: the codes when every row pays, and on a
  contiguous cache only up to 2 query heads per kv head); the XLA
  prefill runs Delta-Search at tile granularity and scores every key of a
  tile where that does not pay. An explicitly named strategy is always run
  as named.
- ``Exact(block_size)``: every logit scored, minimal certified set by
  threshold search (THEORY 6.1).
- ``DeltaSearch(block_size, bound)``: blocks scored in order of an upper
  bound on their mass until the blockwise bound certifies eps (THEORY 6.2);
  ``bound`` is ``Box()`` (box and ball block summaries, THEORY 3.3),
  ``LowRank(rank)`` (per-key bounds from a rank-r projection) or
  ``Codes()`` (per-key bounds from 8-bit key codes kept in the cache,
  THEORY 3.5).
- ``MCSearch(block_size, delta, num_samples)``: sampled block masses with a
  Hoeffding bound; the certificate holds with probability >= 1 - delta
  (THEORY 6.3).

``block_size`` is the key-block granularity for backends that work on
blocks (Delta/MC block summaries, Pallas kernels that keep or drop whole
blocks); paths that score every key one by one do not depend on it.

Strategies are frozen, hashable dataclasses (static jit arguments), validate
their fields on construction (naming the field and value), and describe
themselves to capability checks through ``features`` (see
``Policy.require``).
"""

import dataclasses
import math

import jax
import numpy as np

from jaxtopk import _deprecation


def as_int(field: str, value, *, minimum: int | None = None) -> int:
  """``value`` as a Python int, or an error naming ``field`` and the value.

  Accepts Python, numpy and concrete JAX integer scalars; refuses bools,
  floats, traced values and arrays.
  """
  v = _as_scalar(field, value)
  if isinstance(v, bool) or not isinstance(v, int):
    raise TypeError(f"{field}={value!r} must be an int")
  if minimum is not None and v < minimum:
    raise ValueError(f"{field}={v} must be >= {minimum}")
  return v


def as_float(
  field: str, value, *, low=None, high=None, low_open=True, high_open=True
) -> float:
  """``value`` as a finite Python float in the given interval, or an error.

  Accepts Python, numpy and concrete JAX real scalars (ints included);
  refuses bools, complex, non-finite, traced values and arrays.
  """
  v = _as_scalar(field, value)
  if isinstance(v, bool) or not isinstance(v, int | float):
    raise TypeError(f"{field}={value!r} must be a real number")
  v = float(v)
  if not math.isfinite(v):
    raise ValueError(f"{field}={v!r} must be finite")
  lo_bad = low is not None and (v <= low if low_open else v < low)
  hi_bad = high is not None and (v >= high if high_open else v > high)
  if lo_bad or hi_bad:
    lb = "(" if low_open else "["
    hb = ")" if high_open else "]"
    lo = "-inf" if low is None else low
    hi = "inf" if high is None else high
    raise ValueError(f"{field}={v!r} must be in {lb}{lo}, {hi}{hb}")
  return v


def _as_scalar(field, value):
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
      f"{field} must be a concrete number (policies are static); got a"
      f" traced value {value!r}"
    )
  if isinstance(value, np.ndarray | np.generic | jax.Array):
    if np.ndim(value) != 0:
      raise TypeError(
        f"{field} must be a scalar; got an array of shape {np.shape(value)}"
      )
    return value.item()
  return value


class KeyBound:
  """Base of the key bounds used by Delta-Search (``Box``, ``LowRank``)."""

  name: str = ""

  @property
  def feature(self) -> str:
    return f"bound={self.name}"


@dataclasses.dataclass(frozen=True)
class Box(KeyBound):
  """Block box (and ball) summaries bound a block's logits (THEORY 3.3)."""

  name = "box"


@dataclasses.dataclass(frozen=True)
class LowRank(KeyBound):
  """Per-key bounds from a rank-``rank`` projection of the keys.

  q.k <= q_P.k_P + ||q_perp|| ||k_perp||
  (``selection.internal.lowrank_upper_bound``);
  the projected products are counted in ``keys_scored``.

  Attributes:
    rank: rank r of the projection, >= 1 (capped at head_dim).
  """

  rank: int = 16
  name = "lowrank"

  def __post_init__(self):
    object.__setattr__(
      self, "rank", as_int("LowRank.rank", self.rank, minimum=1)
    )


@dataclasses.dataclass(frozen=True)
class Codes(KeyBound):
  """Per-key bounds from 8-bit codes of the keys (THEORY 3.5).

  u_i = scale 2^e_i (q.c_i + ||q||_1 / 2) plus rounding
  (``selection.key_codes``): sound for every key, within a fraction of a
  logit of it on real attention heads. The codes are kept by the
  ``KVCache`` at append time; each code product counts in ``keys_scored``
  as its share of the key's bytes ((d + 1) / (4 d) for float32 keys).
  Keys are then scored in decreasing order of their bound (candidates
  above a threshold, one gather).
  """

  name = "codes"


class SearchStrategy:
  """Base of ``Certified``'s search strategies."""

  name: str = ""
  block_size: int = 64

  @property
  def feature(self) -> str:
    """The capability name of this search, e.g. ``'search=delta'``."""
    return f"search={self.name}"

  @property
  def failure_prob(self) -> float:
    """Probability that the certificate fails (0 for deterministic)."""
    return 0.0

  @property
  def needs_rng(self) -> bool:
    """Whether the search draws random numbers (needs a PRNG key)."""
    return False

  @property
  def scores_all(self) -> bool:
    """Whether the search scores every key (no block is skipped)."""
    return False

  def _check_block_size(self):
    object.__setattr__(
      self,
      "block_size",
      as_int(f"{type(self).__name__}.block_size", self.block_size, minimum=1),
    )


@dataclasses.dataclass(frozen=True)
class Exact(SearchStrategy):
  """Score every key; keep the fewest keys meeting eps (THEORY 6.1).

  Attributes:
    block_size: key-block granularity for backends that keep or drop whole
      blocks (Pallas); paths that keep single keys do not depend on it.
  """

  block_size: int = 64
  name = "exact"

  def __post_init__(self):
    self._check_block_size()

  @property
  def scores_all(self) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Auto(SearchStrategy):
  """The cheapest sound search for the inputs (the default of Certified).

  See the module docstring: backends without a cheaper strategy run the
  exact search (capability 'search=exact'); the XLA decode and prefill
  choose per row or tile between a bounded search and the exact one.
  ``block_size`` is the key-block granularity where a backend needs one
  (the prefill's tile search, Pallas); the decode uses the cache's own.

  Attributes:
    block_size: key-block granularity for backends that work on blocks.
  """

  block_size: int = 64
  name = "auto"

  def __post_init__(self):
    self._check_block_size()

  @property
  def feature(self) -> str:
    return "search=exact"

  @property
  def scores_all(self) -> bool:
    """True: a backend that knows no cheaper strategy runs the exact one."""
    return True


@dataclasses.dataclass(frozen=True)
class DeltaSearch(SearchStrategy):
  """Delta-Search: score blocks in order of their bound until certified.

  THEORY 6.2. Deterministic.

  Attributes:
    block_size: keys per block.
    bound: ``Box()``, ``LowRank(rank)`` or ``Codes()``.
  """

  block_size: int = 64
  bound: KeyBound = Box()
  name = "delta"

  def __post_init__(self):
    self._check_block_size()
    if not isinstance(self.bound, KeyBound):
      raise TypeError(
        f"DeltaSearch.bound={self.bound!r} must be Box(), LowRank(rank) or"
        " Codes()"
      )


@dataclasses.dataclass(frozen=True, init=False)
class MCSearch(SearchStrategy):
  """MC-Search: Hoeffding bounds on sampled block masses (THEORY 6.3).

  The certificate holds with probability at least ``1 - failure_prob``.

  Attributes:
    block_size: keys per block.
    failure_prob: probability in (0, 1) that the certificate fails (the
      delta of THEORY 6.3). ``delta=`` is its deprecated name (warns;
      removed in 0.3).
    num_samples: keys sampled per block, >= 1 (counted in keys_scored).
  """

  block_size: int = 64
  failure_prob: float = 0.01  # type: ignore[assignment]
  num_samples: int = 8
  name = "mc"

  def __init__(
    self, block_size=64, failure_prob=None, num_samples=8, *, delta=None
  ):
    if delta is not None:
      if failure_prob is not None:
        raise ValueError(
          f"MCSearch got failure_prob={failure_prob!r} and its deprecated"
          f" name delta={delta!r}: pass failure_prob only"
        )
      _deprecation.warn("MCSearch(delta=...)", "failure_prob=")
      failure_prob = delta
    object.__setattr__(self, "block_size", block_size)
    self._check_block_size()
    p = 0.01 if failure_prob is None else failure_prob
    p = as_float("MCSearch.failure_prob", p, low=0, high=1)
    object.__setattr__(self, "failure_prob", p)
    object.__setattr__(
      self,
      "num_samples",
      as_int("MCSearch.num_samples", num_samples, minimum=1),
    )

  @property
  def delta(self) -> float:
    """Deprecated (warns; removed in 0.3): ``failure_prob``."""
    _deprecation.warn("MCSearch.delta", "MCSearch.failure_prob")
    return self.failure_prob

  @property
  def needs_rng(self) -> bool:
    return True


SEARCHES = {
  "auto": Auto,
  "exact": Exact,
  "delta": DeltaSearch,
  "mc": MCSearch,
}
BOUNDS = {"box": Box, "lowrank": LowRank, "codes": Codes}
