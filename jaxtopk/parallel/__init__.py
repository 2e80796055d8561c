"""Scale out: meshes, shard_map, and sharded certified Top-k attention.

DESIGN.md layer 6. Batch and head sharding are embarrassingly parallel;
key-sequence sharding keeps ONE global selection and ONE global, sound
certificate per row (see ``_kv_sharded.py`` and ``_global_select.py``).
Multi-host runs (one process per host, each holding only its own shards)
start with ``maybe_initialize_distributed`` and build global arrays from
process-local data (``_multihost.py``). Tooling lives in submodules:
``jaxtopk.parallel.launch`` (``LocalCluster`` runs such a program as several
processes on one machine over gloo CPU collectives) and
``jaxtopk.parallel.flags`` (absl flags of the mesh and the distributed
start-up).
"""

from jaxtopk import _deprecation
from jaxtopk.parallel import flags
from jaxtopk.parallel import launch
from jaxtopk.parallel._compat import shard_map
from jaxtopk.parallel._decode import cache_shardings
from jaxtopk.parallel._decode import decode_shard_attention
from jaxtopk.parallel._decode import sharded_decode_attention
from jaxtopk.parallel._global_select import global_certified_keep
from jaxtopk.parallel._global_select import global_topk_keep
from jaxtopk.parallel._hlo import Collective
from jaxtopk.parallel._hlo import collectives
from jaxtopk.parallel._hlo import communication_summary
from jaxtopk.parallel._kv_sharded import kv_shard_attention
from jaxtopk.parallel._kv_sharded import make_sharded_attention
from jaxtopk.parallel._kv_sharded import sharded_topk_attention
from jaxtopk.parallel._mesh import AXES
from jaxtopk.parallel._mesh import DATA
from jaxtopk.parallel._mesh import HEADS
from jaxtopk.parallel._mesh import KV
from jaxtopk.parallel._mesh import attention_specs
from jaxtopk.parallel._mesh import axis_or_none
from jaxtopk.parallel._mesh import make_mesh
from jaxtopk.parallel._mesh import mesh_from_flag
from jaxtopk.parallel._mesh import parse_mesh_flag
from jaxtopk.parallel._mesh import shard_attention_inputs
from jaxtopk.parallel._multihost import any_process
from jaxtopk.parallel._multihost import fail_fast
from jaxtopk.parallel._multihost import fetch
from jaxtopk.parallel._multihost import global_batch
from jaxtopk.parallel._multihost import is_main_process
from jaxtopk.parallel._multihost import make_global_array
from jaxtopk.parallel._multihost import maybe_initialize_distributed
from jaxtopk.parallel._multihost import process_local_slices
from jaxtopk.parallel._multihost import put_global
from jaxtopk.parallel._rules import ATTENTION_RULES
from jaxtopk.parallel._rules import activation_sharding
from jaxtopk.parallel._rules import param_shardings
from jaxtopk.parallel._rules import partition_spec
from jaxtopk.parallel._rules import shard_module

__all__ = [
  "activation_sharding",
  "any_process",
  "ATTENTION_RULES",
  "attention_specs",
  "AXES",
  "axis_or_none",
  "cache_shardings",
  "Collective",
  "collectives",
  "communication_summary",
  "DATA",
  "decode_shard_attention",
  "fail_fast",
  "fetch",
  "flags",
  "global_batch",
  "global_certified_keep",
  "global_topk_keep",
  "HEADS",
  "is_main_process",
  "KV",
  "kv_shard_attention",
  "launch",
  "make_global_array",
  "make_mesh",
  "make_sharded_attention",
  "maybe_initialize_distributed",
  "mesh_from_flag",
  "param_shardings",
  "parse_mesh_flag",
  "partition_spec",
  "process_local_slices",
  "put_global",
  "shard_attention_inputs",
  "shard_map",
  "shard_module",
  "sharded_decode_attention",
  "sharded_topk_attention",
]

# Names that moved to a submodule in 0.2.0: they work one more release, with
# a DeprecationWarning.
__getattr__ = _deprecation.moved(
  "jaxtopk.parallel",
  {
    "ClusterError": "launch.ClusterError",
    "LocalCluster": "launch.LocalCluster",
    "ProcessResult": "launch.ProcessResult",
    "free_port": "launch.free_port",
    "launch_local": "launch.launch_local",
    "define_mesh_flag": "flags.define_mesh_flag",
    "define_distributed_flags": "flags.define_distributed_flags",
  },
)
