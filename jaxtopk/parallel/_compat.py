"""One ``shard_map`` across the jax versions jaxtopk supports.

jax 0.10.x ships both ``jax.shard_map`` (keyword-only ``mesh``, ``in_specs``,
``out_specs``, ``check_vma``) and the deprecated
``jax.experimental.shard_map.shard_map`` (positional ``mesh``, ``in_specs``,
``out_specs``, ``check_rep``); newer releases drop the experimental one and
older ones lack ``jax.shard_map``. Everything in jaxtopk.parallel goes through
``shard_map`` below, which prefers the stable entry point.
"""

from collections.abc import Callable

import jax


def shard_map(
  f: Callable,
  *,
  mesh: jax.sharding.Mesh,
  in_specs,
  out_specs,
  check: bool = False,
) -> Callable:
  """``jax.shard_map`` if present, else the experimental one.

  Args:
    f: the per-shard function.
    mesh: the device mesh.
    in_specs: PartitionSpec pytree matching ``f``'s arguments.
    out_specs: PartitionSpec pytree matching ``f``'s outputs.
    check: whether jax checks replication/varying-ness of the outputs
      (``check_vma`` / ``check_rep``). jaxtopk's per-shard functions end with
      collectives that make their outputs equal on every shard of a reduced
      axis, which the checker cannot always prove, so it is off by default.

  Returns:
    The mapped function (not jitted).
  """
  if hasattr(jax, "shard_map"):
    return jax.shard_map(
      f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check
    )
  from jax.experimental import shard_map as legacy  # older jax

  return legacy.shard_map(
    f, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check
  )
