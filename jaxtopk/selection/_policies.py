"""Selection policies: which keys a Top-k attention row keeps.

Frozen, hashable dataclasses, so a policy can be a static argument of jit and
a field of a Flax module. Each validates itself on construction (numpy and
JAX scalars are normalised to Python numbers; bools, non-finite and
out-of-range values are refused, naming the field and value) and carries its
behaviour:

- Fixed-count policies (``FixedCount``) know their kept count, statically
  (``num_kept(n)``) and per row for traced real-key counts
  (``row_num_kept(n_real, n_keys)``):
  ``FixedK(topk)``: the ``topk`` largest logits;
  ``Ratio(rho)``: the ``ceil(rho * n)`` largest (THEORY 8.1);
  ``PowerLaw(alpha, c)``: the ``ceil(alpha * n**c)`` largest (THEORY 7.1);
  ``Dense()``: every key (the dense reference, with a certificate of 0).
- ``Certified(eps, search=...)``: the smallest set whose dropped mass is
  certified ``<= eps`` (THEORY 6.1-6.3); its search is a strategy object
  (``Exact``, ``DeltaSearch``, ``MCSearch``; ``_strategies``).

Here ``n`` is the number of real keys of the row (mask True and logit not
-inf) when the policy is evaluated per row, or the static key length when a
static count is needed.

Capabilities: a backend declares what it honours as a set of feature names
(``capabilities(...)``, e.g. ``{'policy=Certified', 'search=exact',
'max_topk'}``) and calls ``policy.require(backend, supports)``, which raises
``UnsupportedPolicyError`` naming the first field it cannot honour, e.g.
"Certified.max_topk=4 is not supported by decode_attention(implementation=
'pallas')". Every field of every policy maps to a feature (``features()``),
so a field is either honoured or refused by name on every path.
"""

import dataclasses
import functools
import math
from collections.abc import Iterable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxtopk import _deprecation
from jaxtopk.selection import _strategies
from jaxtopk.selection._strategies import Auto
from jaxtopk.selection._strategies import Box
from jaxtopk.selection._strategies import Codes
from jaxtopk.selection._strategies import DeltaSearch
from jaxtopk.selection._strategies import Exact
from jaxtopk.selection._strategies import KeyBound
from jaxtopk.selection._strategies import LowRank
from jaxtopk.selection._strategies import MCSearch
from jaxtopk.selection._strategies import SearchStrategy
from jaxtopk.selection._strategies import as_float
from jaxtopk.selection._strategies import as_int

# Every feature name a policy can ask for (see ``Policy.features``).
FEATURES = frozenset(
  {
    "policy=Dense",
    "policy=FixedK",
    "policy=Ratio",
    "policy=PowerLaw",
    "policy=Certified",
    "search=exact",
    "search=delta",
    "search=mc",
    "bound=box",
    "bound=lowrank",
    "bound=codes",
    "max_topk",
    "dense_above",
  }
)

# Exact per-row counts up to this many keys (a table lookup); beyond it the
# count formula runs in floats with a relative guard of 1e-6.
_TABLE_MAX = 1 << 16


class UnsupportedPolicyError(NotImplementedError, ValueError):
  """A backend cannot honour a policy field (raised by ``Policy.require``)."""


def capabilities(*features: str) -> frozenset[str]:
  """The feature set of a backend, with every name checked.

  Args:
    *features: names from ``FEATURES`` (e.g. 'policy=FixedK',
      'search=delta', 'bound=lowrank', 'max_topk').

  Returns:
    A frozenset for ``Policy.require``.

  Raises:
    ValueError: for a name that is not a feature.
  """
  unknown = set(features) - FEATURES
  if unknown:
    raise ValueError(
      f"unknown features {sorted(unknown)}; known: {sorted(FEATURES)}"
    )
  return frozenset(features)


