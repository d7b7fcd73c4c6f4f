"""The replicas of one worker deployment as the router sees them: which sessions are pinned to which replica, and
one batched call per replica at a time.

Each session is pinned to the replica that holds its cache (sticky); a new session goes to the replica that most
likely holds its prefix, else the one with the fewest of this router's sessions. The router's clients of the workers
(`deployments.remote_target`, `deployments.remote_drafter`) send a round's calls through `ReplicaPool.fan_out`, to
all replicas at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from deployments import status
from deployments.affinity import Candidate, PrefixAffinity
from deployments.auth import InternalCredentials, dial
from deployments.status import WorkerDraining, WorkerUnavailable
from deployments.telemetry import RequestTracer, carrier_metadata
from deployments.workers import GRPC_OPTIONS
from specdec.v1 import worker_pb2 as wpb
from specdec_core.errors import InvalidArgument

log = logging.getLogger(__name__)

T = TypeVar("T")

REPROBE_S = 0.5  # how stale a full replica's word on its free slots may be before it is asked again


@dataclass
class Replica:
    address: str
    stub: object
    channel: grpc.Channel
    sessions: set[str]
    stats: wpb.WorkerStats
    last_pinned: int = 0  # when it last got a session: ties go to the one that waited longest
    retired: bool = False  # no longer registered, or draining (being stopped): takes no new sessions
    failed: bool = False  # a call to it failed: takes no new sessions until a probe finds it answering again
    # Its own last word on its free KV slots (every router's sessions counted), and the sessions this router
    # placed there since: several routers share a worker, and only the worker knows what all of them took.
    free_reported: int = 0
    pinned_since_report: int = 0
    reported_at: float = field(default_factory=time.monotonic)
    # Sessions whose state there is in doubt (a call that failed, a release it did not answer): released once it
    # answers again, so that nothing stays held there until its idle timeout.
    orphans: set[str] = field(default_factory=set)

    @property
    def usable(self) -> bool:
        return not (self.retired or self.failed)

    @property
    def room(self) -> int:
        """New sessions it can take, by what it last said and what this router placed there since."""
        by_us = self.stats.num_slots - len(self.sessions)
        return max(0, min(by_us, self.free_reported - self.pinned_since_report))

    def reported(self, free_slots: int) -> None:
        """The worker said how many slots it has free now (mutates)."""
        self.free_reported, self.pinned_since_report, self.reported_at = free_slots, 0, time.monotonic()

    def released(self, count: int) -> None:
        """The worker freed `count` of our sessions' slots (mutates): its last word, less what we took since."""
        self.free_reported = min(self.stats.num_slots, self.free_reported + count)

    @property
    def full_by_others(self) -> bool:
        """It said it had no room for us, though our own sessions leave some: others' sessions may have ended."""
        return self.room == 0 and len(self.sessions) < self.stats.num_slots


