"""`specdec soak`: hold N concurrent streams against a served stack for a while, then check that nothing leaked.

`run_soak` works against a stack that is already running (this process connected to its Ray cluster): it keeps
`concurrency` GenerateStream requests in flight for `duration_s`, varying the prompt (text, chat template or raw,
token ids), the length, greedy or sampled decoding (top-p, top-k, seeds, stop strings) and speculation (the
server's setting, off, a fixed k, auto), and cancels a few streams mid-way on purpose. Afterwards it waits, for a
bounded time, until the workers hold no session, and reports:

- requests: ok, cancelled on purpose (not errors), and errors by gRPC status code;
- each worker process's resident memory (RSS) after a warm-up, at its peak during the load, and at the end;
- the sessions left open in the workers (GetStats' active_sessions), which must be 0 once the load is over.

`specdec soak` builds the tiny random pair (or takes --config), serves it on a local Ray cluster, runs the soak,
and shuts everything down; its exit status is 1 when the soak failed (an error, a session left open).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

import deployments
from deployments.ports import free_port
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc as pb_grpc
from specdec.v1 import worker_pb2 as wpb
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.environment import auth_token
from specdec_tools.loadgen.cli import positive
from specdec_tools.loadgen.client import closed_loop, stream_one
from specdec_tools.reports import write_report
from specdec_tools.requests import Speculation, generate_request

# ray, psutil and the stack are imported where they are used: `specdec` builds every subcommand's parser on start.
if TYPE_CHECKING:
    from deployments.auth import InternalCredentials

OK = "ok"
CANCELLED_ON_PURPOSE = "cancelled_on_purpose"  # not gRPC's CANCELLED, which would be an error: the server gave up
WORKER_DEPLOYMENTS = {"target": "TargetWorker", "draft": "DraftWorker"}  # kind -> deployment name (deployments.app)
TINY_CONFIG = Path(deployments.__file__).parent / "configs" / "tiny.yaml"
MEMORY_NOTE = (
    "RSS is read from the worker processes on this node: after a warm-up, at its peak during the load, and after "
    "it. A short soak shows first-use growth (allocator pools, kernels, lazily built buffers) that levels off; "
    "growth that keeps rising with the soak's length is what points at a leak, so compare runs of different "
    "lengths. Memory does not decide pass or fail."
)

# Text prompts of a few lengths; repeated 1-3 times. Requests are sized for a context of 256 tokens or more.
PROMPTS = (
    "Write a function that returns the sum of a list.",
    "Explain what the code does and why it is correct.",
    "def mean(values: list[float]) -> float:",
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding lets a cheap draft model propose tokens that the large target model then verifies.",
    "hi",
)
SPECULATION_CHOICES: tuple[Speculation, ...] = (None, 0, 1, 2, 3, 4, "auto")


@dataclass(frozen=True)
class SoakPlan:
    concurrency: int
    duration_s: float
    seed: int = 0
    cancel_fraction: float = 0.1  # requests cancelled after their first few chunks, on purpose
    warmup_requests: int | None = None  # before the start RSS is read; None: one per stream
    request_timeout_s: float = 120.0
    idle_timeout_s: float = 60.0  # how long to wait for the workers to release every session afterwards
    sample_every_s: float = 2.0  # RSS samples for the peak
    auth_token: str | None = None  # the public API's bearer token, when the router asks for one

    @property
    def num_warmup(self) -> int:
        return self.concurrency if self.warmup_requests is None else self.warmup_requests

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("authorization", f"Bearer {self.auth_token}"),) if self.auth_token else None


# -- the requests --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One request of the soak and what it exercises."""

    request: pb.GenerateRequest
    cancel_after_chunks: int | None  # cancel the stream after this many chunks; None: read it to the end
    tags: tuple[str, ...]  # what it exercises, counted in the report's `mix`


