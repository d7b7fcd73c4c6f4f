"""A worker's niceness: Ray starts its worker processes at nice 15 unless the node's raylet was told otherwise
(`RAY_worker_niceness`), and a worker at 15 gives its cores to every other process of the node, Ray's own daemons
included. `specdec serve`'s local cluster and the KubeRay manifests start their nodes at 0; a worker that finds
itself above 0 says so once."""

from __future__ import annotations

import functools
import logging
import os

# Through Serve's logger, as a worker's start-up lines: into the replica's log file and `specdec serve`'s console.
serve_log = logging.getLogger("ray.serve")


@functools.cache
def checked_niceness() -> int:
    """This process's niceness, read (and, above 0, warned about) once."""
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    if niceness > 0:
        serve_log.warning(
            "this worker runs at nice %d: any other process of the node, Ray's own daemons included, takes its cores "
            "first; start the cluster's nodes with RAY_worker_niceness=0 (as `specdec serve` and k8s/ do)",
            niceness,
        )
    return niceness
