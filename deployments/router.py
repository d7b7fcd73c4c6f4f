"""The router: the public GenerationService behind Ray Serve's gRPC proxy, and the draft -> verify rounds.

Each router replica runs the engine (`SpecEngine`) over remote workers: the drafter and the target are gRPC
clients of the worker deployments (`deployments.remote`), or an in-router n-gram drafter. The engine decides k,
keeps the per-request randomness, stopping and text; the workers keep the caches and the models.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from typing import Any, AsyncIterator

import ray
from ray import serve

from deployments import codec, registry
from deployments.auth import BearerAuth, Unauthenticated, load_public_token
from deployments.config import ServeConfig, parse_config
from deployments.metrics import ServingMetrics
from deployments.proposals import ProposalLog
from deployments.remote import RemoteDrafter, RemoteTarget, ReplicaPool, WorkerUnavailable
from deployments.scheduler import Admission, Scheduler
from deployments.status import grpc_status_of
from deployments.telemetry import RequestTracer, context_from_metadata, setup_tracing
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.calibration import calibrate
from specdec_core.drafters.ngram import NgramDrafter
from specdec_core.engine import EngineConfig, RequestOutput, SpecEngine
from specdec_core.errors import InvalidArgument, ResourceExhausted
from specdec_core.models.loader import encode_prompt, load_tokenizer

log = logging.getLogger(__name__)


class RequestFailed(Exception):
    """Raised out of a handler after the status was set on the gRPC context."""


def wait_for_workers(app: str, kind: str, expected: int, timeout_s: float) -> list[str]:
    """Addresses of `kind` workers once `expected` replicas registered (fewer, at least one, at the timeout)."""
    reg = registry.registry()
    deadline = time.monotonic() + timeout_s
    while True:
        addresses = ray.get(reg.addresses.remote(app, kind))
        if len(addresses) >= expected or (addresses and time.monotonic() > deadline):
            return addresses
        if time.monotonic() > deadline:
            raise WorkerUnavailable(f"no {kind} worker registered within {timeout_s:.0f} s")
        time.sleep(0.5)


def _calibrate(engine: SpecEngine) -> None:
    """Round costs measured before the first request (the engine thread has not started yet). A failure costs
    only the head start: `auto` then explores on live rounds."""
    try:
        done = calibrate(engine)
    except Exception as exc:
        log.warning("calibration failed, `auto` will measure costs on live rounds: %s", exc, exc_info=True)
        return
    log.info("calibrated round costs at batch sizes %s: %d rounds in %.1f s", list(done.batch_sizes), done.rounds,
             done.seconds)


class Router:
    """GenerationService: Generate, GenerateStream, GetModelInfo."""

    def __init__(self, config: dict[str, Any], *worker_handles: Any) -> None:
        # The worker handles are only bound so that Serve deploys the workers with the router.
        self.config: ServeConfig = parse_config(config)
        cfg = self.config
        setup_tracing(cfg.app_name)
        draft_name = cfg.draft.model if cfg.draft.method == "draft_model" else cfg.draft.method
        self.tracer = RequestTracer(cfg.target.model, draft_name or "none")
        self.metrics = ServingMetrics(cfg.target.model, draft_name or "none")
        self.auth = BearerAuth(load_public_token(cfg.auth_token_file))
        self.tokenizer = load_tokenizer(cfg.target.model)
        timeout = cfg.router.rpc_timeout_s
        secret = ray.get(registry.registry().secret.remote(cfg.app_name))  # the workers serve only its holders
        target_addresses = wait_for_workers(cfg.app_name, "target", cfg.target.num_replicas, cfg.router.worker_start_timeout_s)
        self.target_pool = ReplicaPool("target", target_addresses, wpb_grpc.TargetServiceStub, timeout, secret)
        drafter = None
        self.draft_pool = None
        if cfg.draft.method == "draft_model":
            addresses = wait_for_workers(cfg.app_name, "draft", cfg.draft.num_replicas, cfg.router.worker_start_timeout_s)
            self.draft_pool = ReplicaPool("draft", addresses, wpb_grpc.DraftServiceStub, timeout, secret)
            drafter = RemoteDrafter(self.draft_pool, self.tracer, self.metrics, timeout_s=cfg.router.draft_timeout_s)
        elif cfg.draft.method == "ngram":
            drafter = NgramDrafter(max_n=cfg.draft.ngram_max, min_n=cfg.draft.ngram_min)
        engine_config = EngineConfig(
            max_speculative_tokens=cfg.draft.max_speculative_tokens,
            num_speculative_tokens=cfg.draft.num_speculative_tokens,
        )
        target = RemoteTarget(self.target_pool, self.tracer, self.metrics)
        self.max_seq_len = min(cfg.router.max_seq_len, target.max_seq_len)
        engine = SpecEngine(target, drafter, self.tokenizer.tokenizer, self.tokenizer.eos_token_ids, engine_config)
        if cfg.router.calibrate:
            _calibrate(engine)
        self.proposals = None
        if cfg.proposal_log is not None:
            log_cfg = cfg.proposal_log
            self.proposals = ProposalLog(log_cfg.directory, log_cfg.sample_rate, cfg.target.model, draft_name or "none",
                                         log_cfg.max_bytes, log_cfg.backup_count, log_cfg.include_probs)
        admission = Admission(cfg.router.max_queued_requests, cfg.router.queue_timeout_s, cfg.router.request_timeout_s)
        self.scheduler = Scheduler(engine, admission, self._why_waiting)
        self._tag = uuid.uuid4().hex[:8]
        self._refresher = threading.Thread(target=self._follow_workers, name="follow-workers", daemon=True)
        self._refresher.start()
        log.info("router %s ready: %d target, %d draft replicas", self._tag, len(target_addresses),
                 len(self.draft_pool.replicas) if self.draft_pool else 0)

    def _why_waiting(self) -> Exception:
        """What a request that waited out the queue timeout is told."""
        if not self.target_pool.has_usable:
            return WorkerUnavailable("no target worker is available (a replacement may be starting); retry later")
        return ResourceExhausted("kv_cache", "no KV cache slot came free within router.queue_timeout_s; retry later")

    def _follow_workers(self) -> None:
        """Replicas come and go (autoscaling, restarts): re-read the registry now and then, and soon after a
        replica failed (its replacement registers under a new address)."""
        reg = registry.registry()
        app = self.config.app_name
        pools = [p for p in (self.target_pool, self.draft_pool) if p is not None]
        while not self.scheduler.closed:
            deadline = time.monotonic() + self.config.router.worker_refresh_s
            while time.monotonic() < deadline and not any(p.failure.is_set() for p in pools):
                time.sleep(0.2)
            failed = any(p.failure.is_set() for p in pools)
            for pool in pools:
                pool.failure.clear()
            if failed:
                time.sleep(1.0)  # let Serve notice the death and the replacement register
            try:
                self.target_pool.update(ray.get(reg.addresses.remote(app, "target")))
                if self.draft_pool is not None:
                    self.draft_pool.update(ray.get(reg.addresses.remote(app, "draft")))
            except Exception:
                log.warning("could not refresh the worker list", exc_info=True)

    # -- GenerationService -------------------------------------------------------------------------------------

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, grpc_context: Any = None) -> pb.GetModelInfoResponse:
        if grpc_context is not None:
            self._authenticate(grpc_context)
        cfg = self.config
        return pb.GetModelInfoResponse(
            target_model=cfg.target.model,
            draft_model=(cfg.draft.model or "") if cfg.draft.method == "draft_model" else "",
            draft_method=cfg.draft.method,
            max_context_length=self.max_seq_len,
            vocab_size=len(self.tokenizer.tokenizer),
            tensor_parallel_size=cfg.target.tensor_parallel_size,
            num_speculative_tokens=str(cfg.draft.num_speculative_tokens) if cfg.draft.method != "none" else "0",
            max_speculative_tokens=cfg.draft.max_speculative_tokens,
            default_max_tokens=cfg.router.default_max_tokens,
            eos_token_ids=sorted(self.tokenizer.eos_token_ids),
        )

    async def Generate(self, request: pb.GenerateRequest, grpc_context: Any) -> pb.GenerateResponse:
        request_id = request.request_id or uuid.uuid4().hex
        outputs = [output async for output in self._run(request, request_id, grpc_context)]
        return codec.merge_chunks(request_id, outputs)

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context: Any) -> AsyncIterator[pb.GenerateStreamResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        async for output in self._run(request, request_id, grpc_context):
            yield codec.encode_chunk(request_id, output)

    # -- one request ---------------------------------------------------------------------------------------------

    async def _run(self, request: pb.GenerateRequest, request_id: str, grpc_context: Any) -> AsyncIterator[RequestOutput]:
        """Submit a request to the engine and yield its outputs; on a refusal or failure set the gRPC status and
        raise. Cancelled (the client went away) -> the engine aborts it, which frees its caches."""
        self._authenticate(grpc_context)
        try:
            call = codec.decode_generate(request, self.config.router.default_max_tokens)
            # Tokenizing megabytes takes a while: off the event loop, which serves every other request.
            prompt_ids = await asyncio.to_thread(self._prompt_ids, call.prompt)
            self._check_limits(prompt_ids, call.params.max_tokens)
        except InvalidArgument as exc:
            self._fail(grpc_context, exc)
        if self.scheduler.num_active >= self.config.router.max_ongoing_requests:
            self._fail(grpc_context, ResourceExhausted("requests", "the router is at max_ongoing_requests; retry later"))
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        session_id = f"{self._tag}-{uuid.uuid4().hex[:16]}"  # unique across routers: workers key caches by it
        parent, _ = context_from_metadata(grpc_context.invocation_metadata() or ())  # a client's traceparent
        self.tracer.start_request(session_id, call.params, parent, request_id)
        # Only requests whose records carry probabilities make the workers compute them.
        return_probs = self.proposals is not None and self.proposals.start(session_id, request_id)
        times = [time.monotonic(), None]  # start, first token

        def deliver(item: Any) -> None:  # on the engine thread
            if isinstance(item, Exception):
                self.tracer.abandon(session_id, item)
            else:
                self.tracer.observe(session_id, item)
                self._measure(item, times)
                if self.proposals is not None:
                    self.proposals.observe(session_id, item)
            loop.call_soon_threadsafe(inbox.put_nowait, item)

        self.scheduler.submit(session_id, prompt_ids, call.params, call.num_speculative_tokens, deliver, return_probs)
        finished = False
        try:
            while not finished:
                item = await inbox.get()
                if isinstance(item, Exception):
                    finished = True
                    self._fail(grpc_context, item)
                if item.error is not None:
                    finished = True
                    self._fail(grpc_context, item.error)
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.scheduler.cancel(session_id)

    def _measure(self, output: RequestOutput, times: list) -> None:
        if times[1] is None and output.new_token_ids:
            times[1] = time.monotonic()
        if output.round is not None:
            info = output.round
            self.metrics.round(info.k, len(info.proposed_token_ids), info.num_accepted)
        if output.finished:
            self.metrics.finished(output, times[0], times[1])
        self.metrics.slots_in_use("target", sum(len(r.sessions) for r in self.target_pool.replicas))
        if self.draft_pool is not None:
            self.metrics.slots_in_use("draft", sum(len(r.sessions) for r in self.draft_pool.replicas))

    def _prompt_ids(self, prompt: codec.Prompt) -> list[int]:
        if prompt.token_ids is not None:
            vocab = len(self.tokenizer.tokenizer)
            bad = next((t for t in prompt.token_ids if t >= vocab), None)
            if bad is not None:
                raise InvalidArgument("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
            return list(prompt.token_ids)
        return encode_prompt(self.tokenizer.tokenizer, prompt.text, raw=prompt.raw)

    def _check_limits(self, prompt_ids: list[int], max_tokens: int) -> None:
        router = self.config.router
        if router.max_prompt_tokens is not None and len(prompt_ids) > router.max_prompt_tokens:
            raise InvalidArgument("prompt", f"{len(prompt_ids)} tokens; this server takes at most "
                                            f"{router.max_prompt_tokens} (router.max_prompt_tokens)")
        if router.max_output_tokens is not None and max_tokens > router.max_output_tokens:
            raise InvalidArgument("sampling.max_tokens", f"{max_tokens}; this server generates at most "
                                                         f"{router.max_output_tokens} (router.max_output_tokens)")

    def _authenticate(self, grpc_context: Any) -> None:
        try:
            self.auth.check(grpc_context.invocation_metadata() or ())
        except Unauthenticated as exc:
            self._fail(grpc_context, exc)

    @staticmethod
    def _fail(grpc_context: Any, error: BaseException) -> None:
        code, details = grpc_status_of(error)
        grpc_context.set_code(code)
        grpc_context.set_details(details)
        raise RequestFailed(details)

    def __del__(self) -> None:
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.close()
        proposals = getattr(self, "proposals", None)
        if proposals is not None:
            proposals.close()


RouterDeployment = serve.deployment(Router, name="Router")
