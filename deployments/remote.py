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

from deployments import codec, status
from deployments.affinity import Candidate, PrefixAffinity
from deployments.auth import InternalCredentials, dial
from deployments.status import WorkerDraining, WorkerUnavailable
from deployments.telemetry import RequestTracer, carrier_metadata
from deployments.workers import GRPC_OPTIONS
from specdec.v1 import worker_pb2 as wpb
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.drafters.base import DraftRequest, Proposal
from specdec_core.errors import InvalidArgument
from specdec_core.target import (PartialPrefill, PartialVerifyFailure, Prefilled, PrefillItem, VerifyItem,
                                 VerifyOutcome)

if TYPE_CHECKING:
    from deployments.metrics import ServingMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")


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

    @property
    def usable(self) -> bool:
        return not (self.retired or self.failed)


class ReplicaPool:
    """The replicas of one worker deployment, the sessions pinned to each, and batched fan-out."""

    def __init__(self, kind: str, addresses: Sequence[str], stub_type: type, timeout_s: float,
                 credentials: InternalCredentials | None = None) -> None:
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
        for replica in [r for r in self.replicas if r.failed]:
            if self._probe(replica.stub, replica.address) is not None:
                replica.failed = False
            elif not replica.sessions:
                with self._lock:
                    self._drop(replica.address)
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
                self._replicas[address] = Replica(address, stub, channel, set(), stats)

    def _probe(self, stub: object, address: str) -> wpb.WorkerStats | None:
        try:
            return stub.GetStats(wpb.GetStatsRequest(), timeout=min(self.timeout_s, 5.0))  # type: ignore[attr-defined]
        except grpc.RpcError as exc:
            log.warning("%s worker at %s is not reachable: %s", self.kind, address, exc.code())
            return None

    def _drop(self, address: str) -> None:
        self._replicas.pop(address).channel.close()
        self.affinity.forget(address)

    def mark_failed(self, address: str) -> list[str]:
        """A call to `address` failed: it takes no new sessions, and the sessions pinned to it are unpinned
        (their state there is lost). Returns those sessions."""
        with self._lock:
            replica = self._replicas.get(address)
            if replica is None:
                return []
            replica.failed = True
            self.affinity.forget(address)  # its cache is lost or in doubt
            lost = sorted(replica.sessions)
            for seq_id in lost:
                self._pinned.pop(seq_id, None)
            replica.sessions.clear()
        self.failure.set()
        log.warning("%s worker at %s failed; %d sessions lost there", self.kind, address, len(lost))
        return lost

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
        return sum(max(0, r.stats.num_slots - len(r.sessions)) for r in self.replicas if r.usable)

    def pin(self, seq_id: str, token_ids: Sequence[int] = (), salt: str | None = None) -> Replica:
        """The replica for a new session: the one that most likely holds a long prefix of `token_ids` in its
        prefix cache (under `salt`) while it has room and is not much busier (`affinity`), else the least loaded
        (fewest of our sessions for its slots)."""
        with self._lock:
            self._tick += 1
            live = [r for r in self._replicas.values() if r.usable]
            if not live:
                raise WorkerUnavailable(f"no {self.kind} worker is available")
            candidates = [Candidate(r.address, len(r.sessions), len(r.sessions) < r.stats.num_slots) for r in live]
            preferred = self.affinity.choose(candidates, salt, token_ids)
            replica = self._replicas[preferred] if preferred is not None else \
                min(live, key=lambda r: (len(r.sessions) - r.stats.num_slots, r.last_pinned))
            self.affinity.record(replica.address, salt, token_ids)
            replica.last_pinned = self._tick
            replica.sessions.add(seq_id)
            self._pinned[seq_id] = replica
            return replica

    def likely_cached(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        """The longest prefix of `token_ids` that a usable replica likely holds in its prefix cache, by what was
        placed where and what ended sessions left there (`affinity`; the worker may have evicted it since)."""
        with self._lock:
            return max((self.affinity.match(r.address, salt, token_ids) for r in self._replicas.values() if r.usable),
                       default=0)

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

    def fan_out(self, groups: dict[str, tuple[Replica, object]], method: str,
                metadata: dict[str, list[tuple[str, str]]] | None = None,
                timeout_s: float | None = None) -> tuple[dict[str, object], dict[str, Exception]]:
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
            except grpc.RpcError as exc:
                what = f"{self.kind} worker {address}: {method}"
                error = failures[address] = status.error_of(exc.code(), exc.details(), what)
                if _lost(error):
                    self.mark_failed(address)
                elif isinstance(error, WorkerDraining):
                    self.retire(address)
        return responses, failures

    def release(self, seq_id: str, held: Sequence[int] = (), salt: str | None = None) -> None:
        """The session ended. `held`: the tokens its replica's cache holds for it now (kept there as a prefix-cache
        entry), remembered for placing later sessions and for `likely_cached`."""
        replica = self.unpin(seq_id)
        if replica is None:
            return
        if held:
            with self._lock:
                self.affinity.record(replica.address, salt, held)
        try:
            replica.stub.Release(wpb.ReleaseRequest(seq_ids=[seq_id]), timeout=min(self.timeout_s, 10.0))
        except grpc.RpcError as exc:  # the worker's idle timeout frees it in the end
            log.warning("could not release %s session %s on %s: %s", self.kind, seq_id, replica.address, exc.code())

    def close(self) -> None:
        for replica in self._replicas.values():
            replica.channel.close()


def _lost(error: Exception) -> bool:
    """The replica could not be reached or did not answer: whatever it held for the call is gone or in doubt."""
    return isinstance(error, WorkerUnavailable) and error.code == grpc.StatusCode.UNAVAILABLE


def _elsewhere(error: Exception) -> bool:
    """A new session that met this error may start on another replica: its replica is lost or draining (either
    way the pool no longer offers it), and nothing was produced yet."""
    return _lost(error) or isinstance(error, WorkerDraining)


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

    def prefill(self, items: Sequence[PrefillItem]) -> list[Prefilled]:
        """Start sessions on the least-loaded replicas. Items whose replica turned out dead or draining are tried
        again on another: they have produced nothing yet, so a retry is invisible to the client. Every try that
        fails takes the replicas it failed on out of the pool's choice, so the tries end. Items the replicas left
        have no room for (the engine counted a draining replica's slots) wait again (`PartialPrefill`)."""
        results: list[Prefilled | None] = [None] * len(items)
        todo, deferred = list(range(len(items))), []
        try:
            for _ in range(len(self.pool.replicas) + 1):
                room = self.pool.free_slots
                todo, deferred = todo[:room], deferred + todo[room:]
                if not todo:
                    break
                done, failed = self._prefill_once([items[i] for i in todo])
                for i, result in zip(todo, done):
                    results[i] = result
                todo = [todo[j] for j in failed]
                if not todo or not self.pool.has_usable:
                    break
            if todo:
                raise WorkerUnavailable(f"no target worker could prefill {len(todo)} of {len(items)} requests")
        except Exception:
            for item in items:
                self.pool.release(item.seq_id)
            raise
        if deferred:
            raise PartialPrefill(results)
        return results  # type: ignore[return-value]

    def _prefill_once(self, items: Sequence[PrefillItem]) -> tuple[list[Prefilled | None], list[int]]:
        """Results (None where failed) and the indices of items whose replica could not be reached or is draining
        (unpinned, to be placed again)."""
        for item in items:
            self.pool.pin(item.seq_id, item.prompt_ids, item.cache_salt)
        groups = _group(self.pool, items, lambda item: item.seq_id)
        requests = {
            address: (self.pool.replica_of(items[idx[0]].seq_id), codec.encode_prefill([items[i] for i in idx]))
            for address, idx in groups.items()
        }
        metadata = _trace_metadata(self.tracer, groups, [item.seq_id for item in items], rounds=False)
        responses, failures = self.pool.fan_out(requests, "Prefill", metadata)
        if any(not _elsewhere(error) for error in failures.values()):
            raise next(error for error in failures.values() if not _elsewhere(error))
        first: list[Prefilled | None] = [None] * len(items)
        for address, response in responses.items():
            for i, result in zip(groups[address], codec.decode_prefilled(response)):
                first[i] = result
        failed = sorted(i for address in failures for i in groups[address])
        for i in failed:
            self.pool.unpin(items[i].seq_id)  # a draining replica still lists it (a lost one already forgot it)
        return first, failed

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
        responses, failures = self.pool.fan_out(
            requests, "Verify", _trace_metadata(self.tracer, groups, ids, rounds=True))
        seconds = time.perf_counter() - start  # the round span's verify_ms and the verify latency histogram
        if self.tracer is not None:
            self.tracer.add_call(ids, "verify", seconds, _item_sizes(groups, requests, len(ids)))
        if self.metrics is not None:
            self.metrics.verify_latency.observe(seconds)
        outcomes: list[VerifyOutcome | None] = [None] * len(items)
        for address, response in responses.items():
            idx = groups[address]
            for i, outcome in zip(idx, codec.decode_outcomes(response, [items[i].return_probs for i in idx])):
                outcomes[i] = outcome
        if failures:
            errors = {i: error for address, error in failures.items() for i in groups[address]}
            if len(errors) == len(items):
                raise next(iter(failures.values()))
            raise PartialVerifyFailure(outcomes, errors)
        return outcomes  # type: ignore[return-value]

    def release(self, seq_id: str) -> None:
        self.pool.release(seq_id)


class RemoteDrafter:
    """`Drafter` over the draft workers. A worker keeps each session's committed tokens; every Propose carries
    only the tokens committed since the last one.

    A draft replica that dies, stalls (no answer within `timeout_s`) or is full costs speculation, never the
    request: its sessions get empty proposals, so their rounds are plain decoding (exact, only slower), and every
    `retry_s` they are started again, with everything committed so far, on a replica that answers. A session the
    engine starts where no replica takes it takes the same path."""

    name = "draft_model"

    def __init__(self, pool: ReplicaPool, tracer: RequestTracer | None = None,
                 metrics: ServingMetrics | None = None, timeout_s: float | None = None, retry_s: float = 1.0) -> None:
        self.pool = pool
        self.tracer = tracer
        self.metrics = metrics
        self.timeout_s = timeout_s or pool.timeout_s
        self.retry_s = retry_s
        self._sent: dict[str, int] = {}  # sessions held by a draft worker: committed tokens it has been told about
        self._tokens: dict[str, Sequence[int]] = {}  # their committed tokens (the engine's list, read at release)
        self._homeless: dict[str, float] = {}  # sessions no draft worker holds: when to try to place them again
        self._salts: dict[str, str | None] = {}  # every session's cache salt, for placing it again
        self._constrained: set[str] = set()  # sessions whose draft worker holds their grammar

    def start(self, seq_id: str, prompt_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Place the session on a draft replica, which prefills it (the engine starts a session the first time it
        drafts); where none takes it, it drafts nothing until a later placement succeeds. Returns the tokens the
        replica found in its prefix cache."""
        self._salts[seq_id] = cache_salt
        cached = self._place(seq_id, prompt_ids) if self.pool.has_usable else None
        if cached is None:
            self._homeless[seq_id] = time.monotonic() + self.retry_s
        return cached or 0

    def cached(self, seq_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        return self.pool.likely_cached(token_ids, cache_salt)

    def _place(self, seq_id: str, token_ids: Sequence[int]) -> int | None:
        """Start the session on the replica that most likely holds its prefix, else the least loaded usable one
        (another at once, if that one is draining): the tokens it found cached; None if none took it."""
        for _ in range(len(self.pool.replicas)):
            try:
                replica = self.pool.pin(seq_id, token_ids, self._salts.get(seq_id))
            except WorkerUnavailable:
                return None
            request = codec.encode_start(seq_id, token_ids, self._salts.get(seq_id))
            metadata = {}
            if self.tracer is not None:
                metadata = {replica.address: carrier_metadata(self.tracer.spans([seq_id], rounds=False))}
            responses, failures = self.pool.fan_out({replica.address: (replica, request)}, "Start", metadata,
                                                    self.timeout_s)
            if not failures:
                self._sent[seq_id], self._tokens[seq_id] = len(token_ids), token_ids
                self._constrained.discard(seq_id)  # a new session: its grammar goes with its first Propose
                return codec.decode_started(responses[replica.address], 1)[0]
            self.pool.unpin(seq_id)
            if not isinstance(failures[replica.address], WorkerDraining):  # the pool retired a draining one
                log.warning("draft session %s not started: %s", seq_id, failures[replica.address])
                return None
        return None

    def observe(self, seq_id: str, num_committed: int) -> None:
        pass  # sent with the next Propose

    def propose(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        self._rehome(requests)
        proposals = [Proposal([], None, () if r.return_probs else None) for r in requests]
        live = [i for i, r in enumerate(requests) if r.seq_id in self._sent and r.num_tokens > 0]
        if not live:
            return proposals
        ids = [requests[i].seq_id for i in live]
        if self.tracer is not None:
            self.tracer.begin_round(ids)
        groups = {address: [live[j] for j in idx]
                  for address, idx in _group(self.pool, [requests[i] for i in live], lambda r: r.seq_id).items()}
        messages = {}
        for address, idx in groups.items():
            message = wpb.ProposeRequest()
            for i in idx:
                r = requests[i]
                message.items.append(codec.encode_propose_item(r, r.token_ids[self._sent[r.seq_id] :],
                                                               send_grammar=r.seq_id not in self._constrained))
            messages[address] = (self.pool.replica_of(requests[idx[0]].seq_id), message)
        all_ids = [r.seq_id for r in requests]
        start = time.perf_counter()
        responses, failures = self.pool.fan_out(
            messages, "Propose", _trace_metadata(self.tracer, groups, all_ids, rounds=True), self.timeout_s)
        seconds = time.perf_counter() - start  # the round span's draft_ms and the draft latency histogram
        if self.tracer is not None:
            self.tracer.add_call(all_ids, "draft", seconds, _item_sizes(groups, messages, len(requests)))
        if self.metrics is not None:
            self.metrics.draft_latency.observe(seconds)
        for address, error in failures.items():
            log.warning("draft proposals lost for %d sessions: %s", len(groups[address]), error)
            for i in groups[address]:
                self._evict(requests[i].seq_id)
        vocab = self.pool.info.vocab_size
        for address, response in responses.items():
            for i, msg in zip(groups[address], response.proposals):
                self._sent[requests[i].seq_id] = len(requests[i].token_ids)
                self._tokens[requests[i].seq_id] = requests[i].token_ids
                if requests[i].grammar is not None:
                    self._constrained.add(requests[i].seq_id)
                proposals[i] = codec.decode_proposal(msg, vocab, requests[i].return_probs)
        return proposals

    def _rehome(self, requests: Sequence[DraftRequest]) -> None:
        """Place sessions that have no draft replica (new ones, or ones whose replica failed) where one is usable, if
        they speculate this round and their retry time came."""
        now = time.monotonic()
        for r in requests:
            due = self._homeless.get(r.seq_id)
            if due is None or now < due or r.num_tokens == 0 or not self.pool.has_usable:
                continue
            if self._place(r.seq_id, r.token_ids) is not None:
                del self._homeless[r.seq_id]
            else:
                self._homeless[r.seq_id] = now + self.retry_s

    def _evict(self, seq_id: str) -> None:
        """The session's draft state is lost or in doubt: free it where possible, and place it again later."""
        self._sent.pop(seq_id, None)
        self._tokens.pop(seq_id, None)
        self._constrained.discard(seq_id)
        self.pool.release(seq_id)  # a no-op for a replica marked failed (its sessions are already unpinned)
        self._homeless[seq_id] = time.monotonic() + self.retry_s

    def release(self, seq_id: str) -> None:
        sent, tokens = self._sent.pop(seq_id, 0), self._tokens.pop(seq_id, ())
        self._constrained.discard(seq_id)
        self._homeless.pop(seq_id, None)
        # The worker's cache keeps what it read of the session (all it was sent but the last token, read with the
        # next Propose): a conversation's next turn is likely to find it there.
        self.pool.release(seq_id, tokens[: sent - 1], self._salts.pop(seq_id, None))

    @property
    def active_sequences(self) -> int:
        return len(self._sent)

    @property
    def num_homeless(self) -> int:
        """Sessions that draft without a draft replica (none took them: full, draining or failed): what the router
        reports to the draft deployment's autoscaling as waiting for a slot."""
        return len(self._homeless)
