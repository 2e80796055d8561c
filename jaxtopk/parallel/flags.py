"""absl flags of scale-out programs: the mesh and the distributed start-up.

``define_mesh_flag`` gives a binary a ``--mesh`` flag (e.g.
``data=2,heads=4``, read by ``jaxtopk.parallel.mesh_from_flag``);
``define_distributed_flags`` the flags ``maybe_initialize_distributed``
reads (coordinator address, process count and id).
"""

from jaxtopk.parallel._mesh import define_mesh_flag
from jaxtopk.parallel._multihost import define_distributed_flags

__all__ = [
  "define_distributed_flags",
  "define_mesh_flag",
]
