"""One registry of attention ops: every path a call can take, and what it
honours, declared once.

An op (``AttentionOp``) is one implementation of one kind of call:
'prefill' (``topk_attention``) or 'decode' (``decode_attention``). It
declares in one place what it supports:

- ``supports``: the policy features it honours
  (``selection.internal.capabilities``),
  or ``supports_fn(policy)`` where that depends on the policy (the content
  index honours ``max_topk`` with the exact search, not with its group
  searches);
- ``arguments``: the optional arguments it takes (``PREFILL_ARGUMENTS`` /
  ``DECODE_ARGUMENTS``; 'traced_scale' is a scale that is not a Python
  number);
- ``masks``: 'any' (per-row masks) or 'padding' (key-padding masks only);
- ``cache_types``: the cache classes a decode op attends over;
- ``platforms``: the jax backends it runs on.

``OPS`` maps op names ('xla_prefill', 'index_decode', ...) to ops, in
registration order; each path's module registers its op (``register``),
``jaxtopk.kernels`` and ``jaxtopk.parallel`` theirs when imported.

Dispatch (``dispatch``): ``implementation=`` names an implementation
('xla', 'pallas', 'sharded'), or a sequence of them tried in order, e.g.
``('pallas', 'xla')``; None is the default ('xla'). For each name, the ops
of that implementation and kind that attend over the given cache type are
tried; one that refuses the call (an unsupported policy field, argument,
mask, platform or cache type: ``UnsupportedPolicyError`` or another
``NotImplementedError`` naming it) falls through to the next. A single name
that refuses raises its refusal unchanged; when every name of a sequence
refuses, one error lists each refusal. An unknown name is a ValueError, never
skipped.
"""

import dataclasses
import inspect
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxtopk import _deprecation
from jaxtopk.selection import Policy
from jaxtopk.selection import UnsupportedPolicyError

# The optional arguments of topk_attention an op may take (besides query,
# key, value, policy, values_bound), and of decode_attention ('multi_query':
# a query of q_len > 1 steps).
PREFILL_ARGUMENTS = frozenset(
  {
    "bias",
    "mask",
    "is_causal",
    "query_seq_lengths",
    "key_value_seq_lengths",
    "local_window_size",
    "return_residual",
    "traced_scale",
  }
)
DECODE_ARGUMENTS = frozenset({"multi_query", "return_residual", "traced_scale"})
PLATFORMS = frozenset({"cpu", "gpu", "tpu"})
KINDS = ("prefill", "decode")
MASKS = ("any", "padding")
# The implementation names that ``implementation=None`` tries, per kind.
DEFAULT = ("xla",)


class UnsupportedCacheError(NotImplementedError, ValueError):
  """No op of the requested implementation attends over this cache type."""


def _takes_key_not_rng(fn) -> bool:
  """Whether a decode op's ``fn`` names its PRNG key ``key`` (the name
  before 0.2.0) and not ``rng``."""
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):  # not introspectable (or None)
    return False
  return "key" in params and "rng" not in params