def make_variant(index: int, seed: int, cancel_fraction: float) -> Variant:
    """Request `index` of a soak seeded `seed`: the same index and seed give the same request, in any order."""
    rng = random.Random(f"{seed}:{index}")
    cancel_after = rng.randint(1, 3) if rng.random() < cancel_fraction else None
    # A stream to cancel must outlast its cancel point, so it asks for more tokens and ignores eos.
    max_tokens = 64 if cancel_after else rng.randint(4, 48)
    ignore_eos = cancel_after is not None or rng.random() < 0.8
    temperature = rng.choice((0.0, 0.0, 0.7, 1.0))
    speculation = rng.choice(SPECULATION_CHOICES)
    by_ids = rng.random() < 0.2
    text = "" if by_ids else " ".join([rng.choice(PROMPTS)] * rng.randint(1, 3))
    request = generate_request(
        text or None,
        temperature=temperature,
        seed=seed + index,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        speculation=speculation,
    )
    tags = ["sampled" if temperature else "greedy", _speculation_tag(speculation)]
    if by_ids:
        request.prompt_token_ids.extend(rng.randrange(5, 300) for _ in range(rng.randint(1, 60)))
        tags.append("token_ids")
    elif rng.random() < 0.15:
        request.raw_prompt = True
        tags.append("raw_prompt")
    if temperature and rng.random() < 0.5:
        request.sampling.top_p = 0.9
        request.sampling.top_k = rng.choice((0, 20))
        tags.append("top_p_k")
    if rng.random() < 0.1:
        request.sampling.stop.append("\n")
        tags.append("stop")
    if cancel_after:
        tags.append("cancel")
    return Variant(request, cancel_after, tuple(tags))


def _speculation_tag(speculation: Speculation) -> str:
    if speculation is None:
        return "spec=server"
    return "spec=off" if speculation == 0 else f"spec={speculation}"


@dataclass(frozen=True)
class Outcome:
    status: str  # OK, CANCELLED_ON_PURPOSE, or an error: a gRPC status name, FINISH_REASON_ERROR, EMPTY_STREAM
    tokens: int  # output tokens received (a cancelled stream's count up to its cancel point)


async def send(stub: Any, variant: Variant, plan: SoakPlan) -> Outcome:
    if variant.cancel_after_chunks is None:
        record = await stream_one(stub, variant.request, plan.request_timeout_s, plan.metadata)
        return Outcome(OK if record.ok else str(record.error), record.output_tokens)
    return await _stream_then_cancel(stub, variant, plan)


async def _stream_then_cancel(stub: Any, variant: Variant, plan: SoakPlan) -> Outcome:
    """Read `cancel_after_chunks` chunks, then cancel: the client going away mid-stream, which must free the
    request's sessions in both workers. A stream that ends first counts as an ordinary request."""
    call = stub.GenerateStream(variant.request, timeout=plan.request_timeout_s, metadata=plan.metadata)
    chunks = tokens = 0
    try:
        async for chunk in call:
            chunks += 1
            tokens += len(chunk.token_ids)
            if chunk.finish_reason == pb.FINISH_REASON_ERROR:
                return Outcome("FINISH_REASON_ERROR", tokens)
            if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                return Outcome(OK, tokens)
            if chunks >= variant.cancel_after_chunks:
                break
        else:
            return Outcome("EMPTY_STREAM" if chunks == 0 else OK, tokens)
    except grpc.aio.AioRpcError as exc:
        return Outcome(exc.code().name, tokens)
    call.cancel()
    return Outcome(CANCELLED_ON_PURPOSE, tokens)


class Tally:
    """What the load did so far; one event loop updates it, so no lock."""

    def __init__(self) -> None:
        self.statuses: Counter[str] = Counter()
        self.mix: Counter[str] = Counter()
        self.tokens = 0

    def add(self, variant: Variant, outcome: Outcome) -> None:
        self.statuses[outcome.status] += 1
        self.mix.update(variant.tags)
        self.tokens += outcome.tokens

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def errors(self) -> dict[str, int]:
        return {s: n for s, n in sorted(self.statuses.items()) if s not in (OK, CANCELLED_ON_PURPOSE)}


