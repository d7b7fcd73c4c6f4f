"""A tensor-parallel target: one TargetWorker replica spanning N ranks (Ray actors in one placement group).

The replica's own process is rank 0: it serves the internal gRPC service, as an unsplit target worker does. Ranks
1..N-1 are actors it creates in the replica's placement group (one bundle per rank, reserved together by Serve and
placed by `target.placement_strategy`: on one node, or across nodes).
All ranks join one torch.distributed process group (gloo on CPU, NCCL on CUDA) and hold their shard of the model
(`specdec_core.parallel`) and of every session's KV cache.

Each call (prefill, verify, release) goes to every rank with the same arguments: the ranks run the same forward,
meeting in its all-reduces, and then the same acceptance on the same (replicated) logits with the same uniforms,
so their caches advance and roll back together with no further messages. Prefix caching decides alike too: each
rank's index sees the same calls in the same order (releases included: an actor runs a caller's calls in order)
and breaks ties by that order alone, never by time, so every rank reuses the same prefix, evicts the same entry
and copies its own shard of the same positions. Rank 0 returns its result and checks that the others agree
(the cached counts included). A rank that dies or stops answering fails the call with `Unavailable` and marks the
replica unhealthy, so Serve replaces it (and the actors it owns) instead of letting requests hang.
"""

from __future__ import annotations

import datetime
import logging
import uuid
from collections.abc import Sequence
from typing import Any

import ray
import torch.distributed as dist
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.niceness import checked_niceness
from deployments.ports import free_port
from specdec_core.build import prepare_model
from specdec_core.errors import Unavailable
from specdec_core.hardware import use_threads, worker_summary
from specdec_core.kernels.report import kernel_path
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.target import LocalTarget, Prefilled, PrefillItem, VerifyItem, VerifyOutcome

log = logging.getLogger(__name__)
serve_log = logging.getLogger("ray.serve")  # shown by Ray in a rank's actor too: its start-up line

RANK_NAME_PREFIX = "specdec-target-rank-"  # actor names: PREFIX<group>-<rank>, for operators and tests


def build_sharded_target(
    model: str,
    dtype: str,
    device: str,
    rank: int,
    world_size: int,
    init_method: str,
    runner_config: RunnerConfig,
    timeout_s: float,
) -> LocalTarget:
    """Join the process group as `rank`, load `model`, keep this rank's shard, and wrap it in a `LocalTarget`."""
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    loaded = prepare_model(model, dtype=dtype, device=device, shard=(rank, world_size))
    return LocalTarget(ModelRunner(loaded.model, runner_config))


@ray.remote
class TargetRank:
    """Rank r > 0 of a tensor-parallel target."""

    def __init__(
        self,
        model: str,
        dtype: str,
        device: str,
        rank: int,
        world_size: int,
        init_method: str,
        runner_config: RunnerConfig,
        threads: int | str,
        timeout_s: float,
    ) -> None:
        # Resolved here, in the rank's own process: its cores are those of the machine it landed on.
        count, cores = use_threads(threads, share=world_size)
        self.target = build_sharded_target(
            model, dtype, device, rank, world_size, init_method, runner_config, timeout_s
        )
        kernels = kernel_path(self.target.runner.model)
        serve_log.info("%s", worker_summary(f"target rank {rank}", count, cores, kernels, checked_niceness()))

    def ready(self) -> bool:
        return True

    def prefill(self, items: Sequence[PrefillItem]) -> list[Prefilled]:
        return self.target.prefill(items)

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyOutcome]:
        return self.target.verify(items)

    def release(self, seq_id: str) -> None:
        self.target.release(seq_id)


class TensorParallelTarget:
    """`Target` over N ranks: rank 0 in this process, the rest as `TargetRank` actors."""

    def __init__(
        self,
        model: str,
        dtype: str,
        device: str,
        world_size: int,
        runner_config: RunnerConfig,
        num_cpus: float,
        num_gpus: float,
        timeout_s: float = 120.0,
        resources: dict[str, float] | None = None,
        threads: int | str = "auto",
        env: dict[str, str] | None = None,
    ) -> None:
        """`num_cpus`, `num_gpus` and `resources`: each rank's, as its bundle in the replica's placement group holds
        them. `env`: environment variables of the ranks (this process, rank 0, already has them: Serve started it
        with the same), e.g. the network interface of their collectives."""
        self.timeout_s = timeout_s
        self.world_size = world_size
        self.healthy = True
        # Rank 0's node address as Ray knows it (`ray start --node-ip-address`): every rank's node must reach it.
        # The collectives' own connections go over the interface that GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
        # name (`env`), else the one the backend picks.
        init_method = f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"
        pg = ray.util.get_current_placement_group()
        group_id = uuid.uuid4().hex[:8]
        self.ranks = []
        for rank in range(1, world_size):
            strategy = None if pg is None else PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
            self.ranks.append(
                TargetRank.options(
                    name=f"{RANK_NAME_PREFIX}{group_id}-{rank}",
                    num_cpus=num_cpus,
                    num_gpus=num_gpus,
                    resources=dict(resources or {}),
                    scheduling_strategy=strategy,
                    runtime_env={"env_vars": dict(env)} if env else None,
                ).remote(model, dtype, device, rank, world_size, init_method, runner_config, threads, timeout_s)
            )
        # Joins the group the actors are waiting in; returns once every rank has joined.
        self.local = build_sharded_target(model, dtype, device, 0, world_size, init_method, runner_config, timeout_s)
        ray.get([r.ready.remote() for r in self.ranks], timeout=timeout_s)
        self.vocab_size = self.local.vocab_size
        self.max_seq_len = self.local.max_seq_len
        self.runner = self.local.runner
        log.info("tensor-parallel target ready: %d ranks", world_size)

    @property
    def free_slots(self) -> int:
        return self.local.free_slots

    def prefill(self, items: Sequence[PrefillItem]) -> list[Prefilled]:
        return self._everywhere("prefill", items)

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyOutcome]:
        return self._everywhere("verify", items)

    def release(self, seq_id: str) -> None:
        self.local.release(seq_id)
        for rank in self.ranks:
            rank.release.remote(seq_id)  # ordered before any later call to that rank

    def _everywhere(self, method: str, items: Sequence[Any]) -> Any:
        if not self.healthy:
            raise Unavailable("target", "a tensor-parallel rank failed; the replica is being replaced")
        pending = [getattr(rank, method).remote(list(items)) for rank in self.ranks]
        try:
            mine = getattr(self.local, method)(items)
            theirs = ray.get(pending, timeout=self.timeout_s)
        except (ray.exceptions.RayError, RuntimeError) as exc:
            self.healthy = False
            raise Unavailable("target", f"a tensor-parallel rank failed during {method}: {exc}") from exc
        if any(other != mine for other in theirs):
            self.healthy = False
            raise Unavailable("target", f"tensor-parallel ranks disagree after {method}")
        return mine