class ReplicaPool:
    """The replicas of one worker deployment, the sessions pinned to each, and batched fan-out."""

    def __init__(
        self,
        kind: str,
        addresses: Sequence[str],
        stub_type: type,
        timeout_s: float,
        credentials: InternalCredentials | None = None,
    ) -> None:
        """`credentials`: what the router presents to the workers (`deployments.auth.dial`); None for workers
        served without any."""
        self.kind = kind
        self.timeout_s = timeout_s
        self._credentials = credentials
        self.failure = threading.Event()  # set when a replica fails: the router re-reads the replicas at once
        self._stub_type = stub_type
        self._replicas: dict[str, Replica] = {}
        self._pinned: dict[str, Replica] = {}
        self.affinity = PrefixAffinity()
        self._tick = 0
        self._lock = threading.Lock()
        self.update(addresses)
        if not self._replicas:
            raise WorkerUnavailable(f"no {kind} worker is reachable")

    def update(self, addresses: Sequence[str]) -> None:
        """Follow the registered replicas: add those that appeared; a replica that is gone takes no new sessions
        and is dropped once its sessions end (a dead one fails them on their next call). A failed replica is
        probed: it takes sessions again if it answers (a stall that ended), else it is dropped once idle (a
        replica killed without unregistering stays in the registry, so a probe is the only word on it)."""
        with self._lock:
            for address in [a for a in self._replicas if a not in addresses]:
                replica = self._replicas[address]
                if not replica.sessions:
                    self._drop(address)
                else:
                    replica.retired = True
        for replica in self.replicas:
            stats = self._probe(replica.stub, replica.address)
            if stats is not None:
                replica.stats = stats
                replica.reported(stats.free_slots)
                replica.failed = not self._release_orphans(replica)  # it answered: back if it takes them
            elif not replica.sessions:
                with self._lock:
                    self._drop(replica.address)
            else:
                replica.failed = True
        for address in addresses:
            if address in self._replicas:
                continue
            channel = dial(address, self._credentials, GRPC_OPTIONS)
            stub = self._stub_type(channel)
            stats = self._probe(stub, address)
            if stats is None:
                channel.close()
                continue
            with self._lock:
                self._replicas[address] = Replica(address, stub, channel, set(), stats, free_reported=stats.free_slots)

    def _probe(self, stub: object, address: str) -> wpb.WorkerStats | None:
        try:
            return stub.GetStats(wpb.GetStatsRequest(), timeout=min(self.timeout_s, 5.0))  # type: ignore[attr-defined]
        except grpc.RpcError as exc:
            log.warning("%s worker at %s is not reachable: %s", self.kind, address, exc.code())
            return None

    def _drop(self, address: str) -> None:
        self._replicas.pop(address).channel.close()
        self.affinity.forget(address)

    def mark_failed(self, address: str) -> None:
        """A call to `address` failed (unreachable, or no answer in time): it takes no new sessions until a probe
        finds it answering (`update`). The sessions pinned there stay pinned: each learns of the failure by its
        own next call, and only the sessions of a failed call end (a stalled replica may still hold the others
        well)."""
        with self._lock:
            replica = self._replicas.get(address)
            if replica is None:
                return
            replica.failed = True
            self.affinity.forget(address)  # its cache is lost or in doubt
        self.failure.set()
        log.warning("%s worker at %s failed; %d sessions are pinned there", self.kind, address, len(replica.sessions))

    def answered(self, replica: Replica) -> None:
        """A failed replica answered a call: it is back, as if a probe had found it (`update`)."""
        if replica.failed and not replica.retired and self._release_orphans(replica):
            replica.failed = False

    def _release_orphans(self, replica: Replica) -> bool:
        """Release what `replica` may still hold of sessions whose calls failed; whether it answered."""
        if not replica.orphans:
            return True
        orphans = sorted(replica.orphans)
        try:
            response = replica.stub.Release(wpb.ReleaseRequest(seq_ids=orphans), timeout=min(self.timeout_s, 10.0))  # type: ignore[attr-defined]
            replica.released(response.released)
        except grpc.RpcError as exc:
            log.warning(
                "%s worker at %s did not take back %d sessions: %s",
                self.kind,
                replica.address,
                len(orphans),
                exc.code(),
            )
            return False
        replica.orphans.difference_update(orphans)
        return True

    def retire(self, address: str) -> None:
        """The replica is draining (Serve is stopping it): it takes no new sessions, and those it holds go on there
        until they end; it is dropped once it is unregistered and idle (`update`)."""
        with self._lock:
            replica = self._replicas.get(address)
            if replica is None or replica.retired:
                return
            replica.retired = True
        log.info("%s worker at %s is draining; %d sessions finish there", self.kind, address, len(replica.sessions))

    @property
    def has_usable(self) -> bool:
        return any(r.usable for r in self.replicas)

    @property
    def replicas(self) -> list[Replica]:
        return list(self._replicas.values())

    @property
    def info(self) -> wpb.WorkerStats:
        return self.replicas[0].stats

    @property
    def free_slots(self) -> int:
        """New sessions the usable replicas can take, by their own last word (`Replica.room`). A replica full of
        other routers' sessions is asked again when its word is older than `REPROBE_S`: their sessions end
        without a word to us, and a verify's answer (which refreshes it) comes only from replicas we use."""
        for replica in self.replicas:
            if replica.usable and replica.full_by_others and time.monotonic() - replica.reported_at > REPROBE_S:
                stats = self._probe(replica.stub, replica.address)
                replica.reported_at = time.monotonic()
                if stats is not None:
                    replica.stats = stats
                    replica.reported(stats.free_slots)
        return sum(r.room for r in self.replicas if r.usable)

    def reported(self, address: str, free_slots: int) -> None:
        """A replica's answer said how many KV slots it has free now."""
        replica = self._replicas.get(address)
        if replica is not None:
            replica.reported(free_slots)

    def pin(self, seq_id: str, token_ids: Sequence[int] = (), salt: str | None = None) -> Replica:
        """The replica for a new session: the one that most likely holds a long prefix of `token_ids` in its
        prefix cache (under `salt`) while it has room and is not much busier (`affinity`), else the least loaded
        (fewest of our sessions for its slots)."""
        with self._lock:
            self._tick += 1
            live = [r for r in self._replicas.values() if r.usable]
            if not live:
                raise WorkerUnavailable(f"no {self.kind} worker is available")
            candidates = [Candidate(r.address, len(r.sessions), r.room > 0) for r in live]
            preferred = self.affinity.choose(candidates, salt, token_ids)
            replica = (
                self._replicas[preferred]
                if preferred is not None
                else min(live, key=lambda r: (-r.room, r.last_pinned))
            )
            self.affinity.record(replica.address, salt, token_ids)
            replica.last_pinned = self._tick
            replica.pinned_since_report += 1
            replica.sessions.add(seq_id)
            self._pinned[seq_id] = replica
            return replica

    def likely_cached(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        """The longest prefix of `token_ids` that a usable replica likely holds in its prefix cache, by what was
        placed where and what ended sessions left there (`affinity`; the worker may have evicted it since)."""
        with self._lock:
            return max(
                (self.affinity.match(r.address, salt, token_ids) for r in self._replicas.values() if r.usable),
                default=0,
            )

    def pinned(self, seq_id: str) -> Replica | None:
        return self._pinned.get(seq_id)

    def replica_of(self, seq_id: str) -> Replica:
        replica = self._pinned.get(seq_id)
        if replica is None:
            raise InvalidArgument("seq_id", f"no {self.kind} session {seq_id!r}")
        return replica

    def unpin(self, seq_id: str) -> Replica | None:
        with self._lock:
            replica = self._pinned.pop(seq_id, None)
            if replica is not None:
                replica.sessions.discard(seq_id)
            return replica

    def fan_out(
        self,
        groups: dict[str, tuple[Replica, object]],
        method: str,
        metadata: dict[str, list[tuple[str, str]]] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[dict[str, object], dict[str, Exception]]:
        """Send one request per replica, all at once; every call runs to its end: (responses, errors) by address.
        A replica that could not be reached or did not answer in time is marked failed (an error it reported,
        such as INTERNAL, is not: it is alive and has released what the call touched); one that is draining is
        retired."""
        metadata = metadata or {}
        timeout = timeout_s or self.timeout_s
        calls = {
            address: getattr(replica.stub, method).future(request, timeout=timeout, metadata=metadata.get(address))
            for address, (replica, request) in groups.items()
        }
        responses: dict[str, object] = {}
        failures: dict[str, Exception] = {}
        for address, call in calls.items():
            try:
                responses[address] = call.result()
                self.answered(groups[address][0])
            except grpc.RpcError as exc:
                what = f"{self.kind} worker {address}: {method}"
                error = failures[address] = status.error_of(exc.code(), exc.details(), what)
                if replica_lost(error):
                    self.mark_failed(address)
                elif isinstance(error, WorkerDraining):
                    self.retire(address)
        return responses, failures

    def release(self, seq_id: str, held: Sequence[int] = (), salt: str | None = None) -> None:
        """The session ended. `held`: the tokens its replica's cache holds for it now (kept there as a prefix-cache
        entry), remembered for placing later sessions and for `likely_cached`. A failed replica is not waited on:
        the session is released there once it answers a probe (`update`)."""
        replica = self.unpin(seq_id)
        if replica is None:
            return
        if replica.failed:
            replica.orphans.add(seq_id)
            return
        if held:
            with self._lock:
                self.affinity.record(replica.address, salt, held)
        try:
            response = replica.stub.Release(wpb.ReleaseRequest(seq_ids=[seq_id]), timeout=min(self.timeout_s, 10.0))
            replica.released(response.released)
        except grpc.RpcError as exc:
            log.warning("could not release %s session %s on %s: %s", self.kind, seq_id, replica.address, exc.code())
            replica.orphans.add(seq_id)

    def close(self) -> None:
        for replica in self._replicas.values():
            replica.channel.close()


def replica_lost(error: Exception) -> bool:
    """The replica could not be reached or did not answer: whatever it held for the call is gone or in doubt."""
    return isinstance(error, WorkerUnavailable) and error.code == grpc.StatusCode.UNAVAILABLE


def group_by_replica(
    pool: ReplicaPool, items: Sequence[T], session_of: Callable[[T], str]
) -> tuple[dict[str, list[int]], list[int]]:
    """Indices of `items` per replica address, and those of sessions no replica holds (each is its row's error,
    never the batch's)."""
    groups: dict[str, list[int]] = {}
    unplaced = []
    for i, item in enumerate(items):
        replica = pool.pinned(session_of(item))
        if replica is None:
            unplaced.append(i)
        else:
            groups.setdefault(replica.address, []).append(i)
    return groups, unplaced


def item_sizes(groups: dict[str, list[int]], requests: dict[str, tuple[Replica, object]], n: int) -> list[int]:
    """Serialized bytes of each sequence's item in the batched requests (in the caller's order)."""
    sizes = [0] * n
    for address, idx in groups.items():
        for i, item in zip(idx, requests[address][1].items):
            sizes[i] = item.ByteSize()
    return sizes


def trace_metadata(
    tracer: RequestTracer | None, groups: dict[str, list[int]], ids: Sequence[str], rounds: bool
) -> dict[str, list[tuple[str, str]]]:
    """Per replica: the traceparent of its first sequence's span, the others as links."""
    if tracer is None:
        return {}
    return {address: carrier_metadata(tracer.spans([ids[i] for i in idx], rounds)) for address, idx in groups.items()}
