"""Finding the workers: the addresses their replicas registered (`deployments.worker_registry`), waited for when a
router starts and followed while it serves, for the router's replica pools (`deployments.replica_pool.ReplicaPool`)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import ray

from deployments import worker_registry
from deployments.replica_pool import ReplicaPool
from deployments.status import WorkerUnavailable

log = logging.getLogger(__name__)


def wait_for_workers(app: str, kind: str, expected: int, timeout_s: float) -> list[str]:
    """Addresses of `kind` workers once `expected` replicas registered (fewer, at least one, at the timeout)."""
    reg = worker_registry.registry()
    deadline = time.monotonic() + timeout_s
    while True:
        addresses = ray.get(reg.addresses.remote(app, kind))
        if len(addresses) >= expected or (addresses and time.monotonic() > deadline):
            return addresses
        if time.monotonic() > deadline:
            raise WorkerUnavailable(f"no {kind} worker registered within {timeout_s:.0f} s")
        time.sleep(0.5)


REPORT_S = 1.0  # how often a router reports its waiting sessions (autoscaling)


class WorkerFollower:
    """Replicas come and go (autoscaling, restarts): re-read the registry every `refresh_s`, and soon after a
    replica of a pool failed (its replacement registers under a new address). Each pool follows the workers of its
    `kind`. With `waiting` (sessions that want a worker's slot and have none, by kind), report it to the registry
    every `REPORT_S`, for the workers' autoscaling (`deployments.autoscaling`). Runs on a thread of its own from
    construction until `stop`."""

    def __init__(
        self,
        app: str,
        pools: Sequence[ReplicaPool],
        refresh_s: float,
        waiting: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.app = app
        self.pools = list(pools)
        self.refresh_s = refresh_s
        self.waiting = waiting
        self._id = uuid.uuid4().hex
        self._next_report = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="follow-workers", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.waiting is not None:
            try:  # this router's waiting sessions end with it
                worker_registry.registry().report_waiting.remote(self.app, self._id, {})
            except Exception:  # the cluster may be going down
                pass

    def _report(self, reg: ray.actor.ActorHandle) -> None:
        """`waiting` reads counters that the engine's thread writes, without a lock: a count a round stale is good
        enough for a decision averaged over seconds."""
        if self.waiting is None or time.monotonic() < self._next_report:
            return
        self._next_report = time.monotonic() + REPORT_S
        try:
            reg.report_waiting.remote(self.app, self._id, self.waiting())
        except Exception:
            log.warning("could not report waiting sessions", exc_info=True)

    def _run(self) -> None:
        reg = worker_registry.registry()
        while not self._stop.is_set():
            deadline = time.monotonic() + self.refresh_s
            while time.monotonic() < deadline and not any(p.failure.is_set() for p in self.pools):
                self._report(reg)
                if self._stop.wait(0.2):
                    return
            failed = any(p.failure.is_set() for p in self.pools)
            for pool in self.pools:
                pool.failure.clear()
            if failed:
                time.sleep(1.0)  # let Serve notice the death and the replacement register
            try:
                for pool in self.pools:
                    pool.update(ray.get(reg.addresses.remote(self.app, pool.kind)))
            except Exception:
                log.warning("could not refresh the worker list", exc_info=True)
