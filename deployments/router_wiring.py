"""The router's wiring to the workers: `connect_router` builds a router's parts (`RouterParts`) in its replica.

It needs Ray (the registry, the workers' addresses, calibration over them), so it runs where the router runs: the
builder (`deployments.app`) binds it with the config, and `Router` calls it. A test hands the router parts around
an in-process engine instead, and needs no cluster.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from deployments import worker_registry
from deployments.auth import InternalCredentials, public_auth
from deployments.discovery import WorkerFollower, wait_for_workers
from deployments.prometheus import ServingMetrics
from deployments.proposal_log import ProposalLog
from deployments.remote_drafter import RemoteDrafter
from deployments.remote_target import RemoteTarget
from deployments.replica_pool import ReplicaPool
from deployments.router import RouterParts
from deployments.serve_config import DEFAULT_VARIANT, ServeConfig, parse_config
from deployments.telemetry import RequestTracer, setup_tracing
from deployments.tls import Role
from deployments.worker_registry import draft_kind
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.calibration import calibrate
from specdec_core.drafters import registry as methods
from specdec_core.drafters.base import DraftContext
from specdec_core.drafters.variants import VariantDrafter
from specdec_core.engine import EngineConfig, SpecEngine
from specdec_core.models.loader import LoadedTokenizer, load_tokenizer

log = logging.getLogger(__name__)


def connect_router(config: dict[str, Any]) -> RouterParts:
    """The router's parts for `config` (a `ServeConfig` as JSON), wired to the application's workers. Runs in the
    router's replica: it waits for the workers to register, connects to them, builds the engine over them (the
    drafter runs in the router for a method without a draft model) and calibrates it."""
    cfg = parse_config(config)
    # First: no token, no router (and no waiting for workers).
    auth = public_auth(cfg.auth, cfg.auth_token_file, cfg.auth_tokens_file)
    setup_tracing(cfg.app_name)
    tracer = RequestTracer(cfg.target.model, cfg.draft.label)
    metrics = ServingMetrics(cfg.target.model, cfg.draft.label)
    tokenizer = load_tokenizer(cfg.target.model)
    # The workers serve only these.
    credentials = worker_registry.credentials(cfg.app_name, Role.CLIENT, cfg.tls_setting)
    target_pool = _pool(cfg, "target", cfg.target.initial_replicas, wpb_grpc.TargetServiceStub, credentials)
    target = RemoteTarget(target_pool, tracer, metrics)
    drafters, remotes = _drafters(cfg, target.vocab_size, tracer, metrics, credentials)
    engine = _engine(cfg, target, drafters, tokenizer)
    if cfg.router.calibrate:
        _calibrate(engine)
    proposals = _proposal_log(cfg)
    draft_pools = {name: remote.pool for name, remote in remotes.items()}
    return RouterParts(
        config=cfg,
        engine=engine,
        tokenizer=tokenizer,
        auth=auth,
        tracer=tracer,
        metrics=metrics,
        max_seq_len=min(cfg.router.max_seq_len, target.max_seq_len),
        target_pool=target_pool,
        draft_pools=draft_pools,
        proposals=proposals,
        follower=_follower(cfg, engine, [target_pool, *draft_pools.values()], remotes),
    )


def _pool(
    cfg: ServeConfig, kind: str, expected: int, stub_type: type, credentials: InternalCredentials | None
) -> ReplicaPool:
    """The `kind` workers, once `expected` replicas registered (fewer, at least one, at worker_start_timeout_s)."""
    addresses = wait_for_workers(cfg.app_name, kind, expected, cfg.router.worker_start_timeout_s)
    return ReplicaPool(kind, addresses, stub_type, cfg.router.rpc_timeout_s, credentials)


def _drafters(
    cfg: ServeConfig,
    vocab_size: int,
    tracer: RequestTracer,
    metrics: ServingMetrics,
    credentials: InternalCredentials | None,
) -> tuple[dict[str, Any], dict[str, RemoteDrafter]]:
    """Every variant's drafter, by name (none for plain decoding), and the remote drafters among them: those of a
    method that runs a draft model draft through its draft workers, the others run in the router."""
    drafters: dict[str, Any] = {}
    remotes: dict[str, RemoteDrafter] = {}
    for variant in cfg.variants:
        method = variant.drafting
        context = DraftContext(variant.spec, vocab_size)
        if method is None:
            continue
        if not method.runs_draft_model:
            drafters[variant.name] = method.build(context)
            continue
        kind = draft_kind(variant.name if cfg.drafts is not None else None)
        pool = _pool(cfg, kind, variant.initial_replicas, wpb_grpc.DraftServiceStub, credentials)
        remotes[variant.name] = RemoteDrafter(pool, tracer, metrics, timeout_s=cfg.router.draft_timeout_s)
        drafters[variant.name] = methods.assemble(method, remotes[variant.name], context)
    return drafters, remotes


def _engine(cfg: ServeConfig, target: RemoteTarget, drafters: dict[str, Any], tokenizer: LoadedTokenizer) -> SpecEngine:
    """The engine over the remote target: the single draft's drafter, or the variants' behind one `VariantDrafter`."""
    if cfg.drafts is None:
        drafter = drafters.get(DEFAULT_VARIANT)
    else:
        drafter = VariantDrafter(drafters, cfg.control_variant.name)
    engine_config = EngineConfig(
        max_speculative_tokens=cfg.draft.max_speculative_tokens,
        num_speculative_tokens=cfg.draft.num_speculative_tokens,
        overlap=cfg.overlap,
    )
    if cfg.draft.overlap != cfg.overlap and cfg.draft.runs_draft_model:
        log.info(
            "draft.overlap auto: off, the draft and the target share this machine's cores (give them cpu_affinity "
            "apart, or nodes of their own, for pre-drafting to be measured)"
        )
    return SpecEngine(target, drafter, tokenizer.tokenizer, tokenizer.eos_token_ids, engine_config)


def _proposal_log(cfg: ServeConfig) -> ProposalLog | None:
    if cfg.proposal_log is None:
        return None
    log_cfg = cfg.proposal_log
    return ProposalLog(
        log_cfg.directory,
        log_cfg.sample_rate,
        cfg.target.model,
        cfg.draft.label,
        log_cfg.max_bytes,
        log_cfg.backup_count,
        log_cfg.include_probs,
        log_cfg.include_context_tokens,
    )


def _follower(
    cfg: ServeConfig, engine: SpecEngine, pools: list[ReplicaPool], remotes: dict[str, RemoteDrafter]
) -> WorkerFollower:
    """What keeps the pools' replicas current; it reports the sessions waiting for a slot where a worker deployment
    autoscales."""
    waiting = None
    if cfg.target.autoscaling is not None or any(cfg.variant(n).autoscaling is not None for n in remotes):
        waiting = functools.partial(_waiting_for_slots, engine, remotes)
    return WorkerFollower(cfg.app_name, pools, cfg.router.worker_refresh_s, waiting)


def _waiting_for_slots(engine: SpecEngine, drafters: dict[str, RemoteDrafter]) -> dict[str, int]:
    """What this router reports for the workers' autoscaling: requests it holds back for want of a target slot
    (beyond those the next round admits), and, per draft deployment, sessions that draft without a replica."""
    return {
        "target": max(0, engine.num_waiting - engine.target.free_slots),
        **{remote.pool.kind: remote.num_homeless for remote in drafters.values()},
    }


def _calibrate(engine: SpecEngine) -> None:
    """Round costs measured before the first request (the engine thread has not started yet). A failure costs
    only the head start: `auto` then explores on live rounds."""
    try:
        done = calibrate(engine)
    except Exception as exc:
        log.warning("calibration failed, `auto` will measure costs on live rounds: %s", exc, exc_info=True)
        return
    log.info(
        "calibrated round costs at batch sizes %s: %d rounds in %.1f s",
        list(done.batch_sizes),
        done.rounds,
        done.seconds,
    )
