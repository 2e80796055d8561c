"""Device meshes with named axes and mesh flags.

jaxtopk names three mesh axes (DESIGN.md layer 6):

- ``data``: the batch axis (embarrassingly parallel);
- ``heads``: attention heads (embarrassingly parallel, certificates per head);
- ``kv``: the key/value sequence (long contexts and decode). Attention over a
  ``kv``-sharded context needs collectives, and its certificate stays global
  (see ``_kv_sharded.py``).

A mesh may use any subset of these names; an axis a mesh lacks is simply not
sharded. Meshes are built with ``jax.make_mesh`` and ``AxisType.Auto`` (jax
0.10 defaults to ``Explicit`` axes, whose sharding-in-types rules would make
every jitted caller of jaxtopk spell out its shardings; ``Auto`` keeps the
classic GSPMD behaviour that shard_map and NamedSharding users expect).

Experiments take a ``--mesh`` flag such as ``data=4,heads=2`` (see
``define_mesh_flag`` and ``mesh_from_flag``) and call
``maybe_initialize_distributed()`` (``_multihost.py``) first so the same
binary runs multi-host.
"""

import math
import re
from collections.abc import Mapping
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

DATA = "data"
HEADS = "heads"
KV = "kv"
AXES = (DATA, HEADS, KV)

_AXIS_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(-?\d+)\s*$")


def make_mesh(
  axes: Mapping[str, int], *, devices: Sequence[jax.Device] | None = None
) -> jax.sharding.Mesh:
  """A mesh over ``devices`` (default: all) with named axes.

  Args:
    axes: ordered mapping from axis name to size; one size may be -1, meaning
      "all remaining devices".
    devices: the devices to use (default ``jax.devices()``); the product of
      the sizes must equal their number.

  Returns:
    A ``jax.sharding.Mesh`` with ``AxisType.Auto`` axes.

  Raises:
    ValueError: for an empty mapping, a size < 1 other than a single -1, or
      sizes whose product does not match the device count.

  Example:
    >>> mesh = make_mesh({"data": 1})
    >>> mesh.shape["data"]
    1
  """
  devices = list(jax.devices() if devices is None else devices)
  names = tuple(axes)
  sizes = [int(s) for s in axes.values()]
  if not names:
    raise ValueError(f"{axes=} must name at least one mesh axis")
  if len(set(names)) != len(names):
    raise ValueError(f"mesh axis names must be distinct; got {names=}")
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one mesh axis size may be -1; got {axes=}")
  if any(s < 1 and s != -1 for s in sizes):
    raise ValueError(f"mesh axis sizes must be >= 1 (or one -1); got {axes=}")
  if -1 in sizes:
    rest = math.prod(s for s in sizes if s != -1)
    if len(devices) % rest:
      raise ValueError(
        f"{axes=}: the fixed sizes (product {rest}) do not divide the"
        f" {len(devices)} devices"
      )
    sizes[sizes.index(-1)] = len(devices) // rest
  if math.prod(sizes) != len(devices):
    raise ValueError(
      f"mesh {dict(zip(names, sizes, strict=True))} needs {math.prod(sizes)}"
      f" devices but {len(devices)} are available"
    )
  return jax.make_mesh(
    tuple(sizes),
    names,
    axis_types=(jax.sharding.AxisType.Auto,) * len(names),
    devices=devices,
  )


def parse_mesh_flag(spec: str) -> dict[str, int]:
  """Parses ``"data=4,heads=2"`` into ``{"data": 4, "heads": 2}``.

  An empty spec means ``{"data": -1}`` (every device on the batch axis).

  Raises:
    ValueError: naming the malformed entry.
  """
  spec = spec.strip()
  if not spec:
    return {DATA: -1}
  out = {}
  for part in spec.split(","):
    m = _AXIS_RE.match(part)
    if not m:
      raise ValueError(
        f"mesh flag entry {part!r} in {spec=} must look like name=size"
      )
    name, size = m.group(1), int(m.group(2))
    if name in out:
      raise ValueError(f"mesh axis {name!r} repeated in {spec=}")
    out[name] = size
  return out


def mesh_from_flag(
  spec: str, *, devices: Sequence[jax.Device] | None = None
) -> jax.sharding.Mesh:
  """A mesh from a flag value such as ``"data=4,heads=2"`` or ``"kv=-1"``.

  Args:
    spec: comma-separated ``name=size`` entries, in mesh order; one size may
      be -1. Empty: all devices on ``data``.
    devices: devices to use (default all, across hosts when
      ``jax.distributed`` is initialised).

  Returns:
    The mesh (see ``make_mesh``).

  Example:
    >>> mesh_from_flag("kv=-1").axis_names
    ('kv',)
  """
  return make_mesh(parse_mesh_flag(spec), devices=devices)


def define_mesh_flag(name: str = "mesh", default: str = "", flag_values=None):
  """Defines an absl string flag for a mesh spec; returns its FlagHolder.

  Example (in an experiment binary)::

    _MESH = parallel.flags.define_mesh_flag()
    ...
    mesh = parallel.mesh_from_flag(_MESH.value)
  """
  from absl import flags

  return flags.DEFINE_string(
    name,
    default,
    "Device mesh, e.g. 'data=4,heads=2' or 'kv=-1' (one size may be -1 for"
    " 'the remaining devices'); axes: data (batch), heads, kv (key sequence)."
    " Empty: all devices on data.",
    flag_values=flag_values if flag_values is not None else flags.FLAGS,
  )


def axis_or_none(mesh: jax.sharding.Mesh, name: str | None) -> str | None:
  """``name`` if the mesh has that axis with size > 1, else None."""
  if name is None or name not in mesh.shape or mesh.shape[name] == 1:
    return None
  return name


def context_mesh(user: str):
  """The mesh of ``jax.set_mesh`` (the abstract one inside jit).

  Args:
    user: how errors name the caller, e.g.
      "topk_attention(implementation='sharded')".

  Raises:
    NotImplementedError: no mesh is set (a refusal of the registry's
      sharded ops: ``('sharded', 'xla')`` then runs 'xla').
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    raise NotImplementedError(
      f"{user} needs a mesh: call it under jax.set_mesh(mesh) (axes named"
      f" {AXES} are sharded)"
    )
  try:
    concrete = jax.sharding.get_mesh()  # outside jit: the device mesh
  except ValueError:  # inside jit, only the abstract mesh is known
    return mesh
  return mesh if concrete.empty else concrete


def attention_specs(
  mesh: jax.sharding.Mesh,
  *,
  batch_axis: str | None = DATA,
  head_axis: str | None = HEADS,
  kv_axis: str | None = KV,
) -> tuple[P, P]:
  """PartitionSpecs for ``[batch, seq, heads, head_dim]`` queries and keys.

  Queries are sharded over batch and heads and replicated over ``kv``; keys
  and values are also sharded along their sequence axis over ``kv``.

  Returns:
    ``(query_spec, kv_spec)``.
  """
  b = axis_or_none(mesh, batch_axis)
  h = axis_or_none(mesh, head_axis)
  s = axis_or_none(mesh, kv_axis)
  return P(b, None, h, None), P(b, s, h, None)


def shard_attention_inputs(
  mesh: jax.sharding.Mesh,
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  **axes,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``device_put``s ``[batch, seq, heads, head_dim]`` q, k, v on the mesh."""
  q_spec, kv_spec = attention_specs(mesh, **axes)
  return (
    jax.device_put(query, NamedSharding(mesh, q_spec)),
    jax.device_put(key, NamedSharding(mesh, kv_spec)),
    jax.device_put(value, NamedSharding(mesh, kv_spec)),
  )
