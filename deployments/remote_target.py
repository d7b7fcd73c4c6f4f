"""`Target` over the target workers: the router's engine verifies through it, one batched call per replica a round.

A session is placed on a target replica when it is prefilled and stays there (`deployments.replica_pool`); a prefill
that meets a dead or draining replica is tried again on another, unseen by the client.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deployments import worker_codec
from deployments.remote_run import RemoteRun
from deployments.replica_pool import ReplicaPool, group_by_replica, item_sizes, replica_lost, trace_metadata
from deployments.status import WorkerDraining, WorkerUnavailable
from deployments.telemetry import RequestTracer
from specdec.v1 import worker_pb2 as wpb
from specdec_core.decode_run import DecodeItem
from specdec_core.target import PartialPrefill, PartialVerifyFailure, Prefilled, PrefillItem, VerifyItem, VerifyOutcome

if TYPE_CHECKING:
    from deployments.prometheus import ServingMetrics


def _elsewhere(error: Exception) -> bool:
    """A new session that met this error may start on another replica: its replica is lost or draining (either
    way the pool no longer offers it), and nothing was produced yet."""
    return replica_lost(error) or isinstance(error, WorkerDraining)


@dataclass
class _Tried:
    """One placement's outcome, by index of the items tried: started, refused for want of a slot (they wait),
    to be placed elsewhere (their replica is lost or draining), or failed alone."""

    results: list[Prefilled | None]
    refused: list[int] = field(default_factory=list)
    elsewhere: list[int] = field(default_factory=list)
    errors: dict[int, Exception] = field(default_factory=dict)


def _encode_prefill(items: Sequence[PrefillItem]) -> tuple[wpb.PrefillRequest, dict[int, Exception]]:
    """One replica's Prefill, and the items that cannot be sent (each fails alone, never its batch)."""
    message, bad = wpb.PrefillRequest(), {}
    for j, item in enumerate(items):
        try:
            message.items.extend(worker_codec.encode_prefill([item]).items)
        except Exception as exc:
            bad[j] = exc
    return message, bad


class RemoteTarget:
    """`Target` over the target workers."""

    def __init__(
        self, pool: ReplicaPool, tracer: RequestTracer | None = None, metrics: ServingMetrics | None = None
    ) -> None:
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
        fails takes the replicas it failed on out of the pool's choice, so the tries end. Items no replica has room
        for now (by the replicas' own word: other routers share them) wait again, and an item whose replica
        refused it or failed otherwise ends alone (`PartialPrefill`)."""
        results: list[Prefilled | None] = [None] * len(items)
        errors: dict[int, Exception] = {}
        todo, deferred = list(range(len(items))), []
        try:
            for _ in range(len(self.pool.replicas) + 1):
                room = self.pool.free_slots
                todo, deferred = todo[:room], deferred + todo[room:]
                if not todo:
                    break
                tried = self._prefill_once([items[i] for i in todo])
                for j, result in enumerate(tried.results):
                    results[todo[j]] = result
                errors.update((todo[j], error) for j, error in tried.errors.items())
                deferred += [todo[j] for j in tried.refused]
                todo = [todo[j] for j in tried.elsewhere]
                if not todo or not self.pool.has_usable:
                    break
            if todo:
                raise WorkerUnavailable(f"no target worker could prefill {len(todo)} of {len(items)} requests")
        except Exception:
            for item in items:
                self.pool.release(item.seq_id)
            raise
        if deferred or errors:
            raise PartialPrefill(results, errors)
        return results  # type: ignore[return-value]

    def _prefill_once(self, items: Sequence[PrefillItem]) -> _Tried:
        """One placement of `items`, every replica's share in one call."""
        for item in items:
            self.pool.pin(item.seq_id, item.prompt_ids, item.cache_salt)
        tried = _Tried([None] * len(items))
        groups, _ = group_by_replica(self.pool, items, lambda item: item.seq_id)
        requests = {}
        for address, idx in groups.items():
            message, bad = _encode_prefill([items[i] for i in idx])
            tried.errors.update((idx[j], error) for j, error in bad.items())
            if message.items:
                requests[address] = (self.pool.replica_of(items[idx[0]].seq_id), message)
            groups[address] = [i for j, i in enumerate(idx) if j not in bad]
        metadata = trace_metadata(self.tracer, groups, [item.seq_id for item in items], rounds=False)
        responses, failures = self.pool.fan_out(requests, "Prefill", metadata)
        for address, response in responses.items():
            self.pool.reported(address, response.free_slots)
            started = worker_codec.decode_prefilled(response)
            for i, result in zip(groups[address], started):
                tried.results[i] = result
            tried.refused += groups[address][len(started) :]  # no slot there after all: nothing is held
        for address, error in failures.items():
            if _elsewhere(error):
                tried.elsewhere += groups[address]
            else:
                tried.errors.update((i, error) for i in groups[address])
        for i in [*tried.refused, *tried.elsewhere, *tried.errors]:
            self.pool.release(items[i].seq_id)  # a failed replica is told once it answers again
        tried.elsewhere.sort()
        return tried

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyOutcome]:
        """Every replica's rows in one call each. A row whose call failed (or whose session no replica holds) has
        its own error and no outcome (`PartialVerifyFailure`); the others are unaffected."""
        ids = [item.seq_id for item in items]
        if self.tracer is not None:
            self.tracer.begin_round(ids)
        groups, unplaced = group_by_replica(self.pool, items, lambda item: item.seq_id)
        requests = {
            address: (self.pool.replica_of(items[idx[0]].seq_id), worker_codec.encode_verify([items[i] for i in idx]))
            for address, idx in groups.items()
        }
        start = time.perf_counter()
        responses, failures = self.pool.fan_out(
            requests, "Verify", trace_metadata(self.tracer, groups, ids, rounds=True)
        )
        seconds = time.perf_counter() - start  # the round span's verify_ms and the verify latency histogram
        if self.tracer is not None:
            self.tracer.add_call(ids, "verify", seconds, item_sizes(groups, requests, len(ids)))
        if self.metrics is not None:
            self.metrics.verify_latency.observe(seconds)
        outcomes: list[VerifyOutcome | None] = [None] * len(items)
        for address, response in responses.items():
            self.pool.reported(address, response.free_slots)
            idx = groups[address]
            for i, outcome in zip(idx, worker_codec.decode_outcomes(response, [items[i].return_probs for i in idx])):
                outcomes[i] = outcome
        errors = {i: error for address, error in failures.items() for i in groups[address]}
        errors.update((i, WorkerUnavailable(f"no target worker holds session {ids[i]!r}")) for i in unplaced)
        if errors:
            raise PartialVerifyFailure(outcomes, errors)
        return outcomes  # type: ignore[return-value]

    def decode(self, items: Sequence[DecodeItem]) -> RemoteRun:
        return RemoteRun(self.pool, items, self.tracer, self.metrics)

    def release(self, seq_id: str) -> None:
        self.pool.release(seq_id)
