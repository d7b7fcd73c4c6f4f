"""The Serve application: draft and target worker deployments and the router, built from one config.

`build_app(config)` is the one builder. `specdec serve CONFIG.yaml` calls it; so does Serve itself through
`build` (import path `deployments.app:build`, the config as the application's `args`) for `serve run` and
`serve deploy` with a Serve config file. The router is handed `connect_router`, the wiring of its engine to the
workers, which its replica runs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from typing import Any

import ray
from ray import serve
from ray.serve.config import gRPCOptions

from deployments import autoscaling, registry
from deployments.auth import ENV_TOKEN, BearerAuth, load_public_token
from deployments.config import Placement, ServeConfig, TargetConfig, parse_config
from deployments.discovery import WorkerFollower, wait_for_workers
from deployments.metrics import ServingMetrics, WorkerMetrics
from deployments.proposals import ProposalLog
from deployments.remote import RemoteDrafter, RemoteTarget, ReplicaPool
from deployments.router import RouterDeployment, RouterParts
from deployments.telemetry import RequestTracer, otel_environment, setup_tracing
from deployments.tls import Role
from deployments.workers import DraftServicer, TargetServicer, start_server
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.build import prepare_draft, prepare_model
from specdec_core.calibration import calibrate
from specdec_core.drafters.base import DraftContext
from specdec_core.drafters import registry as methods
from specdec_core.engine import EngineConfig, SpecEngine
from specdec_core.environment import auth_token
from specdec_core.grammar.compiler import GrammarCompiler
from specdec_core.hardware import use_threads, worker_summary
from specdec_core.kernels.cpu import kernel_path
from specdec_core.models.loader import load_tokenizer
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.target import LocalTarget

log = logging.getLogger(__name__)
# What a replica must show at start goes through Serve's logger: into the replica's log file and the console of
# `specdec serve`. (Module loggers stay under the root's WARNING level in Ray's worker processes.)
serve_log = logging.getLogger("ray.serve")

SERVICER_FUNCTIONS = ["specdec.v1.generation_pb2_grpc.add_GenerationServiceServicer_to_server"]


PUBLIC_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


def limit_public_messages() -> None:
    """Keep gRPC's 4 MiB receive limit on the public API: Serve's proxy raises it to 2 GiB unless
    RAY_SERVE_GRPC_MAX_MESSAGE_SIZE is set in the environment of the cluster's processes (so set it before Ray
    starts; on Kubernetes the pods' environment sets it). A larger request is RESOURCE_EXHAUSTED at the proxy."""
    # Written, not read: Serve's proxy reads it from the environment of the processes Ray starts, which inherit
    # this one's.
    os.environ.setdefault("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(PUBLIC_MAX_MESSAGE_BYTES))


def grpc_options(config: ServeConfig) -> gRPCOptions:
    return gRPCOptions(port=config.grpc_port, grpc_servicer_functions=SERVICER_FUNCTIONS)


def _runner_config(config: ServeConfig, placement: Placement) -> RunnerConfig:
    return RunnerConfig(
        num_slots=placement.max_sequences,
        max_seq_len=config.router.max_seq_len,
        max_extend=config.draft.max_speculative_tokens + 1,
        max_cache_bytes=placement.kv_cache_max_bytes,
        prefix_caching=config.prefix_caching,
    )


METRICS_INTERVAL_S = 5.0  # how often a worker exports its prefix cache's counters


class _Worker:
    """Common to both workers: serve the internal gRPC service, register its address, export its metrics."""

    kind = ""

    def _serve(self, config: ServeConfig, placement: Placement, servicer: Any) -> None:
        setup_tracing(f"{config.app_name}-{self.kind}")
        self.servicer = servicer
        self.drain_timeout_s = placement.drain_timeout_s
        self._stop_metrics = threading.Event()
        credentials = registry.credentials(config.app_name, Role.SERVER, config.tls_setting)
        self.server, port = start_server(servicer, port=config.worker_grpc_port, credentials=credentials)
        self.address = f"{ray.util.get_node_ip_address()}:{port}"
        self.app = config.app_name
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._registry = registry.registry()
        ray.get(self._registry.register.remote(self.app, self.kind, self.replica_id, self.address))
        log.info("%s worker %s serving on %s", self.kind, self.replica_id, self.address)
        self._metrics = WorkerMetrics(self.kind, servicer.model_name)
        threading.Thread(target=self._export_metrics, name="worker-metrics", daemon=True).start()

    def _export_metrics(self) -> None:
        """Follow the servicer's counters (the same numbers GetStats reports) into Prometheus."""
        while not self._stop_metrics.wait(METRICS_INTERVAL_S):
            try:
                self._metrics.update(self.servicer.stats())
            except Exception:  # metrics must never take the worker down
                log.warning("exporting worker metrics failed", exc_info=True)

    def get_address(self) -> str:
        return self.address

    def check_health(self) -> None:
        if self.servicer is None:
            raise RuntimeError("worker not started")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The replica's load, for Serve's autoscaling policy (`deployments.autoscaling`): sessions held, slots,
        and the sessions the routers report waiting for a slot of this kind. Serve calls it only for a deployment
        with autoscaling."""
        waiting = await self._registry.waiting.remote(self.app, self.kind)
        return autoscaling.load_report(self.servicer.active_sessions, self.servicer.num_slots, waiting)

    async def __del__(self) -> None:
        """Serve stops the replica (scaled down, redeployed, deleted): drain, then stop serving. Off the replica's
        event loop, which goes on answering Serve meanwhile."""
        if getattr(self, "server", None) is not None:
            await asyncio.to_thread(self._drain_and_stop)

    def _drain_and_stop(self) -> None:
        """Refuse new sessions (routers start them elsewhere), unregister (routers stop offering this replica),
        wait for the sessions held to end, at most `drain_timeout_s`, then stop the server."""
        self.servicer.start_draining()
        try:
            ray.get(self._registry.unregister.remote(self.app, self.kind, self.replica_id), timeout=5)
        except Exception:  # the cluster may be going down
            pass
        held = self.servicer.active_sessions
        if not self.servicer.drain(self.drain_timeout_s):
            serve_log.warning("%s worker %s stops with %d sessions still held after %.0f s of draining", self.kind,
                              self.replica_id, self.servicer.active_sessions, self.drain_timeout_s)
        elif held:
            serve_log.info("%s worker %s drained %d sessions", self.kind, self.replica_id, held)
        self._stop_metrics.set()
        self.servicer.close()
        self.server.stop(grace=2)


class TargetWorker(_Worker):
    kind = "target"

    def __init__(self, config: dict[str, Any]) -> None:
        cfg = parse_config(config)
        t = cfg.target
        # Ray starts workers with OMP_NUM_THREADS=1, and its num_cpus reservation pins no cores: set the threads.
        threads, cores = use_threads(t.threads, share=t.tensor_parallel_size)
        if t.tensor_parallel_size > 1:
            from deployments.tensor_parallel import TensorParallelTarget

            target: Any = TensorParallelTarget(t.model, t.dtype, t.device, t.tensor_parallel_size,
                                               _runner_config(cfg, t), t.num_cpus, t.num_gpus, cfg.router.rpc_timeout_s,
                                               t.resources, threads=t.threads, env=t.rank_environment)
        else:
            loaded = prepare_model(t.model, dtype=t.dtype, device=t.device)
            target = LocalTarget(ModelRunner(loaded.model, _runner_config(cfg, t)))
        who = self.kind if t.tensor_parallel_size == 1 else f"{self.kind} rank 0"
        serve_log.info("%s", worker_summary(who, threads, cores, kernel_path(target.runner.model)))
        self._serve(cfg, t, TargetServicer(target, t.model, cfg.session_idle_timeout_s))

    def check_health(self) -> None:
        super().check_health()
        if not getattr(self.servicer.target, "healthy", True):
            raise RuntimeError("a tensor-parallel rank failed")


class DraftWorker(_Worker):
    kind = "draft"

    def __init__(self, config: dict[str, Any]) -> None:
        cfg = parse_config(config)
        threads, cores = use_threads(cfg.draft.threads)
        target = load_tokenizer(cfg.target.model)
        # Refuses to start with a mismatched pair.
        loaded = prepare_draft(cfg.draft.model, target.tokenizer, dtype=cfg.draft.dtype, device=cfg.draft.device,
                               quantization=cfg.draft.quantization)
        serve_log.info("%s", worker_summary(self.kind, threads, cores, kernel_path(loaded.model)))
        target_vocab = max(_target_vocab_size(target), len(target.tokenizer))
        runner = ModelRunner(loaded.model, _runner_config(cfg, cfg.draft))
        drafter = cfg.draft.drafting.build(DraftContext(cfg.draft.spec, target_vocab, runner))
        # The router's engine compiles for the same tokenizer, vocabulary and eos: the draft's masks are the target's.
        grammars = GrammarCompiler(target.tokenizer, target_vocab, sorted(target.eos_token_ids))
        self._serve(cfg, cfg.draft, DraftServicer(drafter, cfg.draft.model, cfg.session_idle_timeout_s, grammars))


def _target_vocab_size(target: Any) -> int:
    """The target's embedding rows (may exceed the tokenizer: q must cover every id the target scores)."""
    return int(target.hf_config.get("vocab_size") or len(target.tokenizer))


def connect_router(config: dict[str, Any]) -> RouterParts:
    """The router's parts for `config` (a `ServeConfig` as JSON), wired to the application's workers. Runs in the
    router's replica: it waits for the workers to register, connects to them, builds the engine over them (the
    drafter runs in the router for a method without a draft model) and calibrates it."""
    cfg = parse_config(config)
    setup_tracing(cfg.app_name)
    tracer = RequestTracer(cfg.target.model, cfg.draft.label)
    metrics = ServingMetrics(cfg.target.model, cfg.draft.label)
    auth = BearerAuth(load_public_token(cfg.auth_token_file))
    tokenizer = load_tokenizer(cfg.target.model)
    timeout = cfg.router.rpc_timeout_s
    credentials = registry.credentials(cfg.app_name, Role.CLIENT, cfg.tls_setting)  # the workers serve only these
    start_s = cfg.router.worker_start_timeout_s
    target_addresses = wait_for_workers(cfg.app_name, "target", cfg.target.initial_replicas, start_s)
    target_pool = ReplicaPool("target", target_addresses, wpb_grpc.TargetServiceStub, timeout, credentials)
    target = RemoteTarget(target_pool, tracer, metrics)
    method, drafter, draft_pool, remote = cfg.draft.drafting, None, None, None
    if method is not None and method.runs_draft_model:
        addresses = wait_for_workers(cfg.app_name, "draft", cfg.draft.initial_replicas, start_s)
        draft_pool = ReplicaPool("draft", addresses, wpb_grpc.DraftServiceStub, timeout, credentials)
        remote = RemoteDrafter(draft_pool, tracer, metrics, timeout_s=cfg.router.draft_timeout_s)
        drafter = methods.assemble(method, remote, DraftContext(cfg.draft.spec, target.vocab_size))
    elif method is not None:
        drafter = method.build(DraftContext(cfg.draft.spec, target.vocab_size))
    engine_config = EngineConfig(
        max_speculative_tokens=cfg.draft.max_speculative_tokens,
        num_speculative_tokens=cfg.draft.num_speculative_tokens,
    )
    engine = SpecEngine(target, drafter, tokenizer.tokenizer, tokenizer.eos_token_ids, engine_config)
    if cfg.router.calibrate:
        _calibrate(engine)
    proposals = None
    if cfg.proposal_log is not None:
        log_cfg = cfg.proposal_log
        proposals = ProposalLog(log_cfg.directory, log_cfg.sample_rate, cfg.target.model, cfg.draft.label,
                                log_cfg.max_bytes, log_cfg.backup_count, log_cfg.include_probs,
                                log_cfg.include_context_tokens)
    pools = [pool for pool in (target_pool, draft_pool) if pool is not None]
    waiting = None
    if cfg.target.autoscaling is not None or (remote is not None and cfg.draft.autoscaling is not None):
        waiting = functools.partial(_waiting_for_slots, engine, remote)
    return RouterParts(
        config=cfg, engine=engine, tokenizer=tokenizer, auth=auth, tracer=tracer, metrics=metrics,
        max_seq_len=min(cfg.router.max_seq_len, target.max_seq_len), target_pool=target_pool, draft_pool=draft_pool,
        proposals=proposals, follower=WorkerFollower(cfg.app_name, pools, cfg.router.worker_refresh_s, waiting),
    )


def _waiting_for_slots(engine: SpecEngine, drafter: RemoteDrafter | None) -> dict[str, int]:
    """What this router reports for the workers' autoscaling: requests it holds back for want of a target slot
    (beyond those the next round admits), and sessions that draft without a draft replica."""
    return {"target": max(0, engine.num_waiting - engine.target.free_slots),
            "draft": drafter.num_homeless if drafter is not None else 0}


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


def _actor_options(num_cpus: float, num_gpus: float = 0.0, resources: dict[str, float] | None = None,
                   env: dict[str, str] | None = None) -> dict[str, Any]:
    """Resources, and this process's OTEL_* settings so that every deployment exports its spans alike."""
    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if resources:
        options["resources"] = dict(resources)
    env = {**otel_environment(), **(env or {})}
    if env:
        options["runtime_env"] = {"env_vars": env}
    return options


def _deployment(cls: type, name: str, placement: Placement, group: dict[str, Any] | None = None,
                env: dict[str, str] | None = None) -> Any:
    """A worker deployment: each replica reserves `placement`'s num_cpus, num_gpus and resources; `group`: Serve's
    placement-group options (`rank_group`) for a replica of several ranks."""
    resources = _actor_options(placement.num_cpus, placement.num_gpus, placement.resources, env)
    options: dict[str, Any] = autoscaling.serve_options(placement)  # replicas: fixed or autoscaled; draining
    return serve.deployment(cls, name=name).options(ray_actor_options=resources, max_ongoing_requests=1000,
                                                    **options, **(group or {}))


def rank_group(target: TargetConfig) -> dict[str, Any]:
    """Serve's placement-group options for a tensor-parallel target replica: one bundle per rank, each exactly
    what the replica reserves for itself (it is rank 0, in bundle 0; `tensor_parallel.TargetRank` r in bundle r),
    placed by `target.rank_strategy`."""
    bundle = {"CPU": target.num_cpus, **({"GPU": target.num_gpus} if target.num_gpus else {}), **target.resources}
    return {"placement_group_bundles": [dict(bundle) for _ in range(target.tensor_parallel_size)],
            "placement_group_strategy": target.rank_strategy}


def build_app(config: ServeConfig | dict[str, Any]) -> serve.Application:
    """The Serve application for `config`: a router bound to its workers."""
    cfg = config if isinstance(config, ServeConfig) else parse_config(config)
    if cfg.target.tensor_parallel_size > 1:
        _check_tensor_parallel(cfg.target)
    args = cfg.model_dump(mode="json")
    t = cfg.target
    group = rank_group(t) if t.tensor_parallel_size > 1 else None
    workers = [_deployment(TargetWorker, "TargetWorker", t, group, t.rank_environment).bind(args)]
    if cfg.draft.runs_draft_model:
        workers.append(_deployment(DraftWorker, "DraftWorker", cfg.draft).bind(args))
    scaling: dict[str, Any] = {"num_replicas": cfg.router.num_replicas}
    if cfg.router.autoscaling is not None:
        scaling = {"autoscaling_config": cfg.router.autoscaling.model_dump()}
    router = RouterDeployment.options(
        ray_actor_options=_actor_options(cfg.router.num_cpus, resources=cfg.router.resources,
                                         env=_auth_environment()),
        max_ongoing_requests=cfg.router.max_ongoing_requests,
        **scaling,
    )
    return router.bind(functools.partial(connect_router, args), *workers)


def _auth_environment() -> dict[str, str]:
    """SPECDEC_AUTH_TOKEN of the building process, for the router: it may run on a Ray cluster this process only
    joined, whose workers never saw this environment. (A token file, `auth_token_file`, keeps the token out of
    the runtime environment that Ray's dashboard shows: prefer it on shared clusters.)"""
    token = auth_token()
    return {ENV_TOKEN: token} if token else {}


def _check_tensor_parallel(target: TargetConfig) -> None:
    """Refuse a tensor_parallel_size the model cannot be split by, before anything is deployed."""
    import json

    from specdec_core.models.families import args_from_hf_config
    from specdec_core.models.loader import resolve_source
    from specdec_core.parallel import check_shardable

    path = resolve_source(target.model)
    if path.is_dir():
        check_shardable(args_from_hf_config(json.loads((path / "config.json").read_text())), target.tensor_parallel_size)


def build(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder: `import_path: deployments.app:build` with the specdec config as `args`."""
    config = parse_config(args)
    if config.proxy_location is not None:
        log.warning("proxy_location in the application's args has no effect here: Serve was started already, by "
                    "the Serve config, whose top-level proxy_location says where its proxies run")
    return build_app(config)

