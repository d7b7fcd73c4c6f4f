"""A run of plain steps over the target workers (`specdec_core.decode_run`): one Decode stream per replica that
holds some of its rows, read step by step.

Each stream is read on a thread of its own into a queue, so that a step that does not come within the pool's
timeout fails that replica's rows (the call is cancelled, and the worker releases what it held for them) rather than
hanging the engine. The replicas step at their own pace; the run's step i is every live stream's step i. A replica's
failure is its rows' alone, as in a verify: they get its error, the other rows go on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import grpc

from deployments import status, worker_codec
from deployments.replica_pool import Replica, ReplicaPool, group_by_replica, replica_lost
from deployments.status import WorkerUnavailable
from deployments.telemetry import RequestTracer, carrier_metadata
from specdec.v1 import worker_pb2 as wpb
from specdec_core.decode_run import DecodeItem, Step

if TYPE_CHECKING:
    from deployments.prometheus import ServingMetrics

log = logging.getLogger(__name__)

_END = object()  # a stream's end, in its queue


class _Stream:
    """One replica's Decode call, read into a queue by its own thread."""

    def __init__(self, replica: Replica, call: grpc.Call, rows: list[int]) -> None:
        self.replica, self.call, self.rows = replica, call, rows
        self.ended = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, name="specdec-decode-stream", daemon=True).start()

    def _read(self) -> None:
        try:
            for message in self.call:  # type: ignore[attr-defined]
                self._queue.put(message)
            self._queue.put(_END)
        except grpc.RpcError as exc:
            self._queue.put(exc)

    def next(self, timeout_s: float) -> wpb.DecodeStep | object | grpc.RpcError:
        """Its next step, `_END`, or the error that ended it (a step not come within `timeout_s`: DEADLINE_EXCEEDED,
        after cancelling the call)."""
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            self.call.cancel()
            return _Timeout(timeout_s)


class _Timeout(grpc.RpcError):
    """A step that did not come in time, read as the status a unary call past its deadline gets."""

    def __init__(self, timeout_s: float) -> None:
        self.message = f"no step within {timeout_s:g} s"
        super().__init__(self.message)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self.message


class RemoteRun:
    """`DecodeRun` over the target workers."""

    def __init__(
        self,
        pool: ReplicaPool,
        items: Sequence[DecodeItem],
        tracer: RequestTracer | None = None,
        metrics: ServingMetrics | None = None,
    ) -> None:
        self.pool, self.tracer, self.metrics = pool, tracer, metrics
        self.ids = [item.seq_id for item in items]
        self.run_id = uuid.uuid4().hex
        groups, unplaced = group_by_replica(pool, items, lambda item: item.seq_id)
        # Sessions no replica holds fail at the first step, alone.
        self._unplaced = {i: WorkerUnavailable(f"no target worker holds session {self.ids[i]!r}") for i in unplaced}
        self._streams = [self._open(address, [items[i] for i in idx], idx) for address, idx in groups.items()]
        self._stopped = False

    def _open(self, address: str, items: list[DecodeItem], rows: list[int]) -> _Stream:
        replica = self.pool.replica_of(items[0].seq_id)
        metadata = None
        if self.tracer is not None:
            metadata = carrier_metadata(self.tracer.spans([item.seq_id for item in items], rounds=False))
        request = worker_codec.encode_decode(self.run_id, items)
        call = replica.stub.Decode(request, metadata=metadata)  # type: ignore[attr-defined]
        return _Stream(replica, call, rows)

    def stop(self) -> None:
        """Ask every replica still stepping to end after its step under way; one that cannot be asked is left to
        end its run by itself (its rows' limits bound it)."""
        if self._stopped:
            return
        self._stopped = True
        for stream in self._streams:
            if stream.ended:
                continue
            try:
                stream.replica.stub.StopDecode(  # type: ignore[attr-defined]
                    wpb.StopDecodeRequest(run_id=self.run_id), timeout=min(self.pool.timeout_s, 10.0)
                )
            except grpc.RpcError as exc:
                log.warning("could not stop a run on %s: %s", stream.replica.address, exc.code())

    def __iter__(self) -> Iterator[Step]:
        while (step := self._next()) is not None:
            yield step

    def _next(self) -> Step | None:
        step: Step = [None] * len(self.ids)
        for i, error in self._unplaced.items():
            step[i] = error
        moved = bool(self._unplaced)
        self._unplaced = {}
        live = [stream for stream in self._streams if not stream.ended]
        if self.tracer is not None:
            self.tracer.begin_round([self.ids[i] for stream in live for i in stream.rows])
        start = time.perf_counter()
        for stream in live:
            moved |= self._read(stream, step)
        seconds = time.perf_counter() - start
        if self.tracer is not None:
            ids = [self.ids[i] for i, token in enumerate(step) if token is not None]
            self.tracer.add_call(ids, "verify", seconds, [0] * len(ids))
        if self.metrics is not None and moved:
            self.metrics.verify_latency.observe(seconds)
        return step if moved else None

    def _read(self, stream: _Stream, step: Step) -> bool:
        """`stream`'s next step into `step`; False when it has ended."""
        message = stream.next(self.pool.timeout_s)
        if message is _END:
            stream.ended = True
            return False
        if isinstance(message, grpc.RpcError):
            stream.ended = True
            what = f"target worker {stream.replica.address}: Decode"
            error = status.error_of(message.code(), message.details(), what)  # type: ignore[attr-defined]
            if replica_lost(error):
                self.pool.mark_failed(stream.replica.address)
            for i in stream.rows:
                step[i] = error
            return True
        assert isinstance(message, wpb.DecodeStep)
        self.pool.answered(stream.replica)  # a failed replica that steps is back: what it may hold is released
        self.pool.reported(stream.replica.address, message.free_slots)
        for i, token in zip(stream.rows, worker_codec.decode_step(message)):
            step[i] = token
        return True
