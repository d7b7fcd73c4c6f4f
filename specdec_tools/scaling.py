"""How the worker deployments scale under a load that steps: replicas and sessions over time.

`StepLoad` keeps a number of GenerateStream requests in flight (closed loop, threads), a number that the caller
changes in steps; `ScalingTimeline` samples, every `interval_s`, each worker deployment's replicas by Serve's
state (running, starting, stopping), the replicas registered for the routers, and the sessions every replica holds
(GetStats), those of a replica that is draining (stopping, no longer registered) included. Both run in a process
connected to the stack's Ray cluster. `benchmarks/autoscaling/autoscale_timeline.py` records a step load on a
config; the autoscaling test records its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from specdec.v1 import generation_pb2 as pb
from specdec.v1 import worker_pb2 as wpb
from specdec.v1 import worker_pb2_grpc as wpb_grpc

DEPLOYMENTS = {"target": "TargetWorker", "draft": "DraftWorker"}  # kind -> deployment name (deployments.app)
STUBS = {"target": wpb_grpc.TargetServiceStub, "draft": wpb_grpc.DraftServiceStub}


@dataclass(frozen=True)
class Result:
    """One request of the load: its tokens, or the status it failed with."""

    stream: int
    index: int  # the request's number within its stream
    token_ids: tuple[int, ...]
    error: str | None  # a gRPC status name, FINISH_REASON_ERROR or EMPTY_STREAM


class StepLoad:
    """Keep `streams` GenerateStream requests in flight, each replaced as it ends, until `set_streams` changes the
    number (a stream beyond the new number ends after its current request). `make_request(stream, index)` is each
    stream's next request."""

    def __init__(
        self,
        stub: Any,
        make_request: Callable[[int, int], pb.GenerateRequest],
        metadata: Sequence[tuple[str, str]] = (),
        timeout_s: float = 600.0,
    ) -> None:
        self.stub = stub
        self.make_request = make_request
        self.metadata = list(metadata)
        self.timeout_s = timeout_s
        self.results: list[Result] = []
        self.in_flight = 0
        self._streams = 0
        self._live: set[int] = set()  # streams whose thread runs (decided under the lock)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def set_streams(self, streams: int) -> None:
        with self._lock:
            self._streams = streams
            for i in range(streams):
                if i not in self._live:
                    self._live.add(i)
                    thread = threading.Thread(target=self._stream, args=(i,), name=f"load-{i}", daemon=True)
                    self._threads.append(thread)
                    thread.start()

    def stop(self) -> None:
        """End the load: every stream finishes its current request."""
        self.set_streams(0)
        for thread in self._threads:
            thread.join()

    def _stream(self, stream: int) -> None:
        index = 0
        while True:
            with self._lock:
                if stream >= self._streams:
                    self._live.discard(stream)
                    return
                self.in_flight += 1
            result = self._one(stream, index)
            with self._lock:
                self.in_flight -= 1
                self.results.append(result)
            index += 1

    def _one(self, stream: int, index: int) -> Result:
        tokens: list[int] = []
        last = None
        try:
            for chunk in self.stub.GenerateStream(
                self.make_request(stream, index), metadata=self.metadata, timeout=self.timeout_s
            ):
                tokens += chunk.token_ids
                last = chunk
        except grpc.RpcError as exc:
            return Result(stream, index, tuple(tokens), exc.code().name)
        except Exception as exc:  # counted, never lost with its thread
            return Result(stream, index, tuple(tokens), type(exc).__name__)
        if last is None or last.finish_reason == pb.FINISH_REASON_ERROR:
            return Result(stream, index, tuple(tokens), "FINISH_REASON_ERROR" if last is not None else "EMPTY_STREAM")
        return Result(stream, index, tuple(tokens), None)


@dataclass
class Sample:
    t: float  # seconds since the timeline started
    streams: int  # requests of the load in flight
    replicas: dict[str, dict[str, int]]  # kind -> Serve's replica states (RUNNING, STARTING, STOPPING...) -> count
    registered: dict[str, list[str]]  # kind -> addresses the routers are offered
    sessions: dict[str, dict[str, int]]  # kind -> address -> sessions held (every replica that answered)

    def running(self, kind: str) -> int:
        return self.replicas.get(kind, {}).get("RUNNING", 0)

    def stopping(self, kind: str) -> int:
        return self.replicas.get(kind, {}).get("STOPPING", 0)

    def draining(self, kind: str) -> dict[str, int]:
        """Sessions held by replicas no longer registered: finishing there while the replica drains."""
        return {a: n for a, n in self.sessions.get(kind, {}).items() if a not in self.registered.get(kind, [])}


