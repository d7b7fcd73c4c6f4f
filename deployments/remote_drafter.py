"""`Drafter` over the draft workers: the router's engine drafts through it for a method that runs a draft model.

A draft worker keeps each session's committed tokens (and its grammar); the router keeps, per session, one
`_DraftSession`: what that worker has been told, or when to try to place the session again where none holds it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deployments import worker_codec
from deployments.replica_pool import ReplicaPool, group_by_replica, item_sizes, trace_metadata
from deployments.status import WorkerDraining, WorkerUnavailable
from deployments.telemetry import RequestTracer, carrier_metadata
from specdec.v1 import worker_pb2 as wpb
from specdec_core.drafters.base import DraftRequest, Proposal

if TYPE_CHECKING:
    from deployments.prometheus import ServingMetrics

log = logging.getLogger(__name__)


@dataclass
class _DraftSession:
    """What the router keeps of one session, from `start` to `release`. A draft worker holds it (`sent` is set), or
    none does (`retry_at` is set: it drafts nothing until a placement succeeds)."""

    cache_salt: str | None = None  # for placing it again
    sent: int | None = None  # held by a draft worker: the committed tokens it has been told about
    tokens: Sequence[int] = ()  # held: its committed tokens as last sent (the engine's list, read at release)
    retry_at: float | None = None  # held by none: when to try to place it again
    constrained: bool = False  # its draft worker holds its grammar

    @property
    def held(self) -> bool:
        return self.sent is not None

    def placed(self, token_ids: Sequence[int]) -> None:
        """A draft worker holds it now, with `token_ids` committed (mutates)."""
        self.sent, self.tokens = len(token_ids), token_ids

    def lost(self) -> None:
        """No draft worker holds it any more (mutates)."""
        self.sent, self.tokens, self.constrained = None, (), False


class RemoteDrafter:
    """`Drafter` over the draft workers. A worker keeps each session's committed tokens; every Propose carries
    only the tokens committed since the last one.

    A draft replica that dies, stalls (no answer within `timeout_s`) or is full costs speculation, never the
    request: its sessions get empty proposals, so their rounds are plain decoding (exact, only slower), and every
    `retry_s` they are started again, with everything committed so far, on a replica that answers. A session the
    engine starts where no replica takes it takes the same path."""

    name = "draft_model"

    def __init__(
        self,
        pool: ReplicaPool,
        tracer: RequestTracer | None = None,
        metrics: ServingMetrics | None = None,
        timeout_s: float | None = None,
        retry_s: float = 1.0,
    ) -> None:
        self.pool = pool
        self.tracer = tracer
        self.metrics = metrics
        self.timeout_s = timeout_s or pool.timeout_s
        self.retry_s = retry_s
        self._sessions: dict[str, _DraftSession] = {}  # every session started and not released, by seq_id

    def start(self, seq_id: str, prompt_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Place the session on a draft replica, which prefills it (the engine starts a session the first time it
        drafts); where none takes it, it drafts nothing until a later placement succeeds. Returns the tokens the
        replica found in its prefix cache."""
        session = self._sessions.setdefault(seq_id, _DraftSession())
        session.cache_salt = cache_salt
        cached = self._place(seq_id, session, prompt_ids) if self.pool.has_usable else None
        if cached is None:
            session.retry_at = time.monotonic() + self.retry_s
        return cached or 0

    def cached(self, seq_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        return self.pool.likely_cached(token_ids, cache_salt)

    def _place(self, seq_id: str, session: _DraftSession, token_ids: Sequence[int]) -> int | None:
        """Start the session on the replica that most likely holds its prefix, else the least loaded usable one
        (another at once, if that one is draining): the tokens it found cached; None if none took it."""
        for _ in range(len(self.pool.replicas)):
            try:
                replica = self.pool.pin(seq_id, token_ids, session.cache_salt)
            except WorkerUnavailable:
                return None
            request = worker_codec.encode_start(seq_id, token_ids, session.cache_salt)
            metadata = {}
            if self.tracer is not None:
                metadata = {replica.address: carrier_metadata(self.tracer.spans([seq_id], rounds=False))}
            responses, failures = self.pool.fan_out(
                {replica.address: (replica, request)}, "Start", metadata, self.timeout_s
            )
            if not failures:
                session.placed(token_ids)
                session.constrained = False  # a new session: its grammar goes with its first Propose
                return worker_codec.decode_started(responses[replica.address], 1)[0]
            self.pool.release(seq_id)  # it may hold the session after all (a Start that ran past the timeout)
            if not isinstance(failures[replica.address], WorkerDraining):  # the pool retired a draining one
                log.warning("draft session %s not started: %s", seq_id, failures[replica.address])
                return None
        return None

    def observe(self, seq_id: str, num_committed: int) -> None:
        pass  # sent with the next Propose

    def propose(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        self._rehome(requests)
        proposals = [Proposal([], None, () if r.return_probs else None) for r in requests]
        live = [i for i, r in enumerate(requests) if self._held(r.seq_id) and r.num_tokens > 0]
        if not live:
            return proposals
        if self.tracer is not None:
            self.tracer.begin_round([requests[i].seq_id for i in live])
        by_replica, unplaced = group_by_replica(self.pool, [requests[i] for i in live], lambda r: r.seq_id)
        for j in unplaced:  # no replica holds it after all: placed again later
            self._evict(requests[live[j]].seq_id)
        groups = {address: [live[j] for j in idx] for address, idx in by_replica.items()}
        messages = {address: self._propose_message(requests, idx) for address, idx in groups.items()}
        responses, failures = self._send(requests, groups, messages)
        for address, error in failures.items():
            log.warning("draft proposals lost for %d sessions: %s", len(groups[address]), error)
            for i in groups[address]:
                self._evict(requests[i].seq_id)
        vocab = self.pool.info.vocab_size
        for address, response in responses.items():
            for i, msg in zip(groups[address], response.proposals):
                self._proposed(requests[i])
                proposals[i] = worker_codec.decode_proposal(msg, vocab, requests[i].return_probs)
        return proposals

    def _held(self, seq_id: str) -> bool:
        session = self._sessions.get(seq_id)
        return session is not None and session.held

    def _propose_message(self, requests: Sequence[DraftRequest], idx: list[int]) -> tuple[object, wpb.ProposeRequest]:
        """The Propose of one replica's sessions `idx`: each carries the tokens committed since its last one, and its
        grammar until the worker holds it."""
        message = wpb.ProposeRequest()
        for i in idx:
            r = requests[i]
            session = self._sessions[r.seq_id]
            committed = len(r.token_ids) - r.num_assumed
            message.items.append(
                worker_codec.encode_propose_item(
                    r, r.token_ids[session.sent : committed], send_grammar=not session.constrained
                )
            )
        return self.pool.replica_of(requests[idx[0]].seq_id), message

    def _send(
        self,
        requests: Sequence[DraftRequest],
        groups: dict[str, list[int]],
        messages: dict[str, tuple[object, wpb.ProposeRequest]],
    ) -> tuple[dict[str, object], dict[str, Exception]]:
        """The round's Proposes, to every replica at once; their time goes to the round spans and the histogram."""
        all_ids = [r.seq_id for r in requests]
        start = time.perf_counter()
        responses, failures = self.pool.fan_out(
            messages, "Propose", trace_metadata(self.tracer, groups, all_ids, rounds=True), self.timeout_s
        )
        seconds = time.perf_counter() - start  # the round span's draft_ms and the draft latency histogram
        if self.tracer is not None:
            self.tracer.add_call(all_ids, "draft", seconds, item_sizes(groups, messages, len(requests)))
        if self.metrics is not None:
            self.metrics.draft_latency.observe(seconds)
        return responses, failures

    def _proposed(self, request: DraftRequest) -> None:
        """The worker answered `request`'s Propose: it has read every committed token, and holds the grammar sent."""
        session = self._sessions[request.seq_id]
        assumed = request.num_assumed
        session.placed(request.token_ids[: len(request.token_ids) - assumed] if assumed else request.token_ids)
        if request.grammar is not None:
            session.constrained = True

    def _rehome(self, requests: Sequence[DraftRequest]) -> None:
        """Place sessions that have no draft replica (new ones, or ones whose replica failed) where one is usable, if
        they speculate this round and their retry time came."""
        now = time.monotonic()
        for r in requests:
            session = self._sessions.get(r.seq_id)
            due = None if session is None else session.retry_at
            if due is None or now < due or r.num_tokens == 0 or not self.pool.has_usable:
                continue
            if self._place(r.seq_id, session, r.token_ids) is not None:
                session.retry_at = None
            else:
                session.retry_at = now + self.retry_s

    def _evict(self, seq_id: str) -> None:
        """The session's draft state is lost or in doubt: free it where possible, and place it again later."""
        session = self._sessions[seq_id]
        session.lost()
        self.pool.release(seq_id)  # a failed replica is told once it answers again
        session.retry_at = time.monotonic() + self.retry_s

    def release(self, seq_id: str) -> None:
        session = self._sessions.pop(seq_id, None) or _DraftSession()
        sent = session.sent or 0
        # The worker's cache keeps what it read of the session (all it was sent but the last token, read with the
        # next Propose): a conversation's next turn is likely to find it there.
        self.pool.release(seq_id, session.tokens[: sent - 1], session.cache_salt)

    def _snapshot(self) -> list[_DraftSession]:
        # One C-level copy: the router's follower thread reads the counts below while the engine thread runs.
        return list(self._sessions.values())

    @property
    def active_sequences(self) -> int:
        return sum(session.held for session in self._snapshot())

    @property
    def num_homeless(self) -> int:
        """Sessions that draft without a draft replica (none took them: full, draining or failed): what the router
        reports to the draft deployment's autoscaling as waiting for a slot."""
        return sum(session.retry_at is not None for session in self._snapshot())
