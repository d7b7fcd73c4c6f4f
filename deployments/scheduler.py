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
from dataclasses import dataclass
from typing import Callable, Sequence, Union

from specdec_core.config import SamplingParams
from specdec_core.engine import RequestOutput, SpecEngine

log = logging.getLogger(__name__)

Sink = Callable[[Union[RequestOutput, Exception]], None]


@dataclass(frozen=True)
class _Submit:
    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams
    num_speculative_tokens: int | str | None
    sink: Sink
    return_probs: bool


@dataclass(frozen=True)
class _Cancel:
    request_id: str


class Scheduler:
    def __init__(self, engine: SpecEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        num_speculative_tokens: int | str | None,
        sink: Sink,
        return_probs: bool = False,
    ) -> None:
        """`return_probs`: the request's round outputs carry q and p of the proposals (`SpecEngine.add_request`)."""
        self._inbox.put(_Submit(request_id, prompt_ids, params, num_speculative_tokens, sink, return_probs))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(_Cancel(request_id))

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
                self._apply_commands(block=not self.engine.has_work)
                if self.engine.has_work:
                    self._deliver(self.engine.step())
            except Exception:  # the engine turns model failures into outputs: this is a bug, keep serving
                log.exception("engine loop error")
        for request_id in list(self._sinks):
            self._deliver([out] if (out := self.engine.abort(request_id)) else [])

    def _apply_commands(self, block: bool) -> None:
        while True:
            try:
                command = self._inbox.get(block=block, timeout=1.0 if block else None)
            except queue.Empty:
                return
            block = False
            if isinstance(command, _Submit):
                try:
                    self.engine.add_request(
                        command.request_id, command.prompt_ids, command.params, command.num_speculative_tokens,
                        command.return_probs,
                    )
                except Exception as exc:  # refused before any work: the caller reports it
                    command.sink(exc)
                else:
                    self._sinks[command.request_id] = command.sink
            elif isinstance(command, _Cancel):
                output = self.engine.abort(command.request_id)
                self._deliver([output] if output is not None else [])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if output.finished:
                self._sinks.pop(output.request_id, None)
            if sink is not None:
                try:
                    sink(output)
                except Exception:
                    log.exception("delivering an output of %s failed", output.request_id)
