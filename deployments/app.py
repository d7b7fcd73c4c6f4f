"""The Serve application: draft and target worker deployments and the router, built from one config.

`build_app(config)` is the one builder: every `serve.deployment(...)` and `.bind(...)` of the application is made
here, over plain classes (`deployments.worker_deployments`, `deployments.router`). `specdec serve CONFIG.yaml`
calls it; so does Serve itself through `build` (import path `deployments.app:build`, the config as the
application's `args`) for `serve run` and `serve deploy` with a Serve config file. The router is handed
`connect_router` (`deployments.router_wiring`), the wiring of its engine to the workers, which its replica runs.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from ray import serve
from ray.serve.config import gRPCOptions

from deployments import autoscaling, swap
from deployments.auth import ENV_TOKEN
from deployments.router import Router
from deployments.router_wiring import connect_router
from deployments.serve_config import Placement, ServeConfig, TargetConfig, parse_config
from deployments.telemetry import otel_environment
from deployments.worker_deployments import DraftWorker, TargetWorker
from specdec_core.environment import auth_token

log = logging.getLogger(__name__)

# The services on the public gRPC port, routed by Serve's proxy to the router: the API, and the standard health
# Check (`deployments.health`). A Serve config file lists the same (`grpc_options.grpc_servicer_functions`).
SERVICER_FUNCTIONS = [
    "specdec.v1.generation_pb2_grpc.add_GenerationServiceServicer_to_server",
    "deployments.health.add_health_to_server",
]


PUBLIC_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


def limit_public_messages() -> None:
    """Keep gRPC's 4 MiB receive limit on the public API: Serve's proxy raises it to 2 GiB unless
    RAY_SERVE_GRPC_MAX_MESSAGE_SIZE is set in the environment of the cluster's processes (so set it before Ray
    starts; on Kubernetes the pods' environment sets it). A larger request is RESOURCE_EXHAUSTED at the proxy."""
    # Written, not read: Serve's proxy reads it from the environment of the processes Ray starts, which inherit
    # this one's.
    os.environ.setdefault("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(PUBLIC_MAX_MESSAGE_BYTES))


def grpc_options(config: ServeConfig) -> gRPCOptions:
    """Serve's gRPC proxy for `config`. Server reflection (grpc.reflection.v1alpha) is answered by the proxy itself,
    from the descriptors the servicer functions' modules registered there: `grpcurl list` needs no .proto."""
    return gRPCOptions(port=config.grpc_port, grpc_servicer_functions=SERVICER_FUNCTIONS, enable_reflection=True)


def _actor_options(
    num_cpus: float, num_gpus: float = 0.0, resources: dict[str, float] | None = None, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Resources, and this process's OTEL_* settings so that every deployment exports its spans alike."""
    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if resources:
        options["resources"] = dict(resources)
    env = {**otel_environment(), **(env or {})}
    if env:
        options["runtime_env"] = {"env_vars": env}
    return options


def _deployment(
    cls: type, name: str, placement: Placement, group: dict[str, Any] | None = None, env: dict[str, str] | None = None
) -> Any:
    """A worker deployment: each replica reserves `placement`'s num_cpus, num_gpus and resources; `group`: Serve's
    placement-group options (`rank_group`) for a replica of several ranks."""
    resources = _actor_options(placement.num_cpus, placement.num_gpus, placement.resources, env)
    options: dict[str, Any] = autoscaling.serve_options(placement)  # replicas: fixed or autoscaled; draining
    return serve.deployment(cls, name=name).options(
        ray_actor_options=resources, max_ongoing_requests=1000, **options, **(group or {})
    )


def rank_group(target: TargetConfig) -> dict[str, Any]:
    """Serve's placement-group options for a tensor-parallel target replica: one bundle per rank, each exactly
    what the replica reserves for itself (it is rank 0, in bundle 0; `tensor_parallel.TargetRank` r in bundle r),
    placed by `target.rank_strategy`."""
    bundle = {"CPU": target.num_cpus, **({"GPU": target.num_gpus} if target.num_gpus else {}), **target.resources}
    return {
        "placement_group_bundles": [dict(bundle) for _ in range(target.tensor_parallel_size)],
        "placement_group_strategy": target.rank_strategy,
    }


def build_app(config: ServeConfig | dict[str, Any]) -> serve.Application:
    """The Serve application for `config`: a router bound to its workers."""
    cfg = config if isinstance(config, ServeConfig) else parse_config(config)
    if cfg.target.tensor_parallel_size > 1:
        _check_tensor_parallel(cfg.target)
    parts = swap.split(cfg)
    workers = _worker_deployments(cfg, parts)
    return _router_deployment(cfg, parts).bind(functools.partial(connect_router, parts.args), *workers)


def _worker_deployments(cfg: ServeConfig, parts: swap.Split) -> list[serve.Application]:
    """The target deployment, and the draft deployments, each bound to the init args every deployment gets."""
    args = parts.args
    t = cfg.target
    group = rank_group(t) if t.tensor_parallel_size > 1 else None
    workers = [
        _deployment(TargetWorker, "TargetWorker", t, group, t.rank_environment)
        .options(**_versioned("TargetWorker", args))
        .bind(args)
    ]
    # A draft deployment for a single draft that runs a model, or one per such variant of an A/B (each scaled on
    # its own); each takes its model in its user_config.
    for name, user_config in parts.workers.items():
        variant = name.removeprefix("DraftWorker-") if cfg.drafts is not None else None
        placement = cfg.draft if variant is None else cfg.variant(variant)
        workers.append(
            _deployment(DraftWorker, name, placement)
            .options(user_config=user_config, **_versioned(name, args))
            .bind(args, *([variant] if variant else []))
        )
    return workers


# One router class for both public APIs: gRPC reaches the servicer methods through Serve's gRPC proxy, HTTP reaches
# the ASGI app of `Router.__serve_build_asgi_app__` through Serve's HTTP proxy. Wrapped once, as a class decorator
# would: every application built here deploys this same class.
_RouterIngress = serve.ingress()(Router)


def _router_deployment(cfg: ServeConfig, parts: swap.Split) -> serve.Deployment:
    """The router's deployment: its replicas (fixed or autoscaled), resources and options."""
    options: dict[str, Any] = {"num_replicas": cfg.router.num_replicas}
    if cfg.router.autoscaling is not None:
        options = {"autoscaling_config": cfg.router.autoscaling.model_dump()}
    if parts.router is not None:  # the variants' models (what it reports and labels with) and weights
        options["user_config"] = parts.router
    return serve.deployment(_RouterIngress, name="Router").options(
        ray_actor_options=_actor_options(cfg.router.num_cpus, resources=cfg.router.resources, env=_auth_environment()),
        max_ongoing_requests=cfg.router.max_ongoing_requests,
        **options,
        **_versioned("Router", parts.args),
    )


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
        check_shardable(
            args_from_hf_config(json.loads((path / "config.json").read_text())), target.tensor_parallel_size
        )


def build(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder: `import_path: deployments.app:build` with the specdec config as `args`."""
    config = parse_config(args)
    if config.proxy_location is not None:
        log.warning(
            "proxy_location in the application's args has no effect here: Serve was started already, by "
            "the Serve config, whose top-level proxy_location says where its proxies run"
        )
    return build_app(config)