async def _load(
    address: str, plan: SoakPlan, tally: Tally, first_index: int, num_requests: int | None, deadline: float | None
) -> None:
    """Keep plan.concurrency streams in flight (loadgen's closed loop) until `num_requests` or `deadline`."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)

        async def one(index: int) -> Outcome:
            variant = make_variant(first_index + index, plan.seed, plan.cancel_fraction)
            outcome = await send(stub, variant, plan)
            tally.add(variant, outcome)
            return outcome

        await closed_loop(one, plan.concurrency, num_requests, deadline, on_done=lambda: None)


# -- the workers ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerProcess:
    """A worker replica: its process (pid None when it runs on another node, where RSS cannot be read) and its
    gRPC server (address None when no registered address matches the process's listening ports)."""

    kind: str
    replica_id: str
    pid: int | None
    address: str | None


@dataclass(frozen=True)
class WorkerSample:
    rss_bytes: int | None
    stats: wpb.WorkerStats | None  # None: GetStats failed


def find_workers(app_name: str) -> tuple[WorkerProcess, ...]:
    """Every alive draft and target replica of `app_name`: processes from Ray's actor table, gRPC addresses from
    the registry, paired by the port each process listens on."""
    import ray

    from deployments import worker_registry as registry

    node_id = ray.get_runtime_context().get_node_id()
    workers = []
    for kind, deployment in WORKER_DEPLOYMENTS.items():
        addresses = set(ray.get(registry.registry().addresses.remote(app_name, kind)))
        for replica_id, pid, actor_node in _replica_actors(app_name, deployment):
            if actor_node != node_id:
                continue  # its process is out of reach from here; its registered address is listed below
            address = _address_of(pid, addresses)
            addresses.discard(address)
            workers.append(WorkerProcess(kind, replica_id, pid, address))
        # Registered but not matched to a process here (another node): still asked for its sessions.
        workers.extend(WorkerProcess(kind, "", None, a) for a in sorted(addresses))
    return tuple(workers)


def _replica_actors(app_name: str, deployment: str) -> list[tuple[str, int, str]]:
    """(replica id, pid, node id) of the alive replicas of a deployment. Read from the GCS actor table:
    `ray.util.state.list_actors` reads the same table through the dashboard, which `specdec serve` and the
    tests start without."""
    from ray._private import state

    class_name = f"ServeReplica:{app_name}:{deployment}"  # Serve's replica actor class name
    return [
        (info["Name"].rsplit("#", 1)[-1], int(info["Pid"]), info["Address"]["NodeID"])
        for info in state.actors().values()
        if info["ActorClassName"] == class_name and info["State"] == "ALIVE"
    ]


def _address_of(pid: int, addresses: set[str]) -> str | None:
    """The registered address whose port `pid` listens on (a worker serves gRPC in its own process)."""
    ports = _listening_ports(pid)
    return next((a for a in sorted(addresses) if int(a.rsplit(":", 1)[1]) in ports), None)


def _listening_ports(pid: int) -> set[int]:
    import psutil

    try:
        connections = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return set()
    return {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}


def read_rss(pid: int | None) -> int | None:
    import psutil

    if pid is None:
        return None
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:  # the process is gone (a replica that died and was replaced)
        return None


def worker_credentials(app_name: str) -> InternalCredentials:
    """What the soak presents to the workers' GetStats: a client's credentials, from the registry as a router gets
    them (`deployments.auth.InternalCredentials`)."""
    from deployments import worker_registry as registry
    from deployments.tls import Role

    return registry.credentials(app_name, Role.CLIENT)


def read_stats(
    worker: WorkerProcess, credentials: InternalCredentials, timeout_s: float = 10.0
) -> wpb.WorkerStats | None:
    from deployments.auth import dial

    if worker.address is None:
        return None
    stub_class = wpb_grpc.TargetServiceStub if worker.kind == "target" else wpb_grpc.DraftServiceStub
    try:
        with dial(worker.address, credentials) as channel:
            return stub_class(channel).GetStats(wpb.GetStatsRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return None


def sample(workers: tuple[WorkerProcess, ...], credentials: InternalCredentials) -> dict[WorkerProcess, WorkerSample]:
    return {w: WorkerSample(read_rss(w.pid), read_stats(w, credentials)) for w in workers}


def wait_until_idle(app_name: str, timeout_s: float) -> tuple[dict[WorkerProcess, WorkerSample], float]:
    """Poll until no worker holds a session or `timeout_s` passes: a cancelled stream's sessions are released a
    moment after the client went away. Returns the last sample of each worker there was then, and the seconds
    waited."""
    start = time.monotonic()
    credentials = worker_credentials(app_name)
    while True:
        workers = find_workers(app_name)  # again: a replica may have been replaced during the load
        samples = sample(workers, credentials)
        idle = all(s.stats is not None and s.stats.active_sessions == 0 for s in samples.values())
        waited = time.monotonic() - start
        if idle or waited >= timeout_s:
            return samples, waited
        time.sleep(0.5)


async def _track_peaks(
    workers: tuple[WorkerProcess, ...],
    stop: asyncio.Event,
    plan: SoakPlan,
    tally: Tally,
    progress: Callable[[str], None] | None,
    progress_every_s: float = 30.0,
) -> dict[WorkerProcess, int]:
    """Each worker's highest RSS while the load runs, sampled every plan.sample_every_s; a progress line now and
    then."""
    peaks: dict[WorkerProcess, int] = {}
    start = last_progress = time.perf_counter()
    while True:
        for worker in workers:
            rss = read_rss(worker.pid)
            if rss is not None:
                peaks[worker] = max(rss, peaks.get(worker, 0))
        now = time.perf_counter()
        if progress is not None and now - last_progress >= progress_every_s:
            last_progress = now
            progress(f"soak: {now - start:.0f} s, {tally.requests} requests, {sum(tally.errors.values())} errors")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), plan.sample_every_s)
            return peaks


