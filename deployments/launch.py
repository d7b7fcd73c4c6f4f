"""Run the application for one config on Ray Serve: a local cluster started here, or the one at $RAY_ADDRESS.

`specdec serve`, the demo, the soak and the stack benchmarks all deploy through `serving`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import ray
from ray import serve

from deployments import worker_registry
from deployments.app import build_app, grpc_options, limit_public_messages
from deployments.serve_config import ServeConfig
from specdec_core.environment import ray_address

log = logging.getLogger(__name__)


# A machine this small runs Serve's own background work on the cores its workers compute on: there, its
# controller reconciles every 0.5 s rather than 0.1 s, and each replica exports Serve's metrics every second rather
# than ten times a second. Only for a cluster started here; a value already in the environment wins.
SMALL_MACHINE_CORES = 4
SMALL_MACHINE_ENVIRONMENT = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}


# Ray starts its worker processes at nice 15 so that its own daemons (nice 0) stay responsive under load; for a
# serving cluster that puts the workers' compute threads behind every other process of the machine, Ray's daemons
# included, each of whose wake-ups then stalls a forward's threads. Every Serve replica (workers, router, proxy)
# runs at nice 0 in a cluster started here; KubeRay pods set the same variable (k8s/).
SERVING_ENVIRONMENT = {"RAY_worker_niceness": "0"}


def cluster_defaults(cores: int) -> dict[str, str]:
    """Set `SERVING_ENVIRONMENT`, and `SMALL_MACHINE_ENVIRONMENT` on a machine of at most `SMALL_MACHINE_CORES`
    cores, where unset (Ray's processes inherit them); what was set."""
    wanted = dict(SERVING_ENVIRONMENT)
    if cores <= SMALL_MACHINE_CORES:
        wanted.update(SMALL_MACHINE_ENVIRONMENT)
    chosen = {name: value for name, value in wanted.items() if name not in os.environ}
    os.environ.update(chosen)
    return chosen


@contextlib.contextmanager
def serving(config: ServeConfig, quiet: bool = False) -> Iterator[None]:
    """Deploy `config` on Ray Serve for the duration of the block: on the cluster at $RAY_ADDRESS, or on a local
    one started (and stopped, with every process it started) here. `quiet`: keep the cluster's logs out of this
    process's output."""
    address = ray_address()
    started_ray = not address
    limit_public_messages()
    if started_ray:
        cores = os.cpu_count() or 1
        if chosen := cluster_defaults(cores):
            settings = ", ".join(f"{name}={value}" for name, value in chosen.items())
            log.info("a local cluster on %d cores: Ray and Serve run with %s (set them to choose)", cores, settings)
        # Draft and target take turns within a round, so on one machine they may share its cores: give the local
        # cluster enough logical CPUs for every deployment's request.
        needed = cpus_needed(config)
        ray.init(
            num_cpus=max(cores, int(needed + 0.999)),
            include_dashboard=False,
            log_to_driver=not quiet,
            logging_level=logging.WARNING if quiet else logging.INFO,
        )
    else:
        ray.init(address=address, log_to_driver=not quiet)
    if quiet:
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    try:
        start_serve(config)
        serve.run(build_app(config), name=config.app_name, route_prefix="/")
        yield
    finally:
        try:
            serve.delete(config.app_name)
            if started_ray:
                serve.shutdown()
            worker_registry.shutdown()
        finally:
            if started_ray:
                ray.shutdown()


def start_serve(config: ServeConfig, host: str = "0.0.0.0") -> None:
    """Start Serve on the connected cluster with `config`'s proxies: where they run (`proxy_location`), their HTTP
    port on `host` and their gRPC port, which serves the public GenerationService. Serve's settings are the
    cluster's and fixed once it runs: a Serve already started keeps its own."""
    serve.start(
        proxy_location=config.proxy_location,
        http_options={"host": host, "port": config.http_port},
        grpc_options=grpc_options(config),
    )


def cpus_needed(config: ServeConfig) -> float:
    """Logical CPUs that every deployment of `config` asks for (an autoscaled worker deployment at its
    max_replicas), plus one for Serve's controller and proxy."""
    target = config.target
    total = target.num_cpus * target.tensor_parallel_size * target.most_replicas
    total += config.router.num_cpus * config.router.num_replicas
    for variant in config.variants:  # a draft deployment per variant that runs a model
        if variant.runs_draft_model:
            total += variant.num_cpus * variant.most_replicas
    return total + 1
