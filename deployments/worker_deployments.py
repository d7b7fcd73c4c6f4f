"""The worker deployments' classes: a target worker and a draft worker per replica, each serving its model's internal
gRPC service (`deployments.workers`) and registering its address where routers find it (`deployments.worker_registry`).

Plain classes: `deployments.app` makes them Serve deployments, with the resources and options of the config.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import ray
from ray import serve

from deployments import autoscaling, swap, worker_registry
from deployments.compute_thread import ComputeThread
from deployments.niceness import checked_niceness
from deployments.prometheus import WorkerMetrics
from deployments.serve_config import DraftConfig, Placement, ServeConfig, TargetConfig, parse_config, runner_graphs
from deployments.telemetry import setup_tracing
from deployments.tls import Role
from deployments.worker_registry import draft_kind
from deployments.workers import DraftServicer, TargetServicer, start_server
from specdec_core.build import prepare_draft, prepare_model
from specdec_core.drafters.base import DraftContext
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.grammar.compiler import NoGrammars, grammar_compiler
from specdec_core.hardware import pin_process, use_threads, worker_summary
from specdec_core.kernels.report import kernel_path
from specdec_core.models.loader import load_tokenizer
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.target import LocalTarget

log = logging.getLogger(__name__)
# What a replica must show at start goes through Serve's logger: into the replica's log file and the console of
# `specdec serve`. (Module loggers stay under the root's WARNING level in Ray's worker processes.)
serve_log = logging.getLogger("ray.serve")


def _runner_config(config: ServeConfig, placement: TargetConfig | DraftConfig) -> RunnerConfig:
    return RunnerConfig(
        num_slots=placement.max_sequences,
        max_seq_len=config.router.max_seq_len,
        max_extend=config.draft.max_speculative_tokens + 1,
        max_cache_bytes=placement.kv_cache_max_bytes,
        prefix_caching=config.prefix_caching,
        cuda_graphs=runner_graphs(placement),
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
        credentials = worker_registry.credentials(config.app_name, Role.SERVER, config.tls_setting)
        self.server, port = start_server(servicer, port=config.worker_grpc_port, credentials=credentials)
        self.address = f"{ray.util.get_node_ip_address()}:{port}"
        self.app = config.app_name
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._registry = worker_registry.registry()
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
            serve_log.warning(
                "%s worker %s stops with %d sessions still held after %.0f s of draining",
                self.kind,
                self.replica_id,
                self.servicer.active_sessions,
                self.drain_timeout_s,
            )
        elif held:
            serve_log.info("%s worker %s drained %d sessions", self.kind, self.replica_id, held)
        self._stop_metrics.set()
        self.servicer.close()
        self.server.stop(grace=2)


class TargetWorker(_Worker):
    kind = "target"

    def __init__(self, config: dict[str, Any]) -> None:
        cfg = parse_config(config)
        compute = ComputeThread("target-compute")  # the model is loaded where it runs (`compute_thread`)
        target = compute.run(self._load, cfg)
        self._serve(cfg, cfg.target, TargetServicer(target, cfg.target.model, cfg.session_idle_timeout_s, compute))

    def _load(self, cfg: ServeConfig) -> Any:
        t = cfg.target
        # Ray starts workers with OMP_NUM_THREADS=1, and its num_cpus reservation pins no cores: set the threads.
        if t.cpu_affinity is not None:
            pin_process(t.cpu_affinity)
        threads, cores = use_threads(t.threads, share=t.tensor_parallel_size)
        if t.tensor_parallel_size > 1:
            from deployments.tensor_parallel import TensorParallelTarget

            target: Any = TensorParallelTarget(
                t.model,
                t.dtype,
                t.device,
                t.tensor_parallel_size,
                _runner_config(cfg, t),
                t.num_cpus,
                t.num_gpus,
                cfg.router.rpc_timeout_s,
                t.resources,
                threads=t.threads,
                env=t.rank_environment,
            )
        else:
            loaded = prepare_model(t.model, dtype=t.dtype, device=t.device)
            target = LocalTarget(ModelRunner(loaded.model, _runner_config(cfg, t)))
        who = self.kind if t.tensor_parallel_size == 1 else f"{self.kind} rank 0"
        serve_log.info("%s", worker_summary(who, threads, cores, kernel_path(target.runner.model), checked_niceness()))
        return target

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
        self.compute = ComputeThread(f"{self.kind}-compute")  # the model is loaded where it runs (`compute_thread`)
        if self.draft.cpu_affinity is not None:
            self.compute.run(pin_process, self.draft.cpu_affinity)
        self.threads, self.cores = self.compute.run(use_threads, self.draft.threads)
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
        return self.compute.run(self._load_here, model)

    def _load_here(self, model: str) -> DraftModelDrafter:
        draft = self.draft
        # Refuses a mismatched pair.
        loaded = prepare_draft(
            model,
            self.target.tokenizer,
            dtype=draft.dtype,
            device=draft.device,
            quantization=draft.quantization,
            vocabulary=draft.vocabulary,
        )
        kernels = kernel_path(loaded.model)
        serve_log.info(
            "%s", worker_summary(f"{self.kind} {model}", self.threads, self.cores, kernels, checked_niceness())
        )
        runner = ModelRunner(loaded.model, _runner_config(self.cfg, draft))
        return draft.drafting.build(DraftContext(draft.spec, self.target_vocab, runner))

    def _start(self, model: str) -> None:
        # The router's engine compiles for the same tokenizer, vocabulary and eos: the draft's masks are the target's.
        # Structured output is optional: a tokenizer the grammar engine cannot read leaves it unavailable, not the
        # worker down (Serve would restart it, to fail again, forever).
        grammars = grammar_compiler(self.target.tokenizer, self.target_vocab, sorted(self.target.eos_token_ids))
        if isinstance(grammars, NoGrammars):
            serve_log.warning("draft worker %s: structured requests are refused: %s", self.kind, grammars.why)
        servicer = DraftServicer(self._load(model), model, self.cfg.session_idle_timeout_s, grammars, self.compute)
        self._serve(self.cfg, self.draft, servicer)

    def _swap(self, model: str) -> None:
        old = self.servicer.model_name
        try:
            drafter = self._load(model)
        except Exception as exc:
            serve_log.error(
                "draft worker %s keeps serving %s: swapping in %s failed: %s",
                self.replica_id,
                old,
                model,
                exc,
                exc_info=True,
            )
            return
        held = self.servicer.active_sessions
        self.servicer.swap(drafter, model)
        self._metrics.serve_model(model)
        serve_log.info(
            "draft worker %s swapped %s for %s: new sessions draft with it, the %d held finish on the old one",
            self.replica_id,
            old,
            model,
            held,
        )


def _target_vocab_size(target: Any) -> int:
    """The target's embedding rows (may exceed the tokenizer: q must cover every id the target scores)."""
    return int(target.hf_config.get("vocab_size") or len(target.tokenizer))
