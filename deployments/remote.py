"""The router's view of the workers: `Target` and `Drafter` implementations that call them over gRPC.

Each session is pinned to the replica that holds its cache (sticky); a new session goes to the replica with the
fewest of this router's sessions. One batched call per replica per round, sent to all replicas at once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

import grpc

from deployments import codec
from deployments.telemetry import RequestTracer, carrier_metadata
from deployments.workers import GRPC_OPTIONS
from specdec.v1 import worker_pb2 as wpb
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.drafters.base import DraftRequest, Proposal
from specdec_core.errors import InvalidArgument, ResourceExhausted
from specdec_core.target import PrefillItem, VerifyItem, VerifyOutcome

if TYPE_CHECKING:
    from deployments.metrics import ServingMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")


class WorkerUnavailable(RuntimeError):
    """A worker could not be reached or failed a call; `code` is the gRPC status to report."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Replica:
    address: str
    stub: object
    channel: grpc.Channel
    sessions: set[str]
    stats: wpb.WorkerStats
    last_pinned: int = 0  # when it last got a session: ties go to the one that waited longest
    retired: bool = False  # no longer registered: takes no new sessions


class ReplicaPool:
    """The replicas of one worker deployment, the sessions pinned to each, and batched fan-out."""

    def __init__(self, kind: str, addresses: Sequence[str], stub_type: type, timeout_s: float) -> None:
        self.kind = kind
        self.timeout_s = timeout_s
        self._stub_type = stub_type
        self._replicas: dict[str, Replica] = {}
        self._pinned: dict[str, Replica] = {}
        self._tick = 0
        self._lock = threading.Lock()
        self.update(addresses)
        if not self._replicas:
            raise WorkerUnavailable(f"no {kind} worker is reachable")

    def update(self, addresses: Sequence[str]) -> None:
        """Follow the registered replicas: add those that appeared; a replica that is gone takes no new sessions
        and is dropped once its sessions end (a dead one fails them on their next call)."""
        with self._lock:
            for address in [a for a in self._replicas if a not in addresses]:
                replica = self._replicas[address]
                if not replica.sessions:
                    replica.channel.close()
                    del self._replicas[address]
                else:
                    replica.retired = True
        for address in addresses:
            if address in self._replicas:
                continue
            channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
            stub = self._stub_type(channel)
            try:
                stats = stub.GetStats(wpb.GetStatsRequest(), timeout=min(self.timeout_s, 10.0))
            except grpc.RpcError as exc:
                log.warning("%s worker at %s is not reachable: %s", self.kind, address, exc.code())
                channel.close()
                continue
            with self._lock:
                self._replicas[address] = Replica(address, stub, channel, set(), stats)

    @property
    def replicas(self) -> list[Replica]:
        return list(self._replicas.values())

    @property
    def info(self) -> wpb.WorkerStats:
        return self.replicas[0].stats

    @property
    def free_slots(self) -> int:
        return sum(max(0, r.stats.num_slots - len(r.sessions)) for r in self.replicas if not r.retired)

    def pin(self, session_id: str) -> Replica:
        """The replica for a new session: the least loaded (fewest of our sessions for its slots)."""
        with self._lock:
            self._tick += 1
            live = [r for r in self._replicas.values() if not r.retired]
            if not live:
                raise WorkerUnavailable(f"no {self.kind} worker is registered")
            replica = min(live, key=lambda r: (len(r.sessions) - r.stats.num_slots, r.last_pinned))
            replica.last_pinned = self._tick
            replica.sessions.add(session_id)
            self._pinned[session_id] = replica
            return replica

    def replica_of(self, session_id: str) -> Replica:
        replica = self._pinned.get(session_id)
        if replica is None:
            raise InvalidArgument("session_id", f"no {self.kind} session {session_id!r}")
        return replica

    def unpin(self, session_id: str) -> Replica | None:
        with self._lock:
            replica = self._pinned.pop(session_id, None)
            if replica is not None:
                replica.sessions.discard(session_id)
            return replica

    def fan_out(self, groups: dict[str, tuple[Replica, object]], method: str,
                metadata: dict[str, list[tuple[str, str]]] | None = None) -> dict[str, object]:
        """Send one request per replica, all at once; the responses by address. Raises on any failure."""
        metadata = metadata or {}
        calls = {
            address: getattr(replica.stub, method).future(request, timeout=self.timeout_s, metadata=metadata.get(address))
            for address, (replica, request) in groups.items()
        }
        responses = {}
        for address, call in calls.items():
            try:
                responses[address] = call.result()
            except grpc.RpcError as exc:
                raise _translate(exc, f"{self.kind} worker {address}: {method}") from None
        return responses

    def release(self, session_id: str) -> None:
        replica = self.unpin(session_id)
        if replica is None:
            return
        try:
            replica.stub.Release(wpb.ReleaseRequest(session_ids=[session_id]), timeout=min(self.timeout_s, 10.0))
        except grpc.RpcError as exc:  # the worker's idle timeout frees it in the end
            log.warning("could not release %s session %s on %s: %s", self.kind, session_id, replica.address, exc.code())

    def close(self) -> None:
        for replica in self._replicas.values():
            replica.channel.close()