def _rng_as_key(fn):
  """``fn`` called with ``rng=`` passed on as ``key=``. (Not
  ``functools.wraps``: its signature would show ``key`` again, and an op
  rebuilt from this one, e.g. by ``dataclasses.replace``, would be wrapped
  twice.)"""

  def call(query, cache, *, rng, **kw):
    return fn(query, cache, key=rng, **kw)

  return call


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionOp:
  """One attention path and what it honours (see the module docstring).

  Attributes:
    name: unique op name, e.g. 'xla_prefill', 'index_decode'.
    implementation: the name users pass as ``implementation=``.
    kind: 'prefill' or 'decode'.
    fn: the implementation. Prefill: ``fn(query, key, value, *, policy,
      mask, bias, is_causal, scale, query_seq_lengths, key_value_seq_lengths,
      local_window_size, values_bound, return_residual) -> (output,
      Certificate, lse)`` on checked, batched arguments (``lse`` None unless
      ``return_residual``). Decode: ``fn(query, cache, *, policy, scale,
      rng) -> (output, Certificate)`` on unchecked arguments (it checks
      its own shapes, scale and PRNG key ``rng``; a decode ``fn`` that
      takes the deprecated ``key=`` instead is called with it and warns);
      an op that takes
      'return_residual' is called with ``return_residual=True`` when asked
      and then returns ``(output, Certificate, lse)``.
    label: how errors name the path, e.g.
      "topk_attention(implementation='xla')".
    supports: policy features honoured (``selection.internal.capabilities``).
    supports_fn: ``policy -> features`` where they depend on the policy
      (replaces ``supports``).
    arguments: optional arguments taken (``PREFILL_ARGUMENTS`` or
      ``DECODE_ARGUMENTS``).
    masks: 'any' or 'padding' (key-padding masks only).
    cache_types: cache classes a decode op attends over.
    platforms: jax backends it runs on (``jax.default_backend()``).
  """

  name: str
  implementation: str
  kind: str
  fn: Callable
  label: str
  supports: frozenset[str] = frozenset()
  supports_fn: Callable[[Policy], frozenset[str]] | None = None
  arguments: frozenset[str] = frozenset()
  masks: str = "any"
  cache_types: tuple[type, ...] = ()
  platforms: frozenset[str] = PLATFORMS

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"{self.kind=} must be one of {KINDS}")
    if self.masks not in MASKS:
      raise ValueError(f"{self.masks=} must be one of {MASKS}")
    known = PREFILL_ARGUMENTS if self.kind == "prefill" else DECODE_ARGUMENTS
    if not self.arguments <= known:
      raise ValueError(
        f"unknown arguments {sorted(self.arguments - known)} of op"
        f" {self.name!r}; known: {sorted(known)}"
      )
    if not self.platforms <= PLATFORMS:
      raise ValueError(f"{self.platforms=} must be a subset of {PLATFORMS}")
    if (self.kind == "decode") != bool(self.cache_types):
      raise ValueError(
        f"op {self.name!r}: a decode op names its cache types, a prefill op"
        " none"
      )
    if self.kind == "decode" and _takes_key_not_rng(self.fn):
      _deprecation.warn(
        f"decode op {self.name!r}: fn(..., key=) for the PRNG key",
        "fn(..., rng=)",
        stacklevel=3,
      )
      object.__setattr__(self, "fn", _rng_as_key(self.fn))

  def supported(self, policy: Policy) -> frozenset[str]:
    """The policy features this op honours for ``policy``."""
    if self.supports_fn is not None:
      return frozenset(self.supports_fn(policy))
    return self.supports

  def takes_cache(self, cache) -> bool:
    return isinstance(cache, self.cache_types)

  def refusal(
    self, policy, *, given=frozenset(), mask_shape=None
  ) -> NotImplementedError | None:
    """Why this op cannot take the call, or None if it can.

    Args:
      policy: the (type-checked) selection policy.
      given: names of the optional arguments the call uses (of
        ``arguments``' vocabulary).
      mask_shape: the shape of the call's mask, if any.

    Returns:
      None, or the error naming what is refused: ``UnsupportedPolicyError``
      (a policy field), NotImplementedError (an argument, a mask, the
      platform).
    """
    try:
      policy.require(self.label, self.supported(policy))
    except UnsupportedPolicyError as e:
      return e
    for name in sorted(set(given) - self.arguments):
      if name == "traced_scale":
        return NotImplementedError(
          f"{self.label} needs a static (Python number) scale; got a traced"
          " array. Use implementation='xla' for a traced scale."
        )
      if name == "multi_query":
        return NotImplementedError(
          f"{self.label} attends one query step per sequence (q_len = 1);"
          " got a query of q_len > 1. Use implementation='xla'."
        )
      return NotImplementedError(
        f"{self.label} does not take {name}=; use implementation='xla'"
      )
    if self.masks == "padding" and not _is_key_padding(mask_shape):
      return NotImplementedError(
        f"{self.label} supports key-padding masks that broadcast from"
        f" [batch, 1, 1, kv_len]; got mask.shape={mask_shape}."
      )
    platform = jax.default_backend()
    if platform not in self.platforms:
      return NotImplementedError(
        f"{self.label} does not run on {platform!r}; it runs on"
        f" {sorted(self.platforms)}"
      )
    return None

  def require(self, policy, *, given=frozenset(), mask_shape=None) -> None:
    """Raises ``refusal``'s error, if any."""
    error = self.refusal(policy, given=given, mask_shape=mask_shape)
    if error is not None:
      raise error


def _is_key_padding(mask_shape) -> bool:
  if mask_shape is None:
    return True
  shape = (1,) * (4 - len(mask_shape)) + tuple(mask_shape)
  return shape[1] == 1 and shape[2] == 1


def prefill_arguments(
  *,
  bias=None,
  mask=None,
  is_causal=False,
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  local_window_size=None,
  return_residual=False,
  scale=None,
) -> frozenset[str]:
  """The optional arguments a prefill call uses (``PREFILL_ARGUMENTS``)."""
  given = {
    name
    for name, value in (
      ("bias", bias),
      ("mask", mask),
      ("query_seq_lengths", query_seq_lengths),
      ("key_value_seq_lengths", key_value_seq_lengths),
      ("local_window_size", local_window_size),
    )
    if value is not None
  }
  if is_causal:
    given.add("is_causal")
  if return_residual:
    given.add("return_residual")
  return frozenset(given | scale_arguments(scale))


def decode_arguments(query, *, scale=None, return_residual=False):
  """The optional arguments a decode call uses (``DECODE_ARGUMENTS``)."""
  given = set(scale_arguments(scale))
  if jnp.ndim(query) == 4 and jnp.shape(query)[1] > 1:
    given.add("multi_query")
  if return_residual:
    given.add("return_residual")
  return frozenset(given)


def scale_arguments(scale) -> frozenset[str]:
  """{'traced_scale'} for a scale that is a JAX array, else empty."""
  return frozenset({"traced_scale"} if isinstance(scale, jax.Array) else ())


