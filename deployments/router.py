"""The router: the public GenerationService behind Ray Serve's gRPC proxy, and the draft -> verify rounds.

Each router replica runs the engine (`SpecEngine`) over remote workers: the drafter and the target are gRPC
clients of the worker deployments (`deployments.remote_drafter`, `deployments.remote_target`), or the drafter of a
method without a draft model (n-gram) runs in the router. The engine decides k, keeps the per-request randomness,
stopping and text; the workers keep the caches and the models. The router is handed its engine (`RouterParts`);
the wiring that needs Ray is `router_wiring.connect_router`. `Router` is a plain class: the builder
(`deployments.app`) makes it the Serve deployment of both public APIs.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, NoReturn

from grpc_health.v1 import health_pb2

from deployments import generation_codec, health, swap
from deployments.ab_variants import ABTest
from deployments.auth import BearerAuth, Unauthenticated, cache_namespace
from deployments.discovery import WorkerFollower
from deployments.openai.http import build_http_app
from deployments.openai.tools import ToolCallFormat
from deployments.prometheus import ServingMetrics
from deployments.proposal_log import ProposalLog
from deployments.replica_pool import ReplicaPool
from deployments.scheduler import Admission, Scheduler
from deployments.serve_config import ServeConfig
from deployments.status import WorkerUnavailable, grpc_status_of
from deployments.telemetry import RequestTracer, context_from_metadata
from specdec.v1 import generation_pb2 as pb
from specdec_core.chat import encode_chat, encode_prompt
from specdec_core.engine import SpecEngine
from specdec_core.errors import InvalidArgument, ResourceExhausted
from specdec_core.grammar.constraint import Constraint
from specdec_core.models.loader import LoadedTokenizer
from specdec_core.outputs import RequestOutput
from specdec_core.request import PromptLimits

log = logging.getLogger(__name__)
# Into the replica's log, unlike module loggers (see `deployments.worker_deployments`).
serve_log = logging.getLogger("ray.serve")


class RequestFailed(Exception):
    """Raised out of a handler after the status was set on the gRPC context."""


def _utf8_bytes(*texts: str) -> int:
    """Bytes of `texts` in UTF-8, a lone surrogate (JSON can carry one) counted as its 3 bytes rather than refused."""
    return sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)


@dataclass(frozen=True)
class RouterParts:
    """What a router serves with. The engine is idle (calibrated or not): from here on only the router's engine
    thread (`Scheduler`) runs it."""

    config: ServeConfig
    engine: SpecEngine
    tokenizer: LoadedTokenizer  # the target's: prompts are encoded, and prompt token ids checked, with it
    auth: BearerAuth
    tracer: RequestTracer
    metrics: ServingMetrics
    max_seq_len: int  # what GetModelInfo reports: router.max_seq_len, capped by the target's
    target_pool: ReplicaPool | None = None  # the workers the engine's target and drafter call, when remote
    draft_pools: dict[str, ReplicaPool] = field(default_factory=dict)  # by draft variant, for those that run a model
    proposals: ProposalLog | None = None
    follower: WorkerFollower | None = None  # keeps the pools' replicas current; stopped with the router


class Router:
    """GenerationService: Generate, GenerateStream, GetModelInfo, over the parts that `make_parts` builds.

    `build_app` binds `router_wiring.connect_router` with the config: the wiring that needs Ray (the registry, the
    workers' addresses, calibration over them). A factory rather than the parts themselves: an engine over remote
    workers holds gRPC channels and threads, so it is built in the router's replica, not where the application is
    built. A test hands a factory of parts around an in-process engine, and needs no cluster."""

    def __init__(self, make_parts: Callable[[], RouterParts], *worker_handles: Any) -> None:
        # The worker handles are only bound so that Serve deploys the workers with the router.
        parts = make_parts()
        self.config: ServeConfig = parts.config
        cfg = self.config
        self.tracer = parts.tracer
        self.metrics = parts.metrics
        self.auth = parts.auth
        self.tokenizer = parts.tokenizer
        self.tool_call_format = ToolCallFormat.of(parts.tokenizer.tokenizer)  # the HTTP API's forced tool calls
        self.max_seq_len = parts.max_seq_len
        # Prompt token ids are checked against the tokenizer's vocabulary: ids past it (a model's padding rows) have
        # no text.
        self.prompt_limits = PromptLimits(
            vocab_size=len(parts.tokenizer.tokenizer),
            max_seq_len=parts.max_seq_len,
            max_prompt_tokens=cfg.router.max_prompt_tokens,
            max_output_tokens=cfg.router.max_output_tokens,
            settings="router.",
        )
        self.target_pool = parts.target_pool
        self.draft_pools = parts.draft_pools
        self.proposals = parts.proposals
        self._follower = parts.follower
        admission = Admission(cfg.router.max_queued_requests, cfg.router.queue_timeout_s, cfg.router.request_timeout_s)
        self.scheduler = Scheduler(parts.engine, admission, self._why_waiting)
        self.ab = ABTest(cfg, parts.engine, self.draft_pools)
        self._tag = uuid.uuid4().hex[:8]
        self.started_at = int(time.time())
        log.info(
            "router %s ready: %d target, %d draft replicas",
            self._tag,
            len(self.target_pool.replicas) if self.target_pool else 0,
            sum(len(pool.replicas) for pool in self.draft_pools.values()),
        )

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's config update of the draft variants' models and weights (`deployments.swap`; also right after
        the constructor): what GetModelInfo reports, what new requests are labelled with, and the weights they are
        assigned by (a demoted variant's comes back only this way). The draft workers swap the models themselves;
        a session stays on the replica and the drafter it started with."""
        old = {v.name: (v.model, v.weight) for v in self.config.variants}
        self.config = swap.apply(self.config, user_config)
        label = self.config.draft.label
        self.tracer.set_draft(label)
        self.metrics.set_draft(label)
        if self.proposals is not None:
            self.proposals.set_draft(label)
        self.ab.reconfigure(self.config)
        started, self._configured = getattr(self, "_configured", False), True  # the first call: the start
        for variant in self.config.variants:
            was = old[variant.name]
            if started and was != (variant.model, variant.weight):
                serve_log.info(
                    "router %s: draft variant %s is now %s, weight %g (was %s, weight %g)",
                    self._tag,
                    variant.name,
                    variant.model or variant.method,
                    variant.weight,
                    was[0],
                    was[1],
                )

    def _why_waiting(self) -> Exception:
        """What a request that waited out the queue timeout is told."""
        if not self.serving:
            return WorkerUnavailable("no target worker is available (a replacement may be starting); retry later")
        return ResourceExhausted("kv_cache", "no KV cache slot came free within router.queue_timeout_s; retry later")

    # -- GenerationService -------------------------------------------------------------------------------------

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, grpc_context: Any = None) -> pb.GetModelInfoResponse:
        if grpc_context is not None:
            self._authenticate(grpc_context)
        cfg = self.config
        return pb.GetModelInfoResponse(
            target_model=cfg.target.model,
            draft_model=(cfg.draft.model or "") if cfg.draft.runs_draft_model else "",
            draft_method=cfg.draft.method,
            max_context_length=self.max_seq_len,
            vocab_size=len(self.tokenizer.tokenizer),
            tensor_parallel_size=cfg.target.tensor_parallel_size,
            num_speculative_tokens=str(cfg.draft.num_speculative_tokens) if cfg.draft.drafting is not None else "0",
            max_speculative_tokens=cfg.draft.max_speculative_tokens,
            default_max_tokens=cfg.router.default_max_tokens,
            eos_token_ids=sorted(self.tokenizer.eos_token_ids),
            served_model_name=self.served_model_name,
            speculation_methods=list(self.scheduler.engine.methods),
            draft_variants=[pb.DraftVariantInfo(**info) for info in self.ab.describe()],
        )

    async def Generate(self, request: pb.GenerateRequest, grpc_context: Any) -> pb.GenerateResponse:
        request_id = request.request_id or uuid.uuid4().hex
        call = self._decode(request, grpc_context)
        outputs = [output async for output in self._run(call, request_id, grpc_context)]
        return generation_codec.merge_chunks(request_id, outputs, call.draft_variant)

    async def GenerateStream(
        self, request: pb.GenerateRequest, grpc_context: Any
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        call = self._decode(request, grpc_context)
        async for output in self._run(call, request_id, grpc_context):
            yield generation_codec.encode_chunk(request_id, output, call.draft_variant)

    # -- grpc.health.v1.Health (deployments.health) ------------------------------------------------------------------

    async def Check(self, request: health_pb2.HealthCheckRequest, grpc_context: Any) -> health_pb2.HealthCheckResponse:
        """No token asked: a probe has none to send, and the answer says only whether this router can serve."""
        try:
            return health.check(request.service, self.serving)
        except health.UnknownService as exc:
            self._fail(grpc_context, exc)

    @property
    def serving(self) -> bool:
        """Whether a request could start now: a target worker to run on (an in-process engine always has one)."""
        return self.target_pool is None or self.target_pool.has_usable

    # -- one request ---------------------------------------------------------------------------------------------

    def _decode(self, request: pb.GenerateRequest, grpc_context: Any) -> generation_codec.GenerateCall:
        """A gRPC request decoded, its draft variant assigned: on a refusal, set the gRPC status and raise."""
        try:
            self.authenticate(grpc_context.invocation_metadata() or ())
            return self.with_variant(generation_codec.decode_generate(request, self.config.router.default_max_tokens))
        except Exception as exc:
            self.refused(exc)
            self._fail(grpc_context, exc)

    async def _run(
        self, call: generation_codec.GenerateCall, request_id: str, grpc_context: Any
    ) -> AsyncIterator[RequestOutput]:
        """`generate` for a gRPC request: on a refusal or failure, set the gRPC status and raise."""
        try:
            async for output in self.generate(call, request_id, grpc_context.invocation_metadata() or ()):
                yield output
        except Exception as exc:
            self._fail(grpc_context, exc)

    def with_variant(self, call: generation_codec.GenerateCall) -> generation_codec.GenerateCall:
        """`call` with the draft variant it runs with: the one it names (checked), else one drawn by weight. An API
        assigns it before `generate`, so that it can name the variant in its response; assigning again keeps it."""
        return replace(call, draft_variant=self.ab.assign(call.draft_variant))

    async def generate(
        self, call: generation_codec.GenerateCall, request_id: str, metadata: Sequence[tuple[str, str]]
    ) -> AsyncIterator[RequestOutput]:
        """One request through the engine, whichever API it came by (gRPC, HTTP): its outputs as rounds commit
        them; a refusal or failure raises its error. `metadata`: the call's metadata or headers (a client's
        traceparent). Cancelled (the client went away) -> the engine aborts it, which frees its caches. Every
        request is counted once in `specdec_requests`: by its final output, or by the error that ended it."""
        try:
            variant = self.ab.assign(call.draft_variant)
            prompt_ids = await self._admissible_prompt(call)
            request = call.request
        except (Exception, asyncio.CancelledError) as exc:  # cancelled: the client went away while it was tokenized
            self.refused(exc)
            raise
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        seq_id = f"{self._tag}-{uuid.uuid4().hex[:16]}"  # unique across routers: workers key caches by it
        parent, _ = context_from_metadata(metadata)  # a client's traceparent
        self.tracer.start_request(seq_id, request.params, parent, request_id, variant)
        times = [time.monotonic(), None]  # start, first token
        ran = False  # an output came: the engine took the request (an error after that is no refusal)

        def deliver(item: Any) -> None:  # on the engine thread
            nonlocal ran
            if isinstance(item, Exception):
                self.tracer.abandon(seq_id, item)
                self.metrics.ended_with(item, ran)
            else:
                ran = True
                self.tracer.observe(seq_id, item)
                self._measure(item, times, variant)
                if self.proposals is not None:
                    self.proposals.observe(seq_id, item)
            loop.call_soon_threadsafe(inbox.put_nowait, item)

        finished = False
        try:
            # Sampled only now, past every refusal but the engine's; forgotten below however it ends (refused by
            # admission, past its deadline, cancelled): the log keeps nothing of a request that has ended.
            # Only requests whose records carry probabilities make the workers compute them.
            return_probs = self.proposals is not None and self.proposals.start(seq_id, request_id, prompt_ids, variant)
            self.ab.start(seq_id, variant)
            salt = cache_namespace(self.auth.check(metadata), request.cache_salt)  # authenticated already
            request = replace(request, seq_id=seq_id, prompt_ids=prompt_ids, return_probs=return_probs, cache_salt=salt)
            self.scheduler.submit(request, deliver)
            while not finished:
                item = await inbox.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                if item.error is not None:
                    finished = True
                    raise item.error
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.scheduler.cancel(seq_id)
            self.scheduler.call_soon(partial(self.ab.end, seq_id))  # after the cancel: its drafter is freed first
            if self.proposals is not None:
                self.proposals.discard(seq_id)

    async def _admissible_prompt(self, call: generation_codec.GenerateCall) -> tuple[int, ...]:
        """The prompt's token ids, once every check the router makes before the engine has passed. Cheap ones come
        first: a prompt's size is checked before it is tokenized (tokenizing costs CPU in proportion to the text), its
        length in tokens after."""
        self._check_size(call.prompt)
        self._check_constraint_size(call.request.params.constraint)
        if self.scheduler.num_active >= self.config.router.max_ongoing_requests:
            raise ResourceExhausted("requests", "the router is at max_ongoing_requests; retry later")
        # Tokenizing still takes a while: off the event loop, which serves every other request.
        prompt_ids = await asyncio.to_thread(self._prompt_ids, call.prompt)
        params = call.request.params
        prompt = self.prompt_limits.check(prompt_ids, params.max_tokens)
        if params.constraint is not None:
            # Off the engine thread: the first constrained request builds the tokenizer's tables (slow for a large
            # vocabulary) and every new schema must compile, which every round would otherwise wait for.
            # The engine then finds it compiled; one that does not compile is refused here.
            await asyncio.to_thread(self._compile_unless_queue_full, params.constraint)
        return prompt

    def _compile_unless_queue_full(self, constraint: Constraint) -> None:
        """Compile `constraint` (for the engine), unless the queue is full: refused as the scheduler would refuse it
        (`Scheduler.queue_full`, asked again as the request joins), before paying for a compile that may take
        long. In a worker thread: a remote target's free slots may take a call to read."""
        refusal = self.scheduler.queue_full()
        if refusal is not None:
            raise refusal
        self.scheduler.engine.compile(constraint)

    def _check_constraint_size(self, constraint: Constraint | None) -> None:
        """Refuse a constraint longer than router.max_schema_bytes before it is compiled, naming it by its kind
        (the request's field: `structured.json_schema`, `response_format.json_schema.schema`, `tools`, ...)."""
        limit = self.config.router.max_schema_bytes
        if constraint is not None and (size := _utf8_bytes(constraint.value)) > limit:
            raise InvalidArgument(
                constraint.kind, f"{size} bytes; this server takes at most {limit} (router.max_schema_bytes)"
            )

    def _measure(self, output: RequestOutput, times: list, variant: str) -> None:
        if times[1] is None and output.new_token_ids:
            times[1] = time.monotonic()
        if output.round is not None:
            info = output.round
            self.metrics.round(
                info.k,
                len(info.proposed_token_ids),
                info.num_accepted,
                info.method,
                variant,
                predrafted=info.predrafted,
                branched=info.branched,
                split=info.split,
            )
            self.ab.observe(variant, info, len(output.new_token_ids))
        if output.finished:
            self.metrics.finished(output, times[0], times[1], variant)
        for pool in (self.target_pool, *self.draft_pools.values()):
            if pool is not None:
                self.metrics.slots_in_use(pool.kind, sum(len(r.sessions) for r in pool.replicas))

    def _prompt_ids(self, prompt: generation_codec.Prompt) -> list[int]:
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        if prompt.messages is not None:
            return encode_chat(self.tokenizer.tokenizer, prompt.messages, prompt.tools)
        return encode_prompt(self.tokenizer.tokenizer, prompt.text, raw=prompt.raw)

    def _check_size(self, prompt: generation_codec.Prompt) -> None:
        """Refuse a prompt too long before any work on it: token ids by their count, text by its UTF-8 bytes (a chat
        request's: every string its template renders, the tools' definitions included)."""
        if prompt.token_ids is not None:
            self.prompt_limits.check_length(len(prompt.token_ids))
            return
        limit = self.config.router.max_prompt_bytes
        if prompt.messages is None:
            field, size = "prompt", _utf8_bytes(prompt.text or "")
        else:
            size = sum(
                _utf8_bytes(
                    m.role,
                    m.content,
                    m.tool_call_id or "",
                    *(s for c in m.tool_calls for s in (c.id, c.name, c.arguments)),
                )
                for m in prompt.messages
            )
            field = "messages"
            if size <= limit and prompt.tools:  # the tools' definitions take their share of the prompt
                field = "tools"
                size += sum(_utf8_bytes(t.name, t.description or "", t.parameters or "") for t in prompt.tools)
        if size > limit:
            raise InvalidArgument(
                field, f"{size} bytes of text; this server takes at most {limit} (router.max_prompt_bytes)"
            )

    def _authenticate(self, grpc_context: Any) -> None:
        try:
            self.authenticate(grpc_context.invocation_metadata() or ())
        except Unauthenticated as exc:
            self._fail(grpc_context, exc)

    # -- the OpenAI-compatible HTTP API (deployments.openai) -----------------------------------------------------

    def authenticate(self, metadata: Sequence[tuple[str, str]]) -> None:
        """Raise `Unauthenticated` unless `metadata` (gRPC metadata or HTTP headers, lower-case names) carries
        the server's bearer token, when it has one."""
        self.auth.check(metadata)

    def refused(self, error: BaseException) -> None:
        """Count a generation request refused before the engine took it (`specdec_requests`, finish_reason
        "refused", `code` the status it got). `generate` counts its own; an API counts those it refuses first
        (authentication, a body it cannot read)."""
        self.metrics.ended_with(error, ran=False)

    @property
    def served_model_name(self) -> str:
        return self.config.served_name

    @property
    def max_model_len(self) -> int:
        return self.max_seq_len

    @property
    def default_max_tokens(self) -> int:
        return self.config.router.default_max_tokens

    def __serve_build_asgi_app__(self) -> Any:
        """Serve's HTTP proxy hands this replica's HTTP requests to the app built here, after the constructor."""
        return build_http_app(self)

    @staticmethod
    def _fail(grpc_context: Any, error: BaseException) -> NoReturn:
        code, details = grpc_status_of(error)
        grpc_context.set_code(code)
        grpc_context.set_details(details)
        raise RequestFailed(details)

    def close(self) -> None:
        """Stop following the workers and the engine thread (which ends the requests it holds); close the log."""
        follower = getattr(self, "_follower", None)
        if follower is not None:
            follower.stop()
        ab = getattr(self, "ab", None)
        if ab is not None:
            ab.close()
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.close()
        proposals = getattr(self, "proposals", None)
        if proposals is not None:
            proposals.close()

    def __del__(self) -> None:
        self.close()
