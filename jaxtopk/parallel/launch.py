"""Launching a multi-process program on one machine (tests, examples).

``LocalCluster`` runs a jax program as several processes on this machine,
talking over gloo CPU collectives on 127.0.0.1: multi-host code tested for
real without a pod. Launcher tooling, not attention: it lives here rather
than at the top of ``jaxtopk.parallel``.
"""

from jaxtopk.parallel._local_cluster import ClusterError
from jaxtopk.parallel._local_cluster import LocalCluster
from jaxtopk.parallel._local_cluster import ProcessResult
from jaxtopk.parallel._local_cluster import free_port
from jaxtopk.parallel._local_cluster import launch_local

__all__ = [
  "ClusterError",
  "free_port",
  "launch_local",
  "LocalCluster",
  "ProcessResult",
]