@dataclass
class ScalingTimeline:
    """Samples of app `app`'s worker deployments every `interval_s` on a thread of its own, from `start` to
    `stop`. `load`: the load whose streams in flight each sample records."""

    app: str
    kinds: tuple[str, ...] = ("target", "draft")
    interval_s: float = 0.5
    load: StepLoad | None = None
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scaling-timeline", daemon=True)
        self._channels: dict[str, tuple[grpc.Channel, Any]] = {}
        self._t0 = time.monotonic()

    def start(self) -> ScalingTimeline:
        from deployments import worker_registry as registry
        from deployments.tls import Role

        self._registry = registry.registry()
        self._credentials = registry.credentials(self.app, Role.CLIENT)  # as a tool gets them
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for channel, _ in self._channels.values():
            channel.close()

    @property
    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def wait_for(self, condition: Callable[[Sample], bool], timeout_s: float) -> bool:
        """Whether a sample taken from now on meets `condition` within `timeout_s`."""
        seen = len(self.samples)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(condition(s) for s in self.samples[seen:]):
                return True
            time.sleep(self.interval_s / 2)
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self._sample())
            except Exception:  # a sample lost (the controller busy) is only a gap in the timeline
                pass
            self._stop.wait(self.interval_s)

    def _sample(self) -> Sample:
        import ray
        from ray import serve

        deployments = serve.status().applications[self.app].deployments
        replicas, registered, sessions = {}, {}, {}
        for kind in self.kinds:
            status = deployments.get(DEPLOYMENTS[kind])
            states = status.replica_states if status is not None else {}
            replicas[kind] = {str(getattr(state, "value", state)): n for state, n in states.items()}
            registered[kind] = ray.get(self._registry.addresses.remote(self.app, kind))
            for address in registered[kind]:
                if address not in self._channels:
                    self._channels[address] = self._dial(address, kind)
            sessions[kind] = {a: n for a in self._addresses(kind) if (n := self._held(a)) is not None}
        streams = self.load.in_flight if self.load is not None else 0
        return Sample(round(time.monotonic() - self._t0, 2), streams, replicas, registered, sessions)

    def _dial(self, address: str, kind: str) -> tuple[grpc.Channel, Any]:
        from deployments.auth import dial

        channel = dial(address, self._credentials)
        return channel, STUBS[kind](channel)

    def _addresses(self, kind: str) -> list[str]:
        return [a for a, (_, stub) in self._channels.items() if isinstance(stub, STUBS[kind])]

    def _held(self, address: str) -> int | None:
        try:
            return self._channels[address][1].GetStats(wpb.GetStatsRequest(), timeout=2).active_sessions
        except grpc.RpcError:  # stopped
            return None

    def table(self, changes_only: bool = False) -> str:
        """One line per sample: replicas running (+ starting, - stopping) and sessions per replica, per kind;
        sessions of a draining replica marked *. `changes_only`: the samples where the replicas changed (Serve's
        states or those registered), and the last."""
        lines, last = [], None
        for n, s in enumerate(self.samples):
            state = [(sorted(s.replicas.get(k, {}).items()), sorted(s.registered.get(k, []))) for k in self.kinds]
            if changes_only and state == last and n != len(self.samples) - 1:
                continue
            last = state
            parts = [f"{s.t:7.1f}s streams {s.streams:3d}"]
            for kind in self.kinds:
                states = s.replicas.get(kind, {})
                starting = sum(n for state, n in states.items() if state in ("STARTING", "PENDING_MIGRATION"))
                held = [
                    f"{n}{'*' if a not in s.registered.get(kind, []) else ''}"
                    for a, n in sorted(s.sessions.get(kind, {}).items())
                ]
                parts.append(f"{kind} {s.running(kind)} (+{starting} -{s.stopping(kind)}) sessions [{' '.join(held)}]")
            lines.append(" | ".join(parts))
        return "\n".join(lines)

    def as_json(self) -> list[dict[str, Any]]:
        return [
            {"t": s.t, "streams": s.streams, "replicas": s.replicas, "registered": s.registered, "sessions": s.sessions}
            for s in self.samples
        ]
