"""Communication volume of a compiled program, read from its HLO text.

``jax.jit(f).lower(...).compile().as_text()`` lists every collective the
partitioner and shard_map produced. ``collectives(text)`` parses them;
``communication_summary(text)`` totals their result bytes per kind, and an
estimate of the bytes each device sends with ring algorithms:

- all-reduce of B bytes over a group of G: 2 (G - 1) / G * B;
- all-gather / reduce-scatter to (from) a result of B bytes: (G - 1) / G * B;
- all-to-all of B bytes: (G - 1) / G * B;
- collective-permute of B bytes: B.

Asynchronous pairs (``*-start`` / ``*-done``) are counted once, at the start.
"""

import dataclasses
import math
import re

_KINDS = (
  "all-reduce",
  "all-gather",
  "reduce-scatter",
  "all-to-all",
  "collective-permute",
)
_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}
_LINE = re.compile(
  r"=\s*(?P<result>\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
  r"(?P<kind>" + "|".join(_KINDS) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_GROUPS = re.compile(r"replica_groups=\{(\{[0-9,]*\})")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
# Named-mesh form: replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}
# (the group spans the listed axes).
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'([^']+)'\s*=\s*(\d+)")
_COMMENT = re.compile(r"/\*.*?\*/")  # e.g. /*index=5*/ inside long tuples


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction.

  Attributes:
    kind: 'all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all' or
      'collective-permute'.
    result_bytes: bytes of its result per device (for an async start, of the
      gathered output only).
    group_size: devices per replica group (1 if not stated).
    shapes: the result arrays as ``dtype[dims]`` strings.
  """

  kind: str
  result_bytes: int
  group_size: int
  shapes: tuple[str, ...]

  @property
  def sent_bytes(self) -> float:
    """Estimated bytes each device sends (ring algorithms)."""
    g = self.group_size
    if self.kind == "collective-permute":
      return float(self.result_bytes)
    if g <= 1:
      return 0.0
    factor = 2.0 if self.kind == "all-reduce" else 1.0
    return factor * (g - 1) / g * self.result_bytes


def _array_bytes(dtype: str, dims: str) -> int:
  if dtype not in _BYTES:
    raise ValueError(f"unknown HLO element type {dtype=}")
  shape = [int(x) for x in dims.split(",") if x]
  return _BYTES[dtype] * math.prod(shape)


def _group_size(line: str) -> int:
  m = _MESH_GROUPS.search(line)
  if m:
    sizes = {name: int(size) for name, size in _MESH_AXIS.findall(m.group(1))}
    names = re.findall(r"'([^']+)'", m.group(2))
    return math.prod(sizes[name] for name in names)
  m = _IOTA_GROUPS.search(line)
  if m:
    return int(m.group(2))
  m = _GROUPS.search(line)
  if m:
    return len([x for x in m.group(1).strip("{}").split(",") if x])
  return 1


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective in an HLO module's text, in order.

  Args:
    hlo_text: e.g. ``jax.jit(f).lower(*args).compile().as_text()``.

  Returns:
    A list of ``Collective``.
  """
  out = []
  for line in hlo_text.splitlines():
    line = _COMMENT.sub("", line)
    m = _LINE.search(line)
    if not m:
      continue
    arrays = _ARRAY.findall(m.group("result"))
    if m.group("start") and m.group("kind") != "all-reduce":
      # Async start of a gather/permute: the result tuple holds the operand
      # and the output (and small contexts); count the largest buffer.
      arrays = [max(arrays, key=lambda a: _array_bytes(*a))]
    out.append(
      Collective(
        kind=m.group("kind"),
        result_bytes=sum(_array_bytes(t, d) for t, d in arrays),
        group_size=_group_size(line),
        shapes=tuple(f"{t}[{d}]" for t, d in arrays),
      )
    )
  return out


def communication_summary(hlo_text: str) -> dict:
  """Totals per collective kind and overall.

  Returns:
    ``{"count": int, "result_bytes": int, "sent_bytes": float,
    "by_kind": {kind: {"count", "result_bytes", "sent_bytes"}}}``.
  """
  ops = collectives(hlo_text)
  by_kind = {}
  for op in ops:
    k = by_kind.setdefault(
      op.kind, {"count": 0, "result_bytes": 0, "sent_bytes": 0.0}
    )
    k["count"] += 1
    k["result_bytes"] += op.result_bytes
    k["sent_bytes"] += op.sent_bytes
  return {
    "count": len(ops),
    "result_bytes": sum(op.result_bytes for op in ops),
    "sent_bytes": sum(op.sent_bytes for op in ops),
    "by_kind": by_kind,
  }
