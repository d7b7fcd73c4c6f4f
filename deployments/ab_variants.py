"""The A/B test of draft variants in a router: which variant each request drafts with, and demotion.

A request is assigned a variant when it arrives, by weight, or the one it pins (`draft_variant`), and keeps it for
its life (`VariantDrafter` sends every call about it to that variant). Each router keeps a window of every
variant's recent rounds (`specdec_core.watch`); a variant that does worse than the control by the configured margin
over several checks in a row is demoted: its weight goes to 0 (requests may still pin it), which is logged and
counted. Nothing promotes it back but the config (a new `weight` in a Serve config update).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

from deployments.prometheus import WatchMetrics
from deployments.replica_pool import ReplicaPool
from deployments.serve_config import DEFAULT_VARIANT, Demotion, DraftVariant, ServeConfig
from specdec_core.drafters.variants import VariantDrafter
from specdec_core.engine import SpecEngine
from specdec_core.errors import InvalidArgument
from specdec_core.outputs import RoundInfo
from specdec_core.watch import AcceptanceWatch, RoundSample, WindowSnapshot

log = logging.getLogger("ray.serve")


class VariantTable:
    """The variants' names and current weights; thread-safe (requests arrive on the event loop, checks run on a
    thread of their own)."""

    def __init__(self, variants: Sequence[DraftVariant], control: str, rng: random.Random | None = None) -> None:
        self.names = tuple(v.name for v in variants)
        self.control = control
        self._weights = {v.name: v.weight for v in variants}
        self._rng = rng or random.Random()
        self._lock = threading.Lock()

    def weights(self) -> dict[str, float]:
        with self._lock:
            return dict(self._weights)

    def assign(self, pinned: str | None = None) -> str:
        """The variant of a new request: `pinned` if it names one (any weight, 0 included), else one drawn by
        weight. An unknown name is INVALID_ARGUMENT naming `draft_variant` and the choices."""
        if pinned:
            if pinned not in self._weights:
                raise InvalidArgument(
                    "draft_variant", f"no draft variant {pinned!r}; choose one of {', '.join(self.names)}"
                )
            return pinned
        with self._lock:
            names = [n for n in self.names if self._weights[n] > 0]
            weights = [self._weights[n] for n in names]
            if not names:  # every variant demoted by hand (weights 0): the control carries on
                return self.control
            return self._rng.choices(names, weights)[0]

    def demote(self, name: str) -> bool:
        """Weight to 0; False if it had none already."""
        with self._lock:
            if self._weights.get(name, 0) <= 0:
                return False
            self._weights[name] = 0.0
            return True

    def set_weights(self, weights: dict[str, float]) -> None:
        """The config's weights (a Serve config update): the only way back for a demoted variant."""
        with self._lock:
            self._weights.update({n: float(w) for n, w in weights.items() if n in self._weights})


@dataclass(frozen=True)
class Verdict:
    worse: bool  # below the control by more than the margin, on the configured metric
    why: str  # what was compared, for the log


def judge(variant: WindowSnapshot | None, control: WindowSnapshot | None, rule: Demotion) -> Verdict | None:
    """Compare `variant` with `control` over their windows; None when either has too few rounds (or no figure) to
    judge."""
    if variant is None or control is None or min(variant.rounds, control.rounds) < rule.min_rounds:
        return None
    floor = 1.0 - rule.margin
    checks = []
    if rule.metric in ("acceptance", "either"):
        checks.append(("acceptance", variant.acceptance_rate, control.acceptance_rate))
    if rule.metric in ("tokens_per_second", "either"):
        checks.append(("speculative tokens/s", variant.speculative_tokens_per_s, control.speculative_tokens_per_s))
    judged = [(what, mine, theirs) for what, mine, theirs in checks if mine is not None and theirs]
    if not judged:
        return None
    for what, mine, theirs in judged:
        if mine < floor * theirs:
            return Verdict(True, f"{what} {mine:.3g} < {floor:.2f} x control's {theirs:.3g}")
    return Verdict(False, "; ".join(f"{what} {mine:.3g} vs control's {theirs:.3g}" for what, mine, theirs in judged))


class Demoter:
    """Runs `judge` for every variant but the control at each check, and demotes one that was worse at
    `consecutive_checks` checks in a row."""

    def __init__(self, table: VariantTable, rule: Demotion) -> None:
        self.table = table
        self.rule = rule
        self._strikes: dict[str, int] = {}

    def check(self, snapshots: dict[str, WindowSnapshot | None]) -> list[str]:
        """The variants demoted by this check."""
        demoted = []
        control = snapshots.get(self.table.control)
        weights = self.table.weights()
        for name in self.table.names:
            if name == self.table.control or weights.get(name, 0) <= 0:
                self._strikes.pop(name, None)
                continue
            verdict = judge(snapshots.get(name), control, self.rule)
            if verdict is None:
                continue  # too few rounds: neither a strike nor a pardon
            strikes = self._strikes[name] = self._strikes.get(name, 0) + 1 if verdict.worse else 0
            if strikes >= self.rule.consecutive_checks and self.table.demote(name):
                log.warning(
                    "draft variant %s demoted (weight 0) after %d checks below the control %s: %s",
                    name,
                    strikes,
                    self.table.control,
                    verdict.why,
                )
                self._strikes.pop(name, None)
                demoted.append(name)
        return demoted