def _translate(exc: grpc.RpcError, what: str) -> Exception:
    code, details = exc.code(), exc.details()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, message = (details or "").partition(": ")
        return InvalidArgument(field or "request", message or details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        field, _, message = (details or "").partition(": ")
        return ResourceExhausted(field or "request", message or details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return WorkerUnavailable(f"{what}: {code.name}: {details}")
    return WorkerUnavailable(f"{what}: {code.name}: {details}", code=grpc.StatusCode.INTERNAL)


def _group(pool: ReplicaPool, items: Sequence[T], session_of: Callable[[T], str]) -> dict[str, list[int]]:
    """Indices of `items` per replica address."""
    groups: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(pool.replica_of(session_of(item)).address, []).append(i)
    return groups


def _item_sizes(groups: dict[str, list[int]], requests: dict[str, tuple[Replica, object]], n: int) -> list[int]:
    """Serialized bytes of each sequence's item in the batched requests (in the caller's order)."""
    sizes = [0] * n
    for address, idx in groups.items():
        for i, item in zip(idx, requests[address][1].items):
            sizes[i] = item.ByteSize()
    return sizes


def _trace_metadata(tracer: RequestTracer | None, groups: dict[str, list[int]], ids: Sequence[str],
                    rounds: bool) -> dict[str, list[tuple[str, str]]]:
    """Per replica: the traceparent of its first sequence's span, the others as links."""
    if tracer is None:
        return {}
    return {address: carrier_metadata(tracer.spans([ids[i] for i in idx], rounds)) for address, idx in groups.items()}


class RemoteTarget:
    """`Target` over the target workers."""

    def __init__(self, pool: ReplicaPool, tracer: RequestTracer | None = None,
                 metrics: ServingMetrics | None = None) -> None:
        self.pool = pool
        self.tracer = tracer
        self.metrics = metrics
        info = pool.info
        self.vocab_size = info.vocab_size
        self.max_seq_len = info.max_seq_len

    @property
    def free_slots(self) -> int:
        return self.pool.free_slots

    def prefill(self, items: Sequence[PrefillItem]) -> list[int]:
        for item in items:
            self.pool.pin(item.seq_id)
        try:
            groups = _group(self.pool, items, lambda item: item.seq_id)
            requests = {
                address: (self.pool.replica_of(items[idx[0]].seq_id), codec.encode_prefill([items[i] for i in idx]))
                for address, idx in groups.items()
            }
            metadata = _trace_metadata(self.tracer, groups, [item.seq_id for item in items], rounds=False)
            responses = self.pool.fan_out(requests, "Prefill", metadata)
        except Exception:
            for item in items:
                self.pool.release(item.seq_id)
            raise
        first = [0] * len(items)
        for address, idx in groups.items():
            for i, token in zip(idx, responses[address].first_token_ids):
                first[i] = token
        return first

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyOutcome]:
        ids = [item.seq_id for item in items]
        if self.tracer is not None:
            self.tracer.begin_round(ids)
        groups = _group(self.pool, items, lambda item: item.seq_id)
        requests = {
            address: (self.pool.replica_of(items[idx[0]].seq_id), codec.encode_verify([items[i] for i in idx]))
            for address, idx in groups.items()
        }
        start = time.perf_counter()
        responses = self.pool.fan_out(requests, "Verify", _trace_metadata(self.tracer, groups, ids, rounds=True))
        seconds = time.perf_counter() - start  # the round span's verify_ms and the verify latency histogram
        if self.tracer is not None:
            self.tracer.add_call(ids, "verify", seconds, _item_sizes(groups, requests, len(ids)))
        if self.metrics is not None:
            self.metrics.verify_latency.observe(seconds)
        outcomes: list[VerifyOutcome | None] = [None] * len(items)
        for address, idx in groups.items():
            for i, outcome in zip(idx, codec.decode_outcomes(responses[address], [items[i].return_probs for i in idx])):
                outcomes[i] = outcome
        return outcomes  # type: ignore[return-value]

    def release(self, seq_id: str) -> None:
        self.pool.release(seq_id)


class RemoteDrafter:
    """`Drafter` over the draft workers. A worker keeps each session's committed tokens; every Propose carries
    only the tokens committed since the last one."""

    name = "draft_model"

    def __init__(self, pool: ReplicaPool, tracer: RequestTracer | None = None,
                 metrics: ServingMetrics | None = None) -> None:
        self.pool = pool
        self.tracer = tracer
        self.metrics = metrics
        self._sent: dict[str, int] = {}  # committed tokens the worker has been told about, per session

    def start(self, seq_id: str, prompt_ids: Sequence[int]) -> None:
        replica = self.pool.pin(seq_id)
        request = wpb.StartRequest(items=[wpb.StartRequest.Item(session_id=seq_id, prompt_token_ids=list(prompt_ids))])
        metadata = {}
        if self.tracer is not None:
            metadata = {replica.address: carrier_metadata(self.tracer.spans([seq_id], rounds=False))}
        try:
            self.pool.fan_out({replica.address: (replica, request)}, "Start", metadata)
        except Exception:
            self.pool.unpin(seq_id)
            raise
        self._sent[seq_id] = len(prompt_ids)

    def observe(self, seq_id: str, num_committed: int) -> None:
        pass  # sent with the next Propose

    def propose(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        ids = [r.seq_id for r in requests]
        if self.tracer is not None:
            self.tracer.begin_round(ids)
        groups = _group(self.pool, requests, lambda r: r.seq_id)
        messages = {}
        for address, idx in groups.items():
            message = wpb.ProposeRequest()
            for i in idx:
                r = requests[i]
                message.items.append(codec.encode_propose_item(r, r.token_ids[self._sent[r.seq_id] :]))
            messages[address] = (self.pool.replica_of(requests[idx[0]].seq_id), message)
        start = time.perf_counter()
        responses = self.pool.fan_out(messages, "Propose", _trace_metadata(self.tracer, groups, ids, rounds=True))
        seconds = time.perf_counter() - start  # the round span's draft_ms and the draft latency histogram
        if self.tracer is not None:
            self.tracer.add_call(ids, "draft", seconds, _item_sizes(groups, messages, len(ids)))
        if self.metrics is not None:
            self.metrics.draft_latency.observe(seconds)
        for r in requests:
            self._sent[r.seq_id] = len(r.token_ids)
        proposals: list[Proposal | None] = [None] * len(requests)
        vocab = self.pool.info.vocab_size
        for address, idx in groups.items():
            for i, msg in zip(idx, responses[address].proposals):
                proposals[i] = codec.decode_proposal(msg, vocab, requests[i].return_probs)
        return proposals  # type: ignore[return-value]

    def release(self, seq_id: str) -> None:
        self._sent.pop(seq_id, None)
        self.pool.release(seq_id)

    @property
    def active_sequences(self) -> int:
        return len(self._sent)