async def _soak_phase(
    address: str,
    plan: SoakPlan,
    tally: Tally,
    workers: tuple[WorkerProcess, ...],
    progress: Callable[[str], None] | None,
) -> tuple[float, dict[WorkerProcess, int]]:
    """The timed load, with the RSS peaks tracked beside it. Returns its length in seconds and the peaks."""
    stop = asyncio.Event()
    tracker = asyncio.create_task(_track_peaks(workers, stop, plan, tally, progress))
    start = time.perf_counter()
    try:
        await _load(address, plan, tally, plan.num_warmup, None, start + plan.duration_s)
    finally:
        stop.set()
    return time.perf_counter() - start, await tracker


# -- the soak ------------------------------------------------------------------------------------------------------


def run_soak(
    address: str,
    app_name: str,
    concurrency: int,
    duration_s: float,
    *,
    seed: int = 0,
    cancel_fraction: float = 0.1,
    warmup_requests: int | None = None,
    request_timeout_s: float = 120.0,
    idle_timeout_s: float = 60.0,
    auth_token: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Soak the stack serving `app_name` (public gRPC at `address`) and return the report (JSON-able). This
    process must be connected to the stack's Ray cluster (ray.init), where the workers are found."""
    plan = SoakPlan(
        concurrency,
        duration_s,
        seed,
        cancel_fraction,
        warmup_requests,
        request_timeout_s,
        idle_timeout_s,
        auth_token=auth_token,
    )
    tally = Tally()
    # The warm-up's first-use allocations would otherwise count as growth; its requests count like the others.
    asyncio.run(_load(address, plan, tally, 0, plan.num_warmup, None))
    start, _ = wait_until_idle(app_name, plan.idle_timeout_s)
    elapsed, peaks = asyncio.run(_soak_phase(address, plan, tally, tuple(start), progress))
    end, idle_wait_s = wait_until_idle(app_name, plan.idle_timeout_s)
    return build_report(address, plan, tally, elapsed, start, peaks, end, idle_wait_s)


def build_report(
    address: str,
    plan: SoakPlan,
    tally: Tally,
    elapsed_s: float,
    start: dict[WorkerProcess, WorkerSample],
    peaks: dict[WorkerProcess, int],
    end: dict[WorkerProcess, WorkerSample],
    idle_wait_s: float,
) -> dict[str, Any]:
    errors = tally.errors
    ok = tally.statuses[OK]
    # Sessions are counted on the workers there are now; one that cannot be asked leaves the count unknown.
    unreadable = [w for w, s in end.items() if s.stats is None]
    sessions_left = sum(s.stats.active_sessions for s in end.values() if s.stats is not None)
    failures = verdict(ok, sum(errors.values()), sessions_left, len(unreadable), len(end))
    return {
        "address": address,
        "concurrency": plan.concurrency,
        "duration_s": plan.duration_s,
        "elapsed_s": round(elapsed_s, 3),
        "seed": plan.seed,
        "warmup_requests": plan.num_warmup,
        "requests": {
            "total": tally.requests,
            "ok": ok,
            "cancelled_on_purpose": tally.statuses[CANCELLED_ON_PURPOSE],
            "errors": sum(errors.values()),
        },
        "errors_by_status": errors,
        "tokens": tally.tokens,
        # The timed phase's rate: the warm-up (exactly num_warmup requests) ran before it.
        "requests_per_s": round((tally.requests - plan.num_warmup) / elapsed_s, 3) if elapsed_s else None,
        "mix": dict(sorted(tally.mix.items())),
        "workers": [_worker_report(w, start.get(w), peaks.get(w), end.get(w)) for w in dict.fromkeys([*start, *end])],
        "sessions_left": sessions_left,
        "idle_wait_s": round(idle_wait_s, 3),
        "passed": not failures,
        "failures": failures,
        "memory_note": MEMORY_NOTE,
    }


def verdict(ok: int, errors: int, sessions_left: int, unreadable_workers: int, workers: int) -> list[str]:
    """Why the soak failed; empty when it passed. Memory growth is reported, not judged."""
    failures = []
    if ok == 0:
        failures.append("no request completed")
    if errors:
        failures.append(f"{errors} errors")
    if sessions_left:
        failures.append(f"{sessions_left} sessions left open in the workers")
    if workers == 0:
        failures.append("no worker found")
    if unreadable_workers:
        failures.append(f"GetStats failed on {unreadable_workers} workers: sessions left unknown")
    return failures


def _worker_report(
    worker: WorkerProcess, start: WorkerSample | None, peak: int | None, end: WorkerSample | None
) -> dict[str, Any]:
    rss_start = start.rss_bytes if start else None
    rss_end = end.rss_bytes if end else None
    growth = rss_end - rss_start if rss_start is not None and rss_end is not None else None
    started = _counter_delta(start, end, "sessions_started")
    return {
        "kind": worker.kind,
        "replica_id": worker.replica_id,
        "pid": worker.pid,
        "address": worker.address,
        "present": {"start": start is not None, "end": end is not None},  # false: replaced during the soak
        "rss_start_bytes": rss_start,
        "rss_peak_bytes": peak,
        "rss_end_bytes": rss_end,
        "rss_growth_bytes": growth,
        "rss_growth_pct": round(100.0 * growth / rss_start, 2) if growth is not None and rss_start else None,
        "sessions_started": started,
        "sessions_expired": _counter_delta(start, end, "sessions_expired"),  # freed by the idle reaper, not the router
        "active_sessions_end": end.stats.active_sessions if end and end.stats else None,
    }


def _counter_delta(start: WorkerSample | None, end: WorkerSample | None, field: str) -> int | None:
    if start is None or end is None or start.stats is None or end.stats is None:
        return None
    return getattr(end.stats, field) - getattr(start.stats, field)


def format_summary(report: dict[str, Any]) -> str:
    r = report["requests"]
    errors = ", ".join(f"{code} {n}" for code, n in report["errors_by_status"].items())
    lines = [
        f"soak: {report['concurrency']} streams for {report['elapsed_s']:.0f} s: {r['total']} requests "
        f"({r['ok']} ok, {r['cancelled_on_purpose']} cancelled on purpose, {r['errors']} errors"
        f"{': ' + errors if errors else ''}), {report['tokens']} tokens",
    ]
    for w in report["workers"]:
        lines.append(
            f"  {w['kind']:6} pid {w['pid']} {w['address']}: RSS {_mib(w['rss_start_bytes'])} -> "
            f"{_mib(w['rss_end_bytes'])} (peak {_mib(w['rss_peak_bytes'])}, growth "
            f"{_mib(w['rss_growth_bytes'], signed=True)}), {w['sessions_started']} sessions"
        )
    lines.append(f"sessions left open: {report['sessions_left']} (after {report['idle_wait_s']:.1f} s)")
    lines.append("PASS" if report["passed"] else "FAIL: " + "; ".join(report["failures"]))
    return "\n".join(lines)


def _mib(n: int | None, signed: bool = False) -> str:
    return "?" if n is None else f"{n / 2**20:{'+' if signed else ''}.1f} MiB"


# -- specdec soak --------------------------------------------------------------------------------------------------


def register(sub: Any) -> None:
    soak = sub.add_parser(
        "soak", help="hold N concurrent streams for M minutes; report errors, worker memory and sessions left open"
    )
    soak.add_argument("--concurrency", type=positive(int), default=4, help="streams kept in flight")
    soak.add_argument("--minutes", type=positive(float), default=5.0, help="how long to hold them")
    soak.add_argument("--json", type=Path, default=None, help="where to write the report")
    soak.add_argument(
        "--config", default=None, help="serve this YAML config instead of a tiny random pair built for the run"
    )
    soak.add_argument("--seed", type=int, default=0, help="the requests' variety is drawn from it")
    soak.set_defaults(func=soak_main)


def soak_main(args: argparse.Namespace) -> int:
    from deployments.launch import serving

    with stack_config(args.config) as config, serving(config, quiet=True):
        report = run_soak(
            f"127.0.0.1:{config.grpc_port}",
            config.app_name,
            args.concurrency,
            args.minutes * 60,
            seed=args.seed,
            auth_token=auth_token(),
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    print(format_summary(report))
    if args.json is not None:
        write_report(report, args.json)
    return 0 if report["passed"] else 1


@contextlib.contextmanager
def stack_config(path: str | None) -> Iterator[Any]:
    """The config to serve: `path`, or deployments/configs/tiny.yaml on a tiny pair built in a temporary directory
    (removed afterwards), on free ports so as not to meet another server on this machine."""
    import yaml

    from deployments.serve_config import load_config, parse_config
    from specdec_core.models.tiny import build_tiny_pair

    if path is not None:
        yield load_config(path)
        return
    with tempfile.TemporaryDirectory(prefix="specdec-soak-") as root:
        build_tiny_pair(root)
        data = yaml.safe_load(TINY_CONFIG.read_text())
        data["target"]["model"] = str(Path(root) / "target")
        data["draft"]["model"] = str(Path(root) / "draft")
        data["grpc_port"], data["http_port"] = free_port(), free_port()
        yield parse_config(data)