OPS: dict[str, AttentionOp] = {}


def register(op: AttentionOp) -> AttentionOp:
  """Adds ``op`` to ``OPS`` (replacing an op of the same name); returns it."""
  OPS.pop(op.name, None)  # a re-registered op goes to the end of the order
  OPS[op.name] = op
  return op


def ops(kind: str, implementation: str | None = None) -> list[AttentionOp]:
  """The registered ops of ``kind`` (of one implementation if given)."""
  return [
    op
    for op in OPS.values()
    if op.kind == kind
    and (implementation is None or op.implementation == implementation)
  ]


def implementations(kind: str) -> list[str]:
  """The implementation names registered for ``kind``, in order."""
  return list(dict.fromkeys(op.implementation for op in ops(kind)))


def names(implementation, kind: str) -> tuple[str, ...]:
  """``implementation=`` as a tuple of implementation names, checked.

  Raises:
    ValueError: an empty sequence, or a name that is neither registered
      for ``kind`` nor 'pallas' (known, refused when not registered).
  """
  if implementation is None:
    return DEFAULT
  if isinstance(implementation, str):
    given = (implementation,)
  elif isinstance(implementation, Sequence) and implementation:
    given = tuple(implementation)
  else:
    given = (implementation,)
  known = implementations(kind)
  for name in given:
    if name not in known and name != "pallas":
      raise ValueError(
        f"implementation={implementation!r}: {name!r} is not one of"
        f" {[None, *known]} (or a sequence of them, tried in order)"
      )
  return given


def dispatch(
  kind: str,
  implementation,
  call: Callable[[AttentionOp], object],
  *,
  policy: Policy,
  cache=None,
  given=frozenset(),
  mask_shape=None,
):
  """``call(op)`` of the first op of ``implementation`` that takes the call.

  Args:
    kind: 'prefill' or 'decode'.
    implementation: None, a name, or a sequence of names (``names``).
    call: runs an op on the call's arguments.
    policy: the call's (type-checked) policy.
    cache: the cache of a decode call (chooses the ops by type).
    given: the optional arguments the call uses (``AttentionOp.refusal``).
    mask_shape: the call's mask shape, if any.

  Returns:
    What ``call`` returns for the first op that does not refuse.

  Raises:
    ValueError: an unknown implementation name.
    UnsupportedPolicyError, UnsupportedCacheError, NotImplementedError: a
      single name refuses (its error, unchanged), or every name of a
      sequence refuses (one error listing each refusal).
  """
  requested = names(implementation, kind)
  refusals: list[tuple[str, NotImplementedError]] = []
  for name in requested:
    for op in _candidates(kind, name, cache, refusals):
      error = op.refusal(policy, given=given, mask_shape=mask_shape)
      if error is None:
        try:
          return call(op)
        except NotImplementedError as e:  # a refusal the op found itself
          error = e
      refusals.append((name, error))
  if len(refusals) == 1:
    raise refusals[0][1]
  kinds = {type(e) for _, e in refusals}
  cls = kinds.pop() if len(kinds) == 1 else NotImplementedError
  lines = "; ".join(f"{name!r}: {e}" for name, e in refusals)
  raise cls(
    f"no op of implementation={implementation!r} takes this call: {lines}"
  )


def _candidates(kind, name, cache, refusals) -> list[AttentionOp]:
  """The ops of ``name`` for the call (of the cache's type for decode);
  none: the refusal appended to ``refusals``."""
  candidates = ops(kind, name)
  if not candidates:
    refusals.append(
      (
        name,
        NotImplementedError(
          f"implementation={name!r} is not registered; use None or 'xla'"
        ),
      )
    )
    return []
  if kind == "decode":
    fitting = [op for op in candidates if op.takes_cache(cache)]
    if not fitting:
      types = sorted({t.__name__ for op in candidates for t in op.cache_types})
      error = UnsupportedCacheError(
        f"implementation={name!r} is not available for a"
        f" {type(cache).__name__}; its ops attend over {types}"
      )
      refusals.append((name, error))
    return fitting
  return candidates


class ImplementationView(Mapping):
  """``{implementation name: fn}`` of one kind, read from ``OPS``.

  ``None`` maps to the default. For decode, the op over ``cache_type``.
  """

  def __init__(self, kind: str, cache_type: type | None = None):
    self._kind = kind
    self._cache_type = cache_type

  def _op(self, name) -> AttentionOp | None:
    name = DEFAULT[0] if name is None else name
    for op in ops(self._kind, name):
      if self._cache_type is None or self._cache_type in op.cache_types:
        return op
    return None

  def __getitem__(self, name) -> Callable:
    op = self._op(name)
    if op is None:
      raise KeyError(name)
    return op.fn

  def __iter__(self):
    return iter(n for n in [None, *implementations(self._kind)] if self._op(n))

  def __len__(self) -> int:
    return sum(1 for _ in self)
