"""`specdec chaos`: a fault campaign against a served stack, each fault while greedy streams are in flight.

The stack serves two target replicas, two draft replicas and two routers. For each fault in turn, `streams`
concurrent greedy requests (speculating) are started; once every one has its first tokens, the fault is made:

- kill-draft, kill-target, kill-router: `ray.kill` of one replica (Serve replaces it);
- stall-target: one target worker's process stopped (SIGSTOP) past the router's `rpc_timeout_s`, then resumed;
- bad-value: one more request among them carries a value no request may hold (top_k beyond 2**31 - 1);
- fill-kv: three times as many requests as the KV slots there are, through both routers at once.

Each request is then counted as exact (its tokens are plain decoding's, as a run with speculation off through
the same stack produced them before any fault), ended with a retryable status naming its cause (UNAVAILABLE,
RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED) after a prefix of those tokens, refused as it should be (the bad value:
INVALID_ARGUMENT naming the field), ended by Serve's proxy when the router replica serving it died (after a prefix
of those tokens: Ray Serve reports a replica that died mid-call as INTERNAL, "The actor died unexpectedly"), or
wrong: anything else (other tokens, another status). Afterwards: the
sessions the workers still hold once the idle timeout has passed (leaked), and the seconds from the fault until a
fresh request is served again (recovery). A campaign passes with 0 wrong and 0 leaked.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc as pb_grpc
from specdec_core.environment import auth_token
from specdec_tools.loadgen.cli import positive
from specdec_tools.reports import write_report

FAULTS = ("kill-draft", "kill-target", "kill-router", "stall-target", "bad-value", "fill-kv")
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
DEPLOYMENTS = {"kill-draft": "DraftWorker", "kill-target": "TargetWorker", "kill-router": "Router"}
MAX_TOKENS = 48
ACTOR_DIED = "actor died unexpectedly"  # Ray's words for a replica process gone mid-call
BAD_TOP_K = 2**32 - 1  # a uint32 on the wire, beyond any vocabulary: refused naming sampling.top_k


@dataclass(frozen=True)
class Outcome:
    tokens: tuple[int, ...]
    code: str  # the gRPC status code's name
    details: str


@dataclass
class FaultReport:
    fault: str
    requests: int = 0
    exact: int = 0
    retryable: int = 0
    refused_as_expected: int = 0
    router_died: int = 0  # ended by Serve's proxy: the router replica serving it died
    wrong: int = 0
    leaked_sessions: int = 0
    recovery_s: float | None = None
    statuses: dict[str, int] = field(default_factory=dict)
    wrong_details: list[str] = field(default_factory=list)


def prompt_of(i: int) -> list[int]:
    return list(range(5 + 3 * i, 25 + 3 * i))


def _request(prompt: list[int], k: int | None, top_k: int = 0) -> pb.GenerateRequest:
    message = pb.GenerateRequest(
        prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, top_k=top_k)
    )
    if k is not None:
        message.speculation.num_speculative_tokens = k
    return message


def _stream(stub: Any, message: pb.GenerateRequest, metadata: Any, started: threading.Barrier | None) -> Outcome:
    tokens: list[int] = []
    try:
        for chunk in stub.GenerateStream(message, metadata=metadata, timeout=300):
            tokens += chunk.token_ids
            if started is not None and len(tokens) == len(chunk.token_ids):
                _arrive(started)
        return Outcome(tuple(tokens), "OK", "")
    except grpc.RpcError as exc:
        return Outcome(tuple(tokens), exc.code().name, exc.details() or "")
    finally:
        if started is not None and not tokens:
            _arrive(started)  # refused before any token: it counts as started


def _arrive(barrier: threading.Barrier) -> None:
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait(timeout=120)


def _run_streams(
    stubs: list[Any], messages: list[pb.GenerateRequest], metadata: Any, fault: Callable[[], None]
) -> list[Outcome]:
    """Every message streamed at once (round robin over `stubs`); `fault()` once each has its first tokens."""
    started = threading.Barrier(len(messages) + 1)
    outcomes: list[Outcome | None] = [None] * len(messages)

    def one(i: int) -> None:
        outcomes[i] = _stream(stubs[i % len(stubs)], messages[i], metadata, started)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(messages))]
    for thread in threads:
        thread.start()
    _arrive(started)
    fault()
    for thread in threads:
        thread.join(timeout=600)
    return [o if o is not None else Outcome((), "HUNG", "no answer") for o in outcomes]


def _classify(report: FaultReport, outcome: Outcome, expected: tuple[int, ...] | None) -> None:
    """`expected`: plain decoding's tokens; None for the request that must be refused."""
    report.requests += 1
    report.statuses[outcome.code] = report.statuses.get(outcome.code, 0) + 1
    if expected is None:
        if outcome.code == "INVALID_ARGUMENT" and "top_k" in outcome.details:
            report.refused_as_expected += 1
            return
    elif outcome.code == "OK" and outcome.tokens == expected:
        report.exact += 1
        return
    elif outcome.tokens == expected[: len(outcome.tokens)]:
        if _retryable(outcome):
            report.retryable += 1
            return
        if outcome.code == "INTERNAL" and ACTOR_DIED in outcome.details and "Router" in outcome.details:
            report.router_died += 1
            return
    report.wrong += 1
    report.wrong_details.append(f"{outcome.code}: {outcome.details[:200]} ({len(outcome.tokens)} tokens)")