EXPORT_INTERVAL_S = 10.0  # how often a router exports its windows (Prometheus scrapes every 15-60 s)
DEFAULT_WINDOW_ROUNDS = 1024  # the watch's window without a demotion rule


class ABTest:
    """A router's side of the draft variants: assignment, the watch over their rounds, its gauges, demotion.
    A config with one `draft` has one variant, "default", watched alike (its gauges feed the alerts)."""

    def __init__(self, cfg: ServeConfig, engine: SpecEngine, draft_pools: dict[str, ReplicaPool]) -> None:
        self.single = cfg.drafts is None
        self.variants = {v.name: v for v in cfg.variants}
        self.table = VariantTable(cfg.variants, cfg.control_variant.name)
        self.drafter = engine.drafter if isinstance(engine.drafter, VariantDrafter) else None
        rule = cfg.ab.demotion
        window = rule.window_rounds if rule is not None else DEFAULT_WINDOW_ROUNDS
        self.watch = AcceptanceWatch(window_rounds=window, max_positions=cfg.draft.max_speculative_tokens)
        self.demoter = Demoter(self.table, rule) if rule is not None else None
        self.metrics = WatchMetrics(cfg.target.model, cfg.draft.label)
        self._engine = engine
        self._pools = draft_pools
        self._interval = min(EXPORT_INTERVAL_S, rule.check_interval_s) if rule is not None else EXPORT_INTERVAL_S
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draft-variants", daemon=True)
        self._thread.start()

    def reconfigure(self, cfg: ServeConfig) -> None:
        """A config update (`Router.reconfigure`): the variants' models, and their configured weights again."""
        self.variants = {v.name: v for v in cfg.variants}
        self.table.set_weights({v.name: v.weight for v in cfg.variants})

    # -- requests (the event loop, then the engine thread) ------------------------------------------------------

    def assign(self, pinned: str | None) -> str:
        """The variant a new request drafts with: `pinned` (checked), else one by weight."""
        if self.single:
            if pinned and pinned != DEFAULT_VARIANT:
                raise InvalidArgument(
                    "draft_variant", f"no draft variant {pinned!r}: this server runs one draft, {DEFAULT_VARIANT!r}"
                )
            return DEFAULT_VARIANT
        return self.table.assign(pinned)

    def start(self, seq_id: str, variant: str) -> None:
        if self.drafter is not None:
            self.drafter.assign(seq_id, variant)

    def end(self, seq_id: str) -> None:
        """On the engine thread, after the request's last round (and any abort)."""
        if self.drafter is not None:
            self.drafter.forget(seq_id)

    def observe(self, variant: str, info: RoundInfo, committed: int) -> None:
        """On the engine thread, for every round's output: never raises (the output must reach its request)."""
        try:
            self.watch.record(
                RoundSample(
                    variant=variant,
                    k=info.k,
                    proposed=len(info.proposed_token_ids),
                    accepted=info.num_accepted,
                    committed=committed,
                    seconds=info.seconds,
                )
            )
        except Exception:
            log.warning("a round could not be recorded in the watch", exc_info=True)

    def describe(self) -> list[dict]:
        """The variants, for GetModelInfo."""
        weights = self.table.weights()
        return [
            {
                "name": v.name,
                "method": v.method,
                "model": (v.model or "") if v.runs_draft_model else "",
                "weight": weights[v.name],
                "control": v.name == self.table.control,
            }
            for v in self.variants.values()
        ]

    # -- the watch (a thread of its own) ----------------------------------------------------------------------

    def tick(self) -> list[str]:
        """Export every variant's window and run the demotion check; the variants demoted."""
        weights = self.table.weights()
        snapshots = {name: self._snapshot(name) for name in self.variants}
        for name, snapshot in snapshots.items():
            pool = self._pools.get(name)
            if snapshot is not None:
                self.metrics.export(
                    snapshot, None if pool is None else sum(r.usable for r in pool.replicas), weights[name]
                )
        demoted = self.demoter.check(snapshots) if self.demoter is not None else []
        for name in demoted:
            self.metrics.demoted(name)
        return demoted

    def _snapshot(self, name: str) -> WindowSnapshot | None:
        """The window, with plain decoding's rate from the calibrated costs where the window had no plain round."""
        snapshot = self.watch.snapshot(name)
        if snapshot is not None and snapshot.plain_tokens_per_s is None:
            step = self._engine.costs.verify_cost(1, 1)
            if step:
                snapshot = replace(snapshot, plain_tokens_per_s=1.0 / step)
        return snapshot

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.tick()
            except Exception:  # the watch must never take the router down
                log.warning("the draft variants' watch failed", exc_info=True)

    def close(self) -> None:
        self._stop.set()