class Policy:
  """Base class of selection policies.

  Attributes:
    kind: what decides the kept set: 'dense' (every key), 'count' (a kept
      count per row) or 'certified' (a TV budget); backends dispatch on it.
  """

  kind: ClassVar[str] = ""

  @property
  def needs_rng(self) -> bool:
    """Whether selecting draws random numbers (a PRNG key is needed)."""
    return False

  @property
  def scores_all(self) -> bool:
    """Whether every key is scored (none is bounded and left unscored)."""
    return True

  def num_kept(self, n: int) -> int | None:
    """Static number of kept keys for a row of ``n`` keys; None if dynamic."""
    return None

  def features(self) -> tuple[tuple[str, object, str], ...]:
    """``(field, value, feature)`` for every field this policy asks for.

    ``field`` names it in errors (``'Certified.max_topk'``), ``value`` is its
    value, ``feature`` its capability name (one of ``FEATURES``).
    """
    name = type(self).__name__
    return ((name, self, f"policy={name}"),)

  def require(self, backend: str, supports: Iterable[str]) -> None:
    """Raises unless ``backend`` honours every field of this policy.

    Args:
      backend: how the backend is named in the message, e.g.
        "decode_attention(implementation='pallas')".
      supports: the backend's feature names (``capabilities(...)``).

    Raises:
      UnsupportedPolicyError: naming the first field and value that the
        backend does not support, and what it does support.
    """
    supports = frozenset(supports)
    missing = self._first_unsupported(supports)
    if missing is not None:
      field, value = missing
      what = (
        f"{value!r}" if field == type(self).__name__ else f"{field}={value!r}"
      )
      raise UnsupportedPolicyError(
        f"{what} is not supported by {backend}; it supports {sorted(supports)}"
      )

  def supported_by(self, supports: Iterable[str]) -> bool:
    """Whether a backend with feature names ``supports`` honours every field
    of this policy (``require`` without the error)."""
    return self._first_unsupported(frozenset(supports)) is None

  def _first_unsupported(
    self, supports: frozenset
  ) -> tuple[str, object] | None:
    """``(field, value)`` of the first field ``supports`` lacks, or None."""
    for field, value, feature in self.features():
      if feature not in supports:
        return field, value
    return None


class FixedCount(Policy):
  """Base of the fixed-count policies: a kept count per row."""

  kind = "count"

  def num_kept(self, n: int) -> int:
    raise NotImplementedError

  def row_num_kept(self, n_real, n_keys: int) -> jax.Array:
    """Per-row kept count for rows of ``n_real`` real keys (traced).

    Equals ``num_kept(n_real)`` exactly for ``n_keys <= 65536`` (a table of
    the static counts); beyond, the formula in float32 with a relative guard
    of 1e-6 (within one key of it). Rows with no real key keep 0.

    Args:
      n_real: ``[...]`` int number of real keys of each row (<= n_keys).
      n_keys: static length of the key axis.

    Returns:
      ``[...]`` int32 in [min(1, n_real), n_real].
    """
    n_real = jnp.asarray(n_real, jnp.int32)
    if n_keys <= _TABLE_MAX:
      table = jnp.asarray(_count_table(self, n_keys))
      return table[jnp.clip(n_real, 0, n_keys)]
    k = self._float_count(n_real.astype(jnp.float32))
    k = jnp.clip(k.astype(jnp.int32), jnp.minimum(n_real, 1), n_real)
    return jnp.where(n_real == n_keys, self.num_kept(n_keys), k)

  def _float_count(self, nf):
    raise NotImplementedError


@functools.lru_cache(maxsize=64)
def _count_table(policy, n_keys: int) -> np.ndarray:
  """``[n_keys + 1]`` int32: ``policy.num_kept(j)`` for j >= 1, 0 for j = 0."""
  counts = [0] + [policy.num_kept(j) for j in range(1, n_keys + 1)]
  return np.asarray(counts, np.int32)


def _post(self, name, value):
  object.__setattr__(self, name, value)


@dataclasses.dataclass(frozen=True)
class Dense(FixedCount):
  """Keep every key: dense attention with a (zero) certificate."""

  kind = "dense"

  def num_kept(self, n: int) -> int:
    return n

  def row_num_kept(self, n_real, n_keys: int) -> jax.Array:
    return jnp.asarray(n_real, jnp.int32)


@dataclasses.dataclass(frozen=True)
class FixedK(FixedCount):
  """Keep the ``topk`` largest logits of each row (fewer if the row is short).

  Attributes:
    topk: number of kept keys, an int >= 1.
  """

  topk: int

  def __post_init__(self):
    _post(self, "topk", as_int("FixedK.topk", self.topk, minimum=1))

  def num_kept(self, n: int) -> int:
    return min(self.topk, n)

  def row_num_kept(self, n_real, n_keys: int) -> jax.Array:
    return jnp.minimum(jnp.asarray(n_real, jnp.int32), self.topk)


@dataclasses.dataclass(frozen=True)
class Ratio(FixedCount):
  """Keep the ``ceil(rho * n)`` largest logits (at least one).

  Attributes:
    rho: kept fraction in (0, 1]; rho = 1 is dense.
  """

  rho: float

  def __post_init__(self):
    _post(
      self,
      "rho",
      as_float("Ratio.rho", self.rho, low=0, high=1, high_open=False),
    )

  def num_kept(self, n: int) -> int:
    return max(1, min(n, math.ceil(self.rho * n - 1e-9)))

  def _float_count(self, nf):
    return jnp.ceil(self.rho * nf * (1 - 1e-6))