def _retryable(outcome: Outcome) -> bool:
    """A status a client retries on, with the cause named."""
    return outcome.code in {code.name for code in RETRYABLE} and bool(outcome.details)


class Campaign:
    """The faults against one running stack (this process connected to its Ray cluster)."""

    def __init__(self, addresses: list[str], app_name: str, streams: int, stall_s: float, idle_s: float) -> None:
        self.channels = [grpc.insecure_channel(a) for a in addresses]
        self.stubs = [pb_grpc.GenerationServiceStub(c) for c in self.channels]
        self.app_name, self.streams, self.stall_s, self.idle_s = app_name, streams, stall_s, idle_s
        token = auth_token()
        self.metadata = (("application", app_name),) + ((("authorization", f"Bearer {token}"),) if token else ())
        self.reference: dict[int, tuple[int, ...]] = {}

    def plain(self, i: int) -> tuple[int, ...]:
        """Request i's tokens decoded plainly (speculation off) through the stack, before any fault."""
        if i not in self.reference:
            response = self.stubs[0].Generate(_request(prompt_of(i), 0), metadata=self.metadata, timeout=300)
            self.reference[i] = tuple(response.token_ids)
        return self.reference[i]

    def run(self, fault: str, slots: int) -> FaultReport:
        n = 3 * slots if fault == "fill-kv" else self.streams
        expected: list[tuple[int, ...] | None] = [self.plain(i) for i in range(n)]
        messages = [_request(prompt_of(i), 3) for i in range(n)]
        if fault == "bad-value":
            messages.append(_request(prompt_of(0), 3, top_k=BAD_TOP_K))
            expected.append(None)
        made: list[float] = []
        outcomes = _run_streams(self.stubs, messages, self.metadata, lambda: made.append(self._make(fault)))
        report = FaultReport(fault)
        for outcome, tokens in zip(outcomes, expected):
            _classify(report, outcome, tokens)
        report.recovery_s = self._recovery(made[0] if made else time.monotonic())
        report.leaked_sessions = self._leaked()
        return report

    def _make(self, fault: str) -> float:
        """Make the fault; when it was made."""
        import ray

        now = time.monotonic()
        if fault in DEPLOYMENTS:
            names = [
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if f"{self.app_name}#{DEPLOYMENTS[fault]}#" in a["name"]
            ]
            ray.kill(ray.get_actor(sorted(names)[0], namespace="serve"))
        elif fault == "stall-target":
            from specdec_tools.soak import find_workers

            pid = next(w.pid for w in find_workers(self.app_name) if w.kind == "target" and w.pid is not None)
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(self.stall_s, os.kill, (pid, signal.SIGCONT)).start()
        return now

    def _recovery(self, since: float, timeout_s: float = 300.0) -> float | None:
        """Seconds from the fault until every router serves a fresh speculative request exactly."""
        deadline = since + timeout_s
        while time.monotonic() < deadline:
            try:
                for stub in self.stubs:
                    response = stub.Generate(_request(prompt_of(0), 3), metadata=self.metadata, timeout=60)
                    if tuple(response.token_ids) != self.plain(0):
                        return None
                return round(time.monotonic() - since, 1)
            except grpc.RpcError:
                time.sleep(0.5)
        return None

    def _leaked(self) -> int:
        """Sessions still held once the workers' idle timeout has passed (a dead router's are freed by it)."""
        from specdec_tools.soak import wait_until_idle

        samples, _ = wait_until_idle(self.app_name, timeout_s=self.idle_s + 15)
        return sum(s.stats.active_sessions for s in samples.values() if s.stats is not None)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def run_chaos(
    addresses: list[str],
    app_name: str,
    streams: int,
    slots: int,
    stall_s: float,
    idle_s: float,
    faults: tuple[str, ...] = FAULTS,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    campaign = Campaign(addresses, app_name, streams, stall_s, idle_s)
    try:
        reports = []
        for fault in faults:
            progress(f"chaos: {fault}")
            reports.append(campaign.run(fault, slots))
            progress(f"chaos: {fault}: {asdict(reports[-1])}")
    finally:
        campaign.close()
    wrong = sum(r.wrong for r in reports)
    leaked = sum(r.leaked_sessions for r in reports)
    return {"faults": [asdict(r) for r in reports], "passed": wrong == 0 and leaked == 0}


def format_table(report: dict[str, Any]) -> str:
    lines = [
        "| fault | requests | exact | retryable status | refused as expected | router died (Serve: INTERNAL) | wrong "
        "| leaked sessions | recovery s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["faults"]:
        recovery = "-" if r["recovery_s"] is None else r["recovery_s"]
        lines.append(
            f"| {r['fault']} | {r['requests']} | {r['exact']} | {r['retryable']} | {r['refused_as_expected']} "
            f"| {r['router_died']} | {r['wrong']} | {r['leaked_sessions']} | {recovery} |"
        )
    return "\n".join(lines)


# -- the command -----------------------------------------------------------------------------------------------


def register(sub: Any) -> None:
    chaos = sub.add_parser("chaos", help="kill and stall replicas under load; report exact, retryable and wrong")
    chaos.add_argument("--streams", type=positive(int), default=6, help="concurrent greedy streams per fault")
    chaos.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, from {', '.join(FAULTS)}")
    chaos.add_argument("--json", type=Path, default=None, help="where to write the report")
    chaos.set_defaults(func=chaos_main)


def chaos_main(args: argparse.Namespace) -> int:
    from deployments.launch import serving

    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip())
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        print(f"--faults: unknown {unknown}; choose from {', '.join(FAULTS)}", file=sys.stderr)
        return 2
    with chaos_config() as config, serving(config, quiet=True):
        report = run_chaos(
            [f"127.0.0.1:{config.grpc_port}"],
            config.app_name,
            args.streams,
            slots=SLOTS_PER_TARGET * 2,
            stall_s=config.router.rpc_timeout_s + 3,
            idle_s=config.session_idle_timeout_s,
            faults=faults,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    print(format_table(report))
    if args.json is not None:
        write_report(report, args.json)
    return 0 if report["passed"] else 1


SLOTS_PER_TARGET = 4


def chaos_overrides(tiny_root: str | Path) -> dict[str, Any]:
    """The campaign's stack over the tiny pair at `tiny_root`: two replicas of each worker and of the router, a few
    KV slots per target, short timeouts so that a stall and a dead router's sessions end within the run."""
    root = Path(tiny_root)
    worker = {"dtype": "float32", "num_cpus": 0.25, "threads": 1, "num_replicas": 2}
    return {
        "auth": "none",
        "session_idle_timeout_s": 5.0,
        "target": {"model": str(root / "target"), "max_sequences": SLOTS_PER_TARGET, **worker},
        "draft": {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": 3, **worker},
        "router": {
            "num_replicas": 2,
            "num_cpus": 0.25,
            "max_seq_len": 256,
            "rpc_timeout_s": 4.0,
            "draft_timeout_s": 2.0,
            "worker_refresh_s": 2.0,
            "queue_timeout_s": 120.0,
        },
    }


@contextlib.contextmanager
def chaos_config() -> Iterator[Any]:
    import tempfile

    from deployments.ports import free_port
    from deployments.serve_config import parse_config
    from specdec_core.models.tiny import build_tiny_pair

    with tempfile.TemporaryDirectory(prefix="specdec-chaos-") as root:
        build_tiny_pair(root)
        data = chaos_overrides(root)
        data["grpc_port"], data["http_port"] = free_port(), free_port()
        yield parse_config(data)
