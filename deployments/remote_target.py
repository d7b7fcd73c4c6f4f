"""`Target` over the target workers: the router's engine verifies through it, one batched call per replica a round.

A session is placed on a target replica when it is prefilled and stays there (`deployments.replica_pool`); a prefill
that meets a dead or draining replica is tried again on another, unseen by the client.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from deployments import worker_codec
from deployments.replica_pool import ReplicaPool, group_by_replica, item_sizes, replica_lost, trace_metadata
from deployments.status import WorkerDraining, WorkerUnavailable
from deployments.telemetry import RequestTracer
from specdec_core.target import PartialPrefill, PartialVerifyFailure, Prefilled, PrefillItem, VerifyItem, VerifyOutcome

if TYPE_CHECKING:
    from deployments.prometheus import ServingMetrics


def _elsewhere(error: Exception) -> bool:
    """A new session that met this error may start on another replica: its replica is lost or draining (either
    way the pool no longer offers it), and nothing was produced yet."""
    return replica_lost(error) or isinstance(error, WorkerDraining)


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
        groups = group_by_replica(self.pool, items, lambda item: item.seq_id)
        requests = {
            address: (self.pool.replica_of(items[idx[0]].seq_id), worker_codec.encode_prefill([items[i] for i in idx]))
            for address, idx in groups.items()
        }
        metadata = trace_metadata(self.tracer, groups, [item.seq_id for item in items], rounds=False)
        responses, failures = self.pool.fan_out(requests, "Prefill", metadata)
        if any(not _elsewhere(error) for error in failures.values()):
            raise next(error for error in failures.values() if not _elsewhere(error))
        first: list[Prefilled | None] = [None] * len(items)
        for address, response in responses.items():
            for i, result in zip(groups[address], worker_codec.decode_prefilled(response)):
                first[i] = result
        failed = sorted(i for address in failures for i in groups[address])
        for i in failed:
            self.pool.unpin(items[i].seq_id)  # a draining replica still lists it (a lost one already forgot it)
        return first, failed

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyOutcome]:
        ids = [item.seq_id for item in items]
        if self.tracer is not None:
            self.tracer.begin_round(ids)
        groups = group_by_replica(self.pool, items, lambda item: item.seq_id)
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
            idx = groups[address]
            for i, outcome in zip(idx, worker_codec.decode_outcomes(response, [items[i].return_probs for i in idx])):
                outcomes[i] = outcome
        if failures:
            errors = {i: error for address, error in failures.items() for i in groups[address]}
            if len(errors) == len(items):
                raise next(iter(failures.values()))
            raise PartialVerifyFailure(outcomes, errors)
        return outcomes  # type: ignore[return-value]

    def release(self, seq_id: str) -> None:
        self.pool.release(seq_id)
