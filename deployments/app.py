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

from deployments import autoscaling, registry, swap
from deployments.auth import ENV_TOKEN, BearerAuth, load_public_token
from deployments.config import DEFAULT_VARIANT, Placement, ServeConfig, TargetConfig, parse_config
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
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.drafters import registry as methods
from specdec_core.drafters.variants import VariantDrafter
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
    """The draft model's worker. Its model comes in the deployment's user_config (`deployments.swap`): Serve calls
    `reconfigure` with it right after `__init__`, which loads it and starts serving, and again on a config update
    that changes only it, which swaps it in while the sessions held finish on the old one (`DraftServicer.swap`)."""

    kind = "draft"

    def __init__(self, config: dict[str, Any], variant: str | None = None) -> None:
        """`variant`: the draft variant of `drafts:` this deployment serves; None: the single `draft`."""
        self.cfg = parse_config(config)
        self.draft = self.cfg.draft if variant is None else self.cfg.variant(variant)
        self.kind = draft_kind(variant)
        self.servicer = None
        self.threads, self.cores = use_threads(self.draft.threads)
        self.target = load_tokenizer(self.cfg.target.model)
        self.target_vocab = max(_target_vocab_size(self.target), len(self.target.tokenizer))

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Load the draft `user_config` names, off the replica's event loop (which goes on answering Serve), then
        serve it: from the start, or in place of the one served. A model that fails to load or to match the
        target refuses the start; a swap to one keeps the old model serving (raising would make Serve stop this
        replica and start others that fail the same way: no draft at all)."""
        model = swap.draft_swap(user_config).model
        if self.servicer is None:
            await asyncio.to_thread(self._start, model)
        elif model != self.servicer.model_name:
            await asyncio.to_thread(self._swap, model)

    def _load(self, model: str) -> DraftModelDrafter:
        draft = self.draft
        # Refuses a mismatched pair.
        loaded = prepare_draft(model, self.target.tokenizer, dtype=draft.dtype, device=draft.device,
                               quantization=draft.quantization, vocabulary=draft.vocabulary)
        serve_log.info("%s", worker_summary(f"{self.kind} {model}", self.threads, self.cores,
                                            kernel_path(loaded.model)))
        runner = ModelRunner(loaded.model, _runner_config(self.cfg, draft))
        return draft.drafting.build(DraftContext(draft.spec, self.target_vocab, runner))

    def _start(self, model: str) -> None:
        # The router's engine compiles for the same tokenizer, vocabulary and eos: the draft's masks are the target's.
        grammars = GrammarCompiler(self.target.tokenizer, self.target_vocab, sorted(self.target.eos_token_ids))
        servicer = DraftServicer(self._load(model), model, self.cfg.session_idle_timeout_s, grammars)
        self._serve(self.cfg, self.draft, servicer)

    def _swap(self, model: str) -> None:
        old = self.servicer.model_name
        try:
            drafter = self._load(model)
        except Exception as exc:
            serve_log.error("draft worker %s keeps serving %s: swapping in %s failed: %s", self.replica_id, old,
                            model, exc, exc_info=True)
            return
        held = self.servicer.active_sessions
        self.servicer.swap(drafter, model)
        self._metrics.serve_model(model)
        serve_log.info("draft worker %s swapped %s for %s: new sessions draft with it, the %d held finish on the "
                       "old one", self.replica_id, old, model, held)


def draft_kind(variant: str | None) -> str:
    """The registry's name for the draft workers of `variant` (None: the single `draft`)."""
    return "draft" if variant is None else f"draft-{variant}"


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
    drafters: dict[str, Any] = {}
    remotes: dict[str, RemoteDrafter] = {}
    for variant in cfg.variants:
        method = variant.drafting
        context = DraftContext(variant.spec, target.vocab_size)
        if method is None:
            continue
        if not method.runs_draft_model:
            drafters[variant.name] = method.build(context)
            continue
        kind = draft_kind(variant.name if cfg.drafts is not None else None)
        addresses = wait_for_workers(cfg.app_name, kind, variant.initial_replicas, start_s)
        pool = ReplicaPool(kind, addresses, wpb_grpc.DraftServiceStub, timeout, credentials)
        remotes[variant.name] = RemoteDrafter(pool, tracer, metrics, timeout_s=cfg.router.draft_timeout_s)
        drafters[variant.name] = methods.assemble(method, remotes[variant.name], context)
    if cfg.drafts is None:
        drafter = drafters.get(DEFAULT_VARIANT)
    else:
        drafter = VariantDrafter(drafters, cfg.control_variant.name)
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
    draft_pools = {name: remote.pool for name, remote in remotes.items()}
    pools = [target_pool, *draft_pools.values()]
    waiting = None
    if cfg.target.autoscaling is not None or any(cfg.variant(n).autoscaling is not None for n in remotes):
        waiting = functools.partial(_waiting_for_slots, engine, remotes)
    return RouterParts(
        config=cfg, engine=engine, tokenizer=tokenizer, auth=auth, tracer=tracer, metrics=metrics,
        max_seq_len=min(cfg.router.max_seq_len, target.max_seq_len), target_pool=target_pool, draft_pools=draft_pools,
        proposals=proposals, follower=WorkerFollower(cfg.app_name, pools, cfg.router.worker_refresh_s, waiting),
    )


def _waiting_for_slots(engine: SpecEngine, drafters: dict[str, RemoteDrafter]) -> dict[str, int]:
    """What this router reports for the workers' autoscaling: requests it holds back for want of a target slot
    (beyond those the next round admits), and, per draft deployment, sessions that draft without a replica."""
    return {"target": max(0, engine.num_waiting - engine.target.free_slots),
            **{remote.pool.kind: remote.num_homeless for remote in drafters.values()}}


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
    parts = swap.split(cfg)
    args = parts.args
    t = cfg.target
    group = rank_group(t) if t.tensor_parallel_size > 1 else None
    workers = [_deployment(TargetWorker, "TargetWorker", t, group, t.rank_environment)
               .options(**_versioned("TargetWorker", args)).bind(args)]
    # A draft deployment for a single draft that runs a model, or one per such variant of an A/B (each scaled on
    # its own); each takes its model in its user_config.
    for name, user_config in parts.workers.items():
        variant = name.removeprefix("DraftWorker-") if cfg.drafts is not None else None
        placement = cfg.draft if variant is None else cfg.variant(variant)
        workers.append(_deployment(DraftWorker, name, placement)
                       .options(user_config=user_config, **_versioned(name, args))
                       .bind(args, *([variant] if variant else [])))
    options: dict[str, Any] = {"num_replicas": cfg.router.num_replicas}
    if cfg.router.autoscaling is not None:
        options = {"autoscaling_config": cfg.router.autoscaling.model_dump()}
    if parts.router is not None:  # the variants' models (what it reports and labels with) and weights
        options["user_config"] = parts.router
    router = RouterDeployment.options(
        ray_actor_options=_actor_options(cfg.router.num_cpus, resources=cfg.router.resources,
                                         env=_auth_environment()),
        max_ongoing_requests=cfg.router.max_ongoing_requests,
        **options,
        **_versioned("Router", args),
    )
    return router.bind(functools.partial(connect_router, args), *workers)


def _versioned(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """The deployment's version (`swap.version`), through the option Serve keeps for itself (`_internal`): the
    only way, in Ray 2.60, for `serve.run` to update a running deployment in place rather than restart it. Under
    `serve deploy` Serve sets its own, from the application's `args`."""
    return {"version": swap.version(name, args), "_internal": True}


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

