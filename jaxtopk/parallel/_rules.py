"""Sharding rules for the Flax layers' parameters and activations.

``jaxtopk.nn.CertifiedTopKAttention`` (an ``nnx.MultiHeadAttention``) holds
``query``/``key``/``value`` kernels ``[in_features, heads, head_dim]`` with
biases ``[heads, head_dim]``, and an ``out`` kernel ``[heads, head_dim,
out_features]``. Sharding their heads axis over the mesh's ``heads`` axis
(Megatron-style) keeps every attention head on one device: the q/k/v
projections need no communication, and the output projection ends with one
reduction over heads that XLA's partitioner inserts. Activations
``[batch, seq, features]`` are sharded over ``data``.

Rules are (regex on the parameter path joined by '/', per-dim mesh axes;
an NNX state path ends in the Variable's '/value');
the first match wins; unmatched parameters are replicated. A rule whose axis
the mesh lacks, or whose dim that axis does not divide, leaves that dim
replicated, so one rule table serves every mesh.
"""

import re
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtopk.parallel import _mesh

ATTENTION_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
  (r"(^|/)(query|key|value)/kernel(/value)?$", (None, _mesh.HEADS, None)),
  (r"(^|/)(query|key|value)/bias(/value)?$", (_mesh.HEADS, None)),
  (r"(^|/)out/kernel(/value)?$", (_mesh.HEADS, None, None)),
)


def _path_str(path) -> str:
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def partition_spec(
  path: str,
  shape: Sequence[int],
  mesh: jax.sharding.Mesh,
  rules=ATTENTION_RULES,
) -> P:
  """The PartitionSpec of one parameter under ``rules`` (see module doc)."""
  for pattern, axes in rules:
    if re.search(pattern, path) and len(axes) == len(shape):
      spec = []
      for size, ax in zip(shape, axes, strict=True):
        ax = _mesh.axis_or_none(mesh, ax)
        spec.append(
          ax if ax is not None and size % mesh.shape[ax] == 0 else None
        )
      return P(*spec)
  return P()


def param_shardings(state, mesh: jax.sharding.Mesh, rules=ATTENTION_RULES):
  """NamedShardings for every leaf of an ``nnx.State`` (or any pytree).

  Args:
    state: e.g. ``nnx.state(model, nnx.Param)``.
    mesh: the mesh.
    rules: (regex, per-dim axes) pairs, first match wins.

  Returns:
    A pytree like ``state`` of ``NamedSharding``.
  """

  def one(path, leaf):
    spec = partition_spec(_path_str(path), leaf.shape, mesh, rules)
    return NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(one, state)


def shard_module(module, mesh: jax.sharding.Mesh, rules=ATTENTION_RULES):
  """Places an NNX module's parameters on ``mesh`` following ``rules``.

  Args:
    module: an ``nnx.Module`` (e.g. containing CertifiedTopKAttention).
    mesh: the mesh.
    rules: (regex, per-dim axes) pairs.

  Returns:
    The parameters' shardings (a pytree like ``nnx.state(module,
    nnx.Param)``); the module is updated in place.

  Example:
    >>> from flax import nnx
    >>> import jaxtopk, jaxtopk.nn
    >>> layer = jaxtopk.nn.CertifiedTopKAttention(
    ...     num_heads=2, in_features=4, policy=jaxtopk.FixedK(2),
    ...     decode=False, rngs=nnx.Rngs(0))
    >>> mesh = jaxtopk.parallel.make_mesh({"heads": 1})
    >>> _ = jaxtopk.parallel.shard_module(layer, mesh)
  """
  from flax import nnx

  state = nnx.state(module, nnx.Param)
  shardings = param_shardings(state, mesh, rules)
  nnx.update(module, jax.device_put(state, shardings))
  return shardings


def activation_sharding(
  mesh: jax.sharding.Mesh, ndim: int = 3, batch_axis: str | None = _mesh.DATA
) -> NamedSharding:
  """``[batch, ...]`` activations sharded over ``batch_axis`` (if present)."""
  return NamedSharding(
    mesh, P(_mesh.axis_or_none(mesh, batch_axis), *([None] * (ndim - 1)))
  )