@dataclasses.dataclass(frozen=True)
class PowerLaw(FixedCount):
  """Dynamic window k = ceil(alpha * n**c) of [NC] (THEORY 7.1).

  Attributes:
    alpha: positive finite multiplier.
    c: exponent in (0, 1].
  """

  alpha: float
  c: float

  def __post_init__(self):
    _post(self, "alpha", as_float("PowerLaw.alpha", self.alpha, low=0))
    _post(
      self, "c", as_float("PowerLaw.c", self.c, low=0, high=1, high_open=False)
    )

  def num_kept(self, n: int) -> int:
    return max(1, min(n, math.ceil(self.alpha * n**self.c - 1e-9)))

  def _float_count(self, nf):
    return jnp.ceil(self.alpha * nf**self.c * (1 - 1e-6))


@dataclasses.dataclass(frozen=True, init=False)
class Certified(Policy):
  """Keep the fewest keys whose dropped mass is certified <= eps.

  THEORY 6.1-6.3. The certificate's tv_bound is <= eps on every valid row
  (unless ``max_topk`` caps the kept set; the row then reports its true,
  larger bound).

  Construction: ``Certified(eps)`` leaves the search to the backend
  (``Auto()``: the cheapest sound strategy it has for the inputs, the exact
  search where it has no cheaper one); ``Certified(eps, search)`` runs the
  strategy ``search`` as given: ``Exact()``, ``DeltaSearch(block_size,
  bound)`` (``Box()``, ``LowRank(rank)``, ``Codes()``),
  ``MCSearch(block_size, failure_prob, num_samples)`` or ``Auto()``, e.g.
  ``Certified(0.05, DeltaSearch(32, Codes()))``, ``Certified(0.01,
  MCSearch(failure_prob=0.05, num_samples=4))``. A strategy's name is a
  shorthand for its defaults: ``Certified(eps, 'delta')`` is
  ``Certified(eps, DeltaSearch())``.

  Deprecated (warns; removed in 0.3): the strategy's fields as keywords of
  ``Certified`` (``block_size``, ``delta``, ``num_samples``, ``bound``,
  ``rank``), e.g. ``Certified(0.05, 'delta', block_size=32)``; the warning
  names the strategy object to pass instead. A keyword that the chosen
  search does not read is refused by name, as is one next to a strategy
  object.

  Attributes:
    eps: TV budget in (0, 1).
    search: the search strategy (a ``SearchStrategy``).
    max_topk: optional static cap on the kept set (fixed-shape outputs); a
      row that cannot meet eps within it keeps the ``max_topk`` largest
      scored logits and reports its true (larger) bound.
    dense_above: optional fraction in (0, 1]. A row whose kept set would
      hold at least this fraction of its real keys (a lower bound on the
      size of the set eps allows, from one Cauchy-Schwarz pass or the first
      histogram pass of ``threshold.budget_threshold``) keeps every real
      key instead: the dense row, which its certificate
      shows (``k_kept`` every real key, ``tv_bound`` 0 up to rounding). Where
      every row of a call (or of a prefill tile) is such a row, the
      selection passes are skipped: a training mode that costs about what
      dense costs while little can be dropped (e.g. at initialisation), and
      selects once attention concentrates (with the default ``Auto``,
      ``topk_attention`` then scores every key at once rather than searching
      key blocks). Honoured where the kept set is chosen over scored logits
      (``select``, ``topk_attention``'s XLA path); refused by name
      elsewhere.

  Read-only views of the strategy's fields (None where the search has no
  such field): ``block_size``, ``num_samples``, ``bound`` (a ``KeyBound``),
  ``rank``; ``failure_prob`` (MC-Search's, else 0).
  """

  eps: float
  search: SearchStrategy
  max_topk: int | None
  dense_above: float | None
  kind = "certified"

  def __init__(
    self,
    eps,
    search="auto",
    block_size=None,
    delta=None,
    num_samples=None,
    max_topk=None,
    bound=None,
    rank=None,
    dense_above=None,
  ):
    _post(self, "eps", as_float("Certified.eps", eps, low=0, high=1))
    given = dict(
      block_size=block_size,
      delta=delta,
      num_samples=num_samples,
      bound=bound,
      rank=rank,
    )
    given = {k: v for k, v in given.items() if v is not None}
    made = _make_search(search, given)
    if given:
      _deprecation.warn(
        f"Certified({', '.join(f'{k}=' for k in given)}...)",
        f"the strategy: Certified({eps!r}, {made!r})",
      )
    _post(self, "search", made)
    if max_topk is not None:
      max_topk = as_int("Certified.max_topk", max_topk, minimum=1)
    _post(self, "max_topk", max_topk)
    if dense_above is not None:
      dense_above = as_float(
        "Certified.dense_above", dense_above, low=0, high=1, high_open=False
      )
    _post(self, "dense_above", dense_above)

  def features(self) -> tuple[tuple[str, object, str], ...]:
    out = [("Certified", self, "policy=Certified")]
    out.append(("Certified.search", self.search, self.search.feature))
    if isinstance(self.search, DeltaSearch):
      out.append(
        ("Certified.bound", self.search.bound, self.search.bound.feature)
      )
    if self.max_topk is not None:
      out.append(("Certified.max_topk", self.max_topk, "max_topk"))
    if self.dense_above is not None:
      out.append(("Certified.dense_above", self.dense_above, "dense_above"))
    return tuple(out)

  @property
  def block_size(self) -> int:
    return self.search.block_size

  @property
  def delta(self) -> float | None:
    """Deprecated (warns; removed in 0.3): ``failure_prob``."""
    _deprecation.warn("Certified.delta", "Certified.failure_prob")
    return self.search.failure_prob if self.search.needs_rng else None

  @property
  def num_samples(self) -> int | None:
    return getattr(self.search, "num_samples", None)

  @property
  def bound(self) -> KeyBound | None:
    return getattr(self.search, "bound", None)

  @property
  def rank(self) -> int | None:
    return getattr(self.bound, "rank", None)

  @property
  def failure_prob(self) -> float:
    return self.search.failure_prob

  @property
  def needs_rng(self) -> bool:
    return self.search.needs_rng

  @property
  def scores_all(self) -> bool:
    return self.search.scores_all


