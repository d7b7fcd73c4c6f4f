"""The draft and target workers' gRPC services (specdec.v1.DraftService / TargetService).

A worker owns one model and the per-session state on it (KV caches). It serves batched calls from routers:
one Propose or Verify per round for all of a router's sessions on this worker. Model calls are serialised by
one lock: a worker runs one forward at a time, batching is the router's job.

These servicers are plain gRPC: the Serve deployments in `deployments.worker_deployments` host them, and tests run them
alone. A failed call releases the sessions it touched, so an error never leaks a cache; sessions that stop
being used (a router that died) are released after `idle_timeout_s`. With prefix caching on the worker's runner, a
released session's cache stays as a prefix-cache entry, in the same slots (`specdec_core.prefix_cache`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.trace import SpanKind

from deployments import worker_codec
from deployments.auth import InternalAuthInterceptor, InternalCredentials
from deployments.compute_thread import ComputeThread
from deployments.scheduler import DeadlineExceeded
from deployments.status import UnknownSession, WorkerDraining, grpc_status_of
from deployments.telemetry import context_from_metadata, tracer
from deployments.tls import server_credentials
from specdec.v1 import worker_pb2 as wpb
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.decode_run import Step, StepwiseRun
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.errors import InvalidArgument, ResourceExhausted
from specdec_core.grammar.compiler import CompiledGrammar, GrammarCompiler, NoGrammars
from specdec_core.grammar.state import GrammarState
from specdec_core.runner import ModelRunner
from specdec_core.target import LocalTarget

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


# Errors after which the sessions a call touched are released. The others (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
# NOT_FOUND) refuse a call before it changes anything.
_CACHES_IN_DOUBT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)


def rpc(method: Callable | None = None, *, prepare: Callable | None = None) -> Callable:
    """Serve a method in a span joined to the caller's trace (W3C traceparent in the call's metadata). `prepare`:
    `prepare(self, request)` runs first, outside the worker's lock, and the method gets its result as a second
    argument: for work that touches no session and may take long (compiling a grammar), which under the lock would
    hold up every other call on the worker."""
    if method is None:
        return functools.partial(rpc, prepare=prepare)

    @functools.wraps(method)
    def wrapper(self: _SessionWorker, request: Any, context: grpc.ServicerContext) -> Any:
        parent, links = context_from_metadata(context.invocation_metadata() or ())
        attributes = {
            "specdec.worker": self.kind,
            "specdec.model": self.model_name,
            "specdec.batch_size": len(getattr(request, "items", ())),
        }
        with tracer().start_as_current_span(
            f"specdec.{self.kind}.{method.__name__}",
            context=parent,
            links=links,
            kind=SpanKind.SERVER,
            attributes=attributes,
        ):
            return _call(self, method, request, context, prepare)

    return wrapper


def _call(
    self: _SessionWorker,
    method: Callable,
    request: Any,
    context: grpc.ServicerContext,
    prepare: Callable | None = None,
) -> Any:
    """The call under the worker's lock, with its counters; an error aborts it with its status. A call whose
    caller gave up (its deadline passed while it waited for the lock, or while it ran) keeps nothing: the caller
    counts its sessions as failed, so what the call started or advanced is released here."""
    try:
        prepared = () if prepare is None else (prepare(self, request),)  # `rpc`: before the lock
        return self.compute.run(_locked_call, self, method, request, context, prepared)
    except Exception as exc:
        code, details = grpc_status_of(exc)
        if code == grpc.StatusCode.INTERNAL:  # a bug or a device error
            log.exception("%s failed", method.__name__)
            details = f"{method.__name__} failed: {details}"
        if code in _CACHES_IN_DOUBT:  # never leave a half-updated cache behind
            self._release_after_error(request)
        context.abort(code, details)


def _locked_call(
    self: _SessionWorker, method: Callable, request: Any, context: grpc.ServicerContext, prepared: tuple
) -> Any:
    """`_call`'s work, on the worker's compute thread and under its lock."""
    with self._lock:
        if not context.is_active():
            raise DeadlineExceeded(f"{method.__name__}: the caller gave up waiting")
        start = time.perf_counter()
        response = method(self, request, *prepared)
        self.calls += 1
        self.busy_seconds += time.perf_counter() - start
        self.bytes_received += request.ByteSize()
        self.bytes_sent += response.ByteSize()
        if not context.is_active():
            log.warning("%s ran past its caller's deadline; its sessions are released", method.__name__)
            self._release_after_error(request)
        return response


class _SessionWorker:
    """Session bookkeeping shared by both workers: last use, idle expiry, stats."""

    def __init__(self, model_name: str, idle_timeout_s: float, compute: ComputeThread | None = None) -> None:
        self.model_name = model_name
        self.compute = compute or ComputeThread(f"{self.kind}-compute")  # every model call runs on it
        self.idle_timeout_s = idle_timeout_s
        self.calls = 0
        self.busy_seconds = 0.0
        self.bytes_received = 0
        self.bytes_sent = 0
        self.sessions_started = 0
        self.sessions_expired = 0
        self._lock = threading.RLock()
        self._last_used: dict[str, float] = {}
        self._draining = threading.Event()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="session-reaper", daemon=True)
        self._reaper.start()

    # Subclasses free a session's state here.
    def _free(self, seq_id: str) -> None:
        raise NotImplementedError

    def _touch(self, seq_ids: Iterable[str]) -> None:
        now = time.monotonic()
        for sid in seq_ids:
            if sid not in self._last_used:
                raise UnknownSession(f"seq_id: no active session {sid!r} on this worker")
            self._last_used[sid] = now

    def _started(self, seq_ids: Iterable[str]) -> None:
        now = time.monotonic()
        for sid in seq_ids:
            self._last_used[sid] = now
            self.sessions_started += 1

    def release(self, seq_ids: Iterable[str]) -> int:
        released = 0
        with self._lock:
            for sid in seq_ids:
                if self._last_used.pop(sid, None) is not None:
                    self._free(sid)
                    released += 1
        return released

    def Release(self, request: wpb.ReleaseRequest, context: grpc.ServicerContext) -> wpb.ReleaseResponse:
        return wpb.ReleaseResponse(released=self.release(request.seq_ids))

    def _release_after_error(self, request: Any) -> None:
        items = getattr(request, "items", [])
        self.release([item.seq_id for item in items])

    def _reap(self) -> None:
        while not self._stop.wait(min(5.0, self.idle_timeout_s / 2)):
            cutoff = time.monotonic() - self.idle_timeout_s
            with self._lock:
                idle = [sid for sid, t in self._last_used.items() if t < cutoff]
            if idle:
                self.sessions_expired += self.release(idle)
                log.warning("released %d sessions idle for more than %.0f s", len(idle), self.idle_timeout_s)

    def close(self) -> None:
        self._stop.set()

    # -- draining: the replica is being stopped (scaled down, redeployed) -------------------------------------------

    def start_draining(self) -> None:
        """Refuse new sessions from now on (`WorkerDraining`: the router starts them on another replica); the
        sessions held go on as before."""
        self._draining.set()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def _refuse_if_draining(self) -> None:
        if self._draining.is_set():
            raise WorkerDraining(f"this {self.kind} worker is being stopped and takes no new session")

    def drain(self, timeout_s: float, poll_s: float = 0.1) -> bool:
        """Wait until no session is held (True), or `timeout_s` passed (False). Sessions end as their requests
        do (the router releases them) or, those of a router gone, at the idle timeout."""
        deadline = time.monotonic() + timeout_s
        while self.active_sessions and time.monotonic() < deadline:
            time.sleep(poll_s)
        return not self.active_sessions

    @property
    def active_sessions(self) -> int:
        return len(self._last_used)

    @property
    def num_slots(self) -> int:
        """Sessions the worker can hold at once (its KV cache's slots)."""
        return self.runner.cache.num_slots

    # Subclasses: what GetStats reports (and the worker exports as metrics, `deployments.worker_deployments`).
    def stats(self) -> wpb.WorkerStats:
        raise NotImplementedError

    # Subclasses: the runner whose cache holds the sessions (rank 0's, with tensor parallelism).
    @property
    def runner(self) -> ModelRunner:
        raise NotImplementedError

    def _stats(self, free_slots: int, num_slots: int, vocab_size: int, max_seq_len: int) -> wpb.WorkerStats:
        prefix = self.runner.prefix_cache_stats()
        return wpb.WorkerStats(
            model=self.model_name,
            active_sessions=self.active_sessions,
            free_slots=free_slots,
            num_slots=num_slots,
            vocab_size=vocab_size,
            max_seq_len=max_seq_len,
            calls=self.calls,
            sessions_started=self.sessions_started,
            sessions_expired=self.sessions_expired,
            busy_seconds=self.busy_seconds,
            bytes_received=self.bytes_received,
            bytes_sent=self.bytes_sent,
            computed_tokens=self.runner.computed_tokens,
            prefix_cache_queried_tokens=prefix.queried_tokens,
            prefix_cache_hit_tokens=prefix.hit_tokens,
            prefix_cache_evictions=prefix.evictions,
            prefix_cache_entries=prefix.entries,
            prefix_cache_positions=prefix.positions,
            prefix_cache_bytes=prefix.bytes,
        )


class TargetServicer(_SessionWorker, wpb_grpc.TargetServiceServicer):
    kind = "target"

    def __init__(
        self,
        target: LocalTarget,
        model_name: str,
        idle_timeout_s: float = 300.0,
        compute: ComputeThread | None = None,
    ) -> None:
        """`compute`: the thread the target was loaded on (`ComputeThread`); None: a new one."""
        super().__init__(model_name, idle_timeout_s, compute)
        self.target = target
        self._runs: dict[str, StepwiseRun] = {}  # runs under way, by run_id (`StopDecode`)

    def _free(self, seq_id: str) -> None:
        self.target.release(seq_id)

    @property
    def runner(self) -> ModelRunner:
        return self.target.runner

    @rpc
    def Prefill(self, request: wpb.PrefillRequest) -> wpb.PrefillResponse:
        """Start the items that find a free slot, the first ones first; the others hold nothing and are left out
        of the response (several routers share the slots: one may find them taken since it last looked)."""
        self._refuse_if_draining()
        items = worker_codec.decode_prefill(request, self.target.vocab_size)[: self.target.free_slots]
        for item in items:
            if not item.prompt_ids or max(item.prompt_ids) >= self.target.vocab_size:
                raise InvalidArgument("prompt_token_ids", "empty, or a token id outside the vocabulary")
            if len(item.prompt_ids) >= self.target.max_seq_len:
                raise ResourceExhausted("prompt_token_ids", f"{len(item.prompt_ids)} tokens do not fit the context")
        results = self.target.prefill(items) if items else []
        self._started(item.seq_id for item in items)
        response = worker_codec.encode_prefilled(results)
        response.free_slots = self.target.free_slots
        return response

    @rpc
    def Verify(self, request: wpb.VerifyRequest) -> wpb.VerifyResponse:
        self._touch(item.seq_id for item in request.items)
        items = worker_codec.decode_verify(request, self.target.vocab_size)
        response = worker_codec.encode_outcomes(self.target.verify(items))
        response.free_slots = self.target.free_slots
        return response

    def Decode(self, request: wpb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[wpb.DecodeStep]:
        """A run of plain steps (`specdec_core.decode_run`), each under the lock (other callers' calls go between
        them), streamed as taken. Like a unary call, a run whose caller went away keeps nothing: the caller counts
        its sessions failed, so they are released here; and a failed step releases them too."""
        parent, links = context_from_metadata(context.invocation_metadata() or ())
        attributes = {
            "specdec.worker": self.kind,
            "specdec.model": self.model_name,
            "specdec.batch_size": len(request.items),
        }
        with tracer().start_as_current_span(
            "specdec.target.Decode", context=parent, links=links, kind=SpanKind.SERVER, attributes=attributes
        ) as span:
            steps = 0
            try:
                run = self._start_run(request)
                while (step := self._run_step(run, context)) is not None:
                    steps += 1
                    message = worker_codec.encode_step(step, self.target.free_slots)
                    self.bytes_sent += message.ByteSize()
                    yield message
            except GeneratorExit:  # the caller went away between steps
                self._release_after_error(request)
                raise
            except Exception as exc:
                code, details = grpc_status_of(exc)
                if code == grpc.StatusCode.INTERNAL:
                    log.exception("Decode failed")
                    details = f"Decode failed: {details}"
                if code in _CACHES_IN_DOUBT:
                    self._release_after_error(request)
                context.abort(code, details)
            finally:
                self._runs.pop(request.run_id, None)
                span.set_attribute("specdec.steps", steps)

    def _start_run(self, request: wpb.DecodeRequest) -> StepwiseRun:
        items = worker_codec.decode_decode(request, self.target.vocab_size)
        with self._lock:
            self._touch(item.seq_id for item in items)
        self.bytes_received += request.ByteSize()
        run = self._runs[request.run_id] = StepwiseRun(self.target.verify, items, lambda sid: sid in self._last_used)
        return run

    def _run_step(self, run: StepwiseRun, context: grpc.ServicerContext) -> Step | None:
        return self.compute.run(self._locked_step, run, context)

    def _locked_step(self, run: StepwiseRun, context: grpc.ServicerContext) -> Step | None:
        with self._lock:
            if not context.is_active():
                self.release(item.seq_id for item in run.items)
                return None
            start = time.perf_counter()
            step = run.step()
            if step is not None:
                self.calls += 1
                self.busy_seconds += time.perf_counter() - start
                now = time.monotonic()
                for item, token in zip(run.items, step):
                    if token is not None and item.seq_id in self._last_used:
                        self._last_used[item.seq_id] = now
            return step

    def StopDecode(self, request: wpb.StopDecodeRequest, context: grpc.ServicerContext) -> wpb.StopDecodeResponse:
        """Not under the lock: the run under way holds it for its step."""
        run = self._runs.get(request.run_id)
        if run is not None:
            run.stop()
        return wpb.StopDecodeResponse(stopped=run is not None)

    def stats(self) -> wpb.WorkerStats:
        return self._stats(
            self.target.free_slots, self.runner.cache.num_slots, self.target.vocab_size, self.target.max_seq_len
        )

    def GetStats(self, request: wpb.GetStatsRequest, context: grpc.ServicerContext) -> wpb.WorkerStats:
        if not getattr(self.target, "healthy", True):
            # A tensor-parallel rank failed, and Serve replaces this replica: a router that probes it must not take
            # it back (`replica_pool.ReplicaPool.update`), or new sessions would start here only to fail.
            context.abort(grpc.StatusCode.UNAVAILABLE, "a tensor-parallel rank failed; the replica is being replaced")
        return self.stats()


class DraftServicer(_SessionWorker, wpb_grpc.DraftServiceServicer):
    """A draft model's sessions: the committed tokens it has been told about, its cache, and a constrained session's
    grammar, which masks its drafts (`grammars` compiles them, for the target's tokenizer and vocabulary: without
    one, or with `NoGrammars` for a target whose tokenizer the grammar engine cannot read, a constrained session is
    refused). Grammars compile before the worker's lock is taken (`_compile_brought`)."""

    kind = "draft"

    def __init__(
        self,
        drafter: DraftModelDrafter,
        model_name: str,
        idle_timeout_s: float = 300.0,
        grammars: GrammarCompiler | NoGrammars | None = None,
        compute: ComputeThread | None = None,
    ) -> None:
        """`compute`: the thread the draft was loaded on (`ComputeThread`); None: a new one."""
        super().__init__(model_name, idle_timeout_s, compute)
        self.drafter = drafter  # new sessions start on it
        self.grammars = grammars
        self._tokens: dict[str, list[int]] = {}
        self._grammar_states: dict[str, GrammarState] = {}
        # Each session drafts to its end with the drafter it started on (a swap must not change a session's q
        # mid-way: its cache and its proposals are that model's). Swapped-out drafters stay until their last
        # session is released or expires.
        self._drafter_of: dict[str, DraftModelDrafter] = {}
        self._retired: dict[int, tuple[DraftModelDrafter, str]] = {}  # id(drafter) -> (drafter, model name)

    def _free(self, seq_id: str) -> None:
        self._tokens.pop(seq_id, None)
        self._grammar_states.pop(seq_id, None)
        drafter = self._drafter_of.pop(seq_id, self.drafter)
        drafter.release(seq_id)
        if id(drafter) in self._retired and not drafter.active_sequences:
            _, name = self._retired.pop(id(drafter))
            log.info("freed the swapped-out draft %s: its last session ended", name)

    def swap(self, drafter: DraftModelDrafter, model_name: str) -> None:
        """Start new sessions on `drafter` (`model_name`) from now on; the sessions held go on with the drafter
        they started on, which is freed after the last of them (`_free`)."""
        with self._lock:
            old, old_name = self.drafter, self.model_name
            if old.active_sequences:
                self._retired[id(old)] = (old, old_name)
            self.drafter, self.model_name = drafter, model_name

    @property
    def retired_models(self) -> list[str]:
        """Swapped-out models that still hold sessions."""
        with self._lock:
            return [name for _, name in self._retired.values()]

    @property
    def runner(self) -> ModelRunner:
        return self.drafter.runner

    @rpc
    def Start(self, request: wpb.StartRequest) -> wpb.StartResponse:
        self._refuse_if_draining()
        runner = self.runner
        items = worker_codec.decode_start(request)
        # A session started again: its router lost track of it (a Start or Propose that ran past its timeout), and
        # what is held here for it is stale.
        self.release([item.seq_id for item in items if item.seq_id in self._tokens])
        free = self.drafter.free_slots  # a pre-draft's branches give their slots up to a start
        if len(items) > free:
            raise ResourceExhausted("sessions", f"{len(items)} new sessions, {free} free")
        for item in items:
            if not item.token_ids or len(item.token_ids) >= runner.max_seq_len:
                raise InvalidArgument("prompt_token_ids", "empty, or longer than the draft's context")
        cached = []
        for item in items:
            cached.append(self.drafter.start(item.seq_id, item.token_ids, item.cache_salt))
            self._drafter_of[item.seq_id] = self.drafter
            self._tokens[item.seq_id] = item.token_ids
            self._started([item.seq_id])
        return wpb.StartResponse(cached_tokens=cached)

    def _compile_brought(self, request: wpb.ProposeRequest) -> dict[str, tuple[CompiledGrammar, int]]:
        """The grammars the items bring, compiled, and where each one's output starts, by seq_id. Run before the
        worker's lock (`rpc`): a compile reads no session and a large schema's takes long, and a router whose
        Propose waits past its draft timeout counts this replica failed."""
        compiled = {}
        for item in request.items:
            brought = worker_codec.decode_grammar(item)
            if brought is not None:
                if self.grammars is None:
                    raise InvalidArgument("items.grammar", "this draft worker cannot compile grammars")
                constraint, start = brought
                compiled[item.seq_id] = (self.grammars.compile(constraint), start)
        return compiled

    @rpc(prepare=_compile_brought)
    def Propose(
        self, request: wpb.ProposeRequest, brought: dict[str, tuple[CompiledGrammar, int]]
    ) -> wpb.ProposeResponse:
        self._touch(item.seq_id for item in request.items)
        requests = []
        for item in request.items:
            tokens = self._tokens[item.seq_id]
            tokens.extend(item.new_token_ids)
            if len(tokens) != item.num_committed:
                raise InvalidArgument(
                    "num_committed",
                    f"session {item.seq_id!r} has {len(tokens)} tokens, router says {item.num_committed}",
                )
            self._drafter_of[item.seq_id].observe(item.seq_id, len(tokens))
            grammar = self._grammar(item, tokens, brought.get(item.seq_id))
            requests.append(worker_codec.decode_propose_item(item, tokens, grammar))
        proposals = self._propose(request.items, requests)
        return wpb.ProposeResponse(proposals=[worker_codec.encode_proposal(p) for p in proposals])

    def _propose(self, items: Any, requests: list[Any]) -> list[Any]:
        """Each drafter proposes for its own sessions (one batch each: more than one only during a swap), in the
        order of `requests`."""
        groups: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            groups.setdefault(id(self._drafter_of[item.seq_id]), []).append(i)
        proposals: list[Any] = [None] * len(requests)
        for indices in groups.values():
            drafter = self._drafter_of[items[indices[0]].seq_id]
            for i, proposal in zip(indices, drafter.propose([requests[i] for i in indices])):
                proposals[i] = proposal
        return proposals

    def _grammar(
        self, item: wpb.ProposeRequest.Item, tokens: list[int], brought: tuple[CompiledGrammar, int] | None
    ) -> GrammarState | None:
        """The session's grammar after its committed tokens: the one the item brings (`brought`: compiled, and where
        its output starts), moved along the output so far, or the one it holds, moved along the item's new tokens.
        Committed tokens the grammar refuses mean the router and this worker disagree: refused (the router then
        drops the session here)."""
        if brought is not None:
            compiled, start = brought
            if start > len(tokens):
                raise InvalidArgument(
                    "items.grammar.output_start", f"{start} is past the {len(tokens)} committed tokens"
                )
            state, new = GrammarState(compiled), tokens[start:]
            self._grammar_states[item.seq_id] = state
        else:
            state, new = self._grammar_states.get(item.seq_id), list(item.new_token_ids)
        if state is not None and state.advance(new) != len(new):
            raise InvalidArgument(
                "items.new_token_ids", f"session {item.seq_id!r}: committed tokens its grammar refuses"
            )
        return state

    def stats(self) -> wpb.WorkerStats:
        runner = self.drafter.runner
        return self._stats(
            self.drafter.free_slots, runner.cache.num_slots, self.drafter.target_vocab_size, runner.max_seq_len
        )

    def GetStats(self, request: wpb.GetStatsRequest, context: grpc.ServicerContext) -> wpb.WorkerStats:
        return self.stats()


def start_server(
    servicer: Any,
    host: str = "0.0.0.0",
    port: int = 0,
    max_workers: int = 8,
    credentials: InternalCredentials | None = None,
) -> tuple[grpc.Server, int]:
    """Serve `servicer` (either worker) on host:port (0: any free port); returns the server and its port.
    With `credentials`, only callers presenting the secret are served (`deployments.auth`), and with their TLS
    material only over mutual TLS: the port then speaks nothing else, so a plaintext caller or one without a
    certificate from the application's CA fails its handshake before any method runs. None: plaintext, open."""
    interceptors = [InternalAuthInterceptor(credentials.secret)] if credentials is not None else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers), options=GRPC_OPTIONS, interceptors=interceptors
    )
    if isinstance(servicer, TargetServicer):
        wpb_grpc.add_TargetServiceServicer_to_server(servicer, server)
    else:
        wpb_grpc.add_DraftServiceServicer_to_server(servicer, server)
    if credentials is not None and credentials.tls is not None:
        bound = server.add_secure_port(f"{host}:{port}", server_credentials(credentials.tls))
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind a gRPC server on {host}:{port}")
    server.start()
    return server, bound
