"""Worker autoscaling: Serve scales the draft and target worker deployments by their sessions.

Routers call the workers over gRPC, not through Serve handles, so Serve's own measure (requests ongoing at a
replica) sees nothing of their load. Instead, with Ray Serve's custom metrics and policies:

- every worker replica reports, through `record_autoscaling_stats` (`deployments.worker_deployments`), the sessions it
  holds (`SESSIONS`), its KV slots (`SLOTS`), and the sessions that want a slot of its kind and have none (`WAITING`):
  requests a router holds back for want of a target slot, or sessions that draft without a draft replica. Routers
  report those to the registry (`deployments.discovery.WorkerFollower`); each replica reports their sum.
- `SessionLoad`, the policy that Serve's controller runs for the deployment, wants
  (held + waiting) / target_sessions_per_replica replicas. Serve averages each report over `look_back_period_s`,
  waits `upscale_delay_s` / `downscale_delay_s` before acting on the count, and keeps it within
  [min_replicas, max_replicas].

A replica that Serve stops drains: it refuses new sessions (the router then places them elsewhere) and finishes
those it holds, for up to `drain_timeout_s` (`deployments.worker_deployments._Worker.__del__`).

Serve pickles this module by value into its controller: it imports nothing from this project at run time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

    from deployments.serve_config import Placement

SESSIONS = "specdec_sessions_held"
SLOTS = "specdec_kv_slots"
WAITING = "specdec_sessions_waiting"
DEFAULT_UTILIZATION = 0.75  # the share of its slots a replica should hold when no target is configured
STOP_MARGIN_S = 15.0  # beyond the drain: unregistering and stopping the gRPC server, before Serve kills the replica
# Serve waits for a stopping replica's Serve requests in steps of this before it calls the replica's shutdown (the
# drain). Workers get none (routers call them over gRPC): the wait only delays the drain, taking new sessions
# meanwhile (2 s by default).
SERVE_WAIT_LOOP_S = 0.2


def load_report(held: int, slots: int, waiting: int) -> dict[str, float]:
    """What a worker replica reports to Serve (`record_autoscaling_stats`)."""
    return {SESSIONS: float(held), SLOTS: float(slots), WAITING: float(waiting)}


def desired_replicas(
    held: list[float], slots: list[float], waiting: float, target_sessions_per_replica: float | None
) -> float:
    """Replicas for the load: the sessions held (one figure per replica) and those waiting for a slot (one figure for
    the deployment), at `target_sessions_per_replica` each (None: `DEFAULT_UTILIZATION` of a replica's slots)."""
    target = target_sessions_per_replica
    if target is None:
        target = DEFAULT_UTILIZATION * (sum(slots) / len(slots)) if slots else 1.0
    return (sum(held) + waiting) / max(target, 1e-9)


class SessionLoad:
    """Serve's autoscaling policy for a worker deployment (`autoscaling_config.policy`, instantiated once by Serve
    with `policy_kwargs`). Returns the replicas the load wants; Serve applies the delays and bounds."""

    def __init__(self, target_sessions_per_replica: float | None = None) -> None:
        self.target_sessions_per_replica = target_sessions_per_replica

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        metrics: Mapping[str, Mapping[Any, float]] = ctx.aggregated_metrics or {}
        held = metrics.get(SESSIONS, {})
        if not held:  # no replica has reported yet: keep what there is
            return ctx.target_num_replicas, {}
        # Every replica reports the routers' one sum (each sampled at its own times): the largest, not their total.
        waiting = max(metrics.get(WAITING, {}).values(), default=0.0)
        desired = desired_replicas(
            list(held.values()), list(metrics.get(SLOTS, {}).values()), waiting, self.target_sessions_per_replica
        )
        # Rounded up here, past the float noise of time-weighted means: 2 sessions of 2 per replica is 1 replica
        # even where the means sum to 2.0000000000000004.
        return math.ceil(desired - 1e-6), {}


def serve_options(placement: Placement) -> dict[str, Any]:
    """A worker deployment's Serve options for its replica count (fixed, or autoscaled by `SessionLoad`) and for
    stopping a replica (Serve kills it once the drain and the margin are past)."""
    options: dict[str, Any] = {
        "graceful_shutdown_timeout_s": placement.drain_timeout_s + STOP_MARGIN_S,
        "graceful_shutdown_wait_loop_s": SERVE_WAIT_LOOP_S,
    }
    scaling = placement.autoscaling
    if scaling is None:
        return {**options, "num_replicas": placement.num_replicas}
    config: dict[str, Any] = {
        "min_replicas": scaling.min_replicas,
        "max_replicas": scaling.max_replicas,
        "initial_replicas": placement.initial_replicas,
        "upscale_delay_s": scaling.upscale_delay_s,
        "downscale_delay_s": scaling.downscale_delay_s,
        "look_back_period_s": scaling.look_back_period_s,
        "policy": {
            "policy_function": f"{__name__}:SessionLoad",
            "policy_kwargs": {"target_sessions_per_replica": scaling.target_sessions_per_replica},
        },
    }
    if scaling.metrics_interval_s is not None:
        config["metrics_interval_s"] = scaling.metrics_interval_s
    return {**options, "autoscaling_config": config}
