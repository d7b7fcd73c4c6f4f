"""Continuous batching in the router: one thread runs the engine's rounds; requests join and leave between them.

The engine is single-threaded by design. The router's asyncio handlers talk to it only through this class:
`submit` and `cancel` queue a command that the engine thread applies before its next round, and every output
(or the error that refused a request) is handed to the request's callback on the engine thread. Callbacks must
not block: the router's forward them to an asyncio queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from specdec_core.engine import SpecEngine
from specdec_core.errors import ResourceExhausted
from specdec_core.outputs import RequestOutput
from specdec_core.request import Request

log = logging.getLogger(__name__)

Sink = Callable[[RequestOutput | Exception], None]


@dataclass(frozen=True)
class _Submit:
    request: Request
    sink: Sink
    deadline: float | None  # time.monotonic() by which it must finish


@dataclass(frozen=True)
class _Cancel:
    seq_id: str


@dataclass(frozen=True)
class Admission:
    """How long and how many requests may wait for a KV slot, and how long one may run."""

    max_queued: int = 64
    queue_timeout_s: float = 60.0
    request_timeout_s: float | None = None


class DeadlineExceeded(Exception):
    """A request ran past its deadline; reported as DEADLINE_EXCEEDED."""


def _never_waiting() -> Exception:
    return ResourceExhausted("kv_cache", "no KV cache slot came free within the queue timeout")


class Scheduler:
    """`admission` bounds the wait for a KV slot; `why_waiting` says what a request that waited too long is
    told (RESOURCE_EXHAUSTED by default; the router says UNAVAILABLE when no target replica is up)."""

    def __init__(
        self,
        engine: SpecEngine,
        admission: Admission = Admission(),
        why_waiting: Callable[[], Exception] = _never_waiting,
    ) -> None:
        self.engine = engine
        self.admission = admission
        self.why_waiting = why_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._queued_at: dict[str, float] = {}  # waiting requests: when they joined the queue
        self._deadlines: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request, sink: Sink, timeout_s: float | None = None) -> None:
        """Queue `request` for the engine; its outputs, or the error that refused or ended it, go to `sink`.
        `timeout_s`: the request ends with `DeadlineExceeded` after this long (the admission's limit applies too)."""
        limits = [t for t in (timeout_s, self.admission.request_timeout_s) if t is not None]
        deadline = time.monotonic() + min(limits) if limits else None
        self._inbox.put(_Submit(request, sink, deadline))

    def cancel(self, seq_id: str) -> None:
        self._inbox.put(_Cancel(seq_id))

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread, after the commands queued before it (a cancel queued first has aborted
        its request by then)."""
        self._inbox.put(fn)

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    @property
    def num_active(self) -> int:
        return len(self._sinks)

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                # Idle: wait for a command. Only waiting requests (no free slot): poll, never spin.
                idle = not self.engine.has_work
                stalled = not idle and self.engine.num_running == 0
                self._apply_commands(block=idle or stalled, timeout=1.0 if idle else 0.05)
                self._expire()
                if self.engine.has_work:
                    self._deliver(self.engine.step())
            except Exception:  # the engine turns model failures into outputs: this is a bug, keep serving
                log.exception("engine loop error")
        for seq_id in list(self._sinks):
            self._deliver([out] if (out := self.engine.abort(seq_id)) else [])

    def _apply_commands(self, block: bool, timeout: float = 1.0) -> None:
        while True:
            try:
                command = self._inbox.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return
            block = False
            if isinstance(command, _Submit):
                self._admit(command)
            elif isinstance(command, _Cancel):
                output = self.engine.abort(command.seq_id)
                self._deliver([output] if output is not None else [])
            elif command is not None:
                try:
                    command()
                except Exception:
                    log.exception("a call on the engine thread failed")

    def queue_full(self) -> ResourceExhausted | None:
        """The refusal a request joining now would get for want of room in the queue; None if it would join. Read
        from any thread (counts a round stale at worst): the router asks before work it would otherwise waste."""
        backlog = self.engine.num_waiting - self.engine.target.free_slots  # those that will not start next round
        if backlog < self.admission.max_queued:
            return None
        return ResourceExhausted(
            "queue", f"{self.engine.num_waiting} requests already wait for a KV cache slot; retry later"
        )

    def _admit(self, command: _Submit) -> None:
        refusal = self.queue_full()
        if refusal is not None:
            command.sink(refusal)
            return
        try:
            self.engine.add_request(command.request)
        except Exception as exc:  # refused before any work: the caller reports it
            command.sink(exc)
            return
        seq_id = command.request.seq_id
        self._sinks[seq_id] = command.sink
        self._queued_at[seq_id] = time.monotonic()
        if command.deadline is not None:
            self._deadlines[seq_id] = command.deadline

    def _expire(self) -> None:
        """End requests past their deadline, and waiting ones past the queue timeout, before the next round:
        either stops within one round, and `abort` frees their caches."""
        now = time.monotonic()
        waiting = set(self.engine.waiting_request_ids)
        for seq_id in [r for r in self._queued_at if r not in waiting]:
            del self._queued_at[seq_id]  # admitted (or gone)
        late = {r: self.why_waiting() for r, t in self._queued_at.items() if now - t >= self.admission.queue_timeout_s}
        late.update(
            (r, DeadlineExceeded("the request ran past its deadline")) for r, d in self._deadlines.items() if now >= d
        )
        for seq_id, error in late.items():
            self._end(seq_id, error)

    def _end(self, seq_id: str, error: Exception) -> None:
        self.engine.abort(seq_id)
        self._queued_at.pop(seq_id, None)
        self._deadlines.pop(seq_id, None)
        sink = self._sinks.pop(seq_id, None)
        if sink is not None:
            sink(error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            sink = self._sinks.get(output.seq_id)
            if output.finished:
                self._sinks.pop(output.seq_id, None)
                self._queued_at.pop(output.seq_id, None)
                self._deadlines.pop(output.seq_id, None)
            if sink is not None:
                try:
                    sink(output)
                except Exception:
                    log.exception("delivering an output of %s failed", output.seq_id)