def _make_search(search, given) -> SearchStrategy:
  """Normalises ``Certified``'s search argument and keywords to a strategy."""
  if isinstance(search, SearchStrategy):
    if given:
      k, v = next(iter(given.items()))
      raise ValueError(
        f"Certified.{k}={v!r} conflicts with search={search!r}: set it on"
        " the strategy"
      )
    return search
  if not isinstance(search, str):
    raise TypeError(
      f"Certified.search={search!r} must be a SearchStrategy (Exact(),"
      f" DeltaSearch(...), MCSearch(...)) or one of"
      f" {sorted(_strategies.SEARCHES)}"
    )
  if search not in _strategies.SEARCHES:
    raise ValueError(
      f"Certified.search={search!r} must be one of"
      f" {sorted(_strategies.SEARCHES)}"
    )
  allowed = {
    "auto": ("block_size",),
    "exact": ("block_size",),
    "delta": ("block_size", "bound", "rank"),
    "mc": ("block_size", "delta", "num_samples"),
  }[search]
  for k, v in given.items():
    if k not in allowed:
      raise ValueError(
        f"Certified.{k}={v!r} is not read by search={search!r} (it applies"
        f" to {_users(k)}); remove it"
      )
  kw = {
    k: given[k] for k in ("block_size", "delta", "num_samples") if k in given
  }
  if "delta" in kw:
    kw["failure_prob"] = kw.pop("delta")
  if search != "delta":
    return _strategies.SEARCHES[search](**kw)
  bound = given.get("bound", "box")
  rank = given.get("rank")
  if isinstance(bound, KeyBound):
    if rank is not None:
      raise ValueError(
        f"Certified.rank={rank!r} conflicts with bound={bound!r}: set it on"
        " the bound"
      )
  elif not isinstance(bound, str):
    raise TypeError(
      f"Certified.bound={bound!r} must be 'box', 'lowrank', 'codes' or a"
      " KeyBound"
    )
  elif bound not in _strategies.BOUNDS:
    raise ValueError(
      f"Certified.bound={bound!r} must be one of {sorted(_strategies.BOUNDS)}"
    )
  elif bound == "lowrank":
    bound = LowRank(16 if rank is None else rank)
  elif rank is not None:
    raise ValueError(
      f"Certified.rank={rank!r} is not read by bound={bound!r} (it applies"
      " to bound='lowrank'); remove it"
    )
  else:
    bound = _strategies.BOUNDS[bound]()
  return DeltaSearch(bound=bound, **kw)


def _users(field):
  return {
    "block_size": "every search",
    "delta": "search='mc'",
    "num_samples": "search='mc'",
    "bound": "search='delta'",
    "rank": "search='delta' with bound='lowrank'",
  }[field]


__all__ = [
  "Auto",
  "Box",
  "Codes",
  "Certified",
  "DeltaSearch",
  "Dense",
  "Exact",
  "FEATURES",
  "FixedCount",
  "FixedK",
  "KeyBound",
  "LowRank",
  "MCSearch",
  "Policy",
  "PowerLaw",
  "Ratio",
  "SearchStrategy",
  "UnsupportedPolicyError",
  "capabilities",
]
