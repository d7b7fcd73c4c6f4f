"""The router's metrics, exported through Ray's metrics pipeline (Prometheus format, prefixed `ray_`).

Latency histograms are named after OpenTelemetry's gen_ai.server.* metrics; what is particular to speculative
decoding is under specdec_*. Every series carries the model pair (`target`, `draft`) so that pairs compare.
The draft and verify latencies are observed by the remote drafter and target (`deployments.remote_drafter`,
`deployments.remote_target`), once per batched call, with the same measurement the round spans carry as draft_ms /
verify_ms.

The workers export their prefix caches' counters (`WorkerMetrics`), read from their runners every few seconds.
The router exports its online watch of each draft variant (`WatchMetrics`): the alert rules in
k8s/monitoring/specdec-alerts.yaml read those gauges (docs/observability.md#alerts).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from deployments.status import status_of
from specdec_core.stopping import FinishReason
from specdec_core.watch import WindowSnapshot

_LATENCY_S = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120]
_PER_TOKEN_S = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2]
_CALL_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]
_RATE = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]
_TOKENS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16]
_PAIR = ("target", "draft")
REFUSED = "refused"  # `finish_reason` of a request refused before the engine took it


NO_VARIANT = "none"  # the `variant` of a request refused before it was assigned one


class ServingMetrics:
    def __init__(self, target: str, draft: str) -> None:
        self._tags = {"target": target, "draft": draft, "variant": NO_VARIANT}
        # Every request once, when it ends: `finish_reason` the engine's (length, eos, stop, cancelled, error), or
        # "refused" for one refused before the engine took it (a limit, admission, bad input, authentication) and
        # "error" for one a raised error ended later (a deadline); `code`, the status its client got, says why.
        self.requests = Counter(
            "specdec_requests",
            "Requests by finish reason and status code.",
            tag_keys=(*_PAIR, "variant", "finish_reason", "code"),
        )
        self.ttft = Histogram(
            "gen_ai_server_time_to_first_token",
            "Seconds to the first output token.",
            boundaries=_LATENCY_S,
            tag_keys=_PAIR,
        )
        self.tpot = Histogram(
            "gen_ai_server_time_per_output_token",
            "Seconds per output token after the first.",
            boundaries=_PER_TOKEN_S,
            tag_keys=_PAIR,
        )
        self.duration = Histogram(
            "gen_ai_server_request_duration", "Seconds per request.", boundaries=_LATENCY_S, tag_keys=_PAIR
        )
        self.acceptance = Histogram(
            "specdec_acceptance_rate",
            "Accepted / proposed draft tokens per request.",
            boundaries=_RATE,
            tag_keys=(*_PAIR, "variant"),
        )
        self.accepted_per_round = Histogram(
            "specdec_accepted_tokens_per_round",
            "Draft tokens accepted per round.",
            boundaries=[0.5, *_TOKENS],
            tag_keys=(*_PAIR, "variant", "method"),
        )
        # By the method that proposed (hybrid drafting switches per request and round): acceptance per method is
        # accepted / proposed of these counters.
        self.proposed = Counter(
            "specdec_proposed_tokens",
            "Draft tokens proposed, by drafting method.",
            tag_keys=(*_PAIR, "variant", "method"),
        )
        self.accepted = Counter(
            "specdec_accepted_tokens",
            "Draft tokens accepted, by drafting method.",
            tag_keys=(*_PAIR, "variant", "method"),
        )
        self.k = Histogram(
            "specdec_speculation_length",
            "k chosen per round.",
            boundaries=[0.5, *_TOKENS],
            tag_keys=(*_PAIR, "variant"),
        )
        self.draft_latency = Histogram(
            "specdec_draft_latency_seconds",
            "Seconds per batched draft call (all k steps) of a round.",
            boundaries=_CALL_S,
            tag_keys=_PAIR,
        )
        self.verify_latency = Histogram(
            "specdec_verify_latency_seconds",
            "Seconds per batched verify call of a round.",
            boundaries=_CALL_S,
            tag_keys=_PAIR,
        )
        # Pre-drafting (draft.overlap): the hit rate is rate(specdec_predraft_hits) / rate(specdec_predraft_branches).
        self.branches = Counter(
            "specdec_predraft_branches",
            "Branches pre-drafted during a verify for the round after it (draft.overlap).",
            tag_keys=(*_PAIR, "variant"),
        )
        self.predraft_hits = Counter(
            "specdec_predraft_hits",
            "Rounds that verified a pre-drafted branch the round before confirmed, without drafting.",
            tag_keys=(*_PAIR, "variant"),
        )
        self.split_drafted = Counter(
            "specdec_split_drafted_rounds",
            "Rounds that verified a proposal drafted while the other group of a split batch was verified.",
            tag_keys=(*_PAIR, "variant"),
        )
        self.fallbacks = Counter(
            "specdec_target_only_rounds",
            "Rounds that asked for drafts (k > 0) and got none (no draft replica held the "
            "session, or the drafter failed).",
            tag_keys=(*_PAIR, "variant"),
        )
        self.slots = Gauge(
            "specdec_kv_slots_in_use",
            "Sessions this router holds in the workers' KV caches.",
            tag_keys=(*_PAIR, "worker"),
        )
        self._metrics = (
            self.requests,
            self.ttft,
            self.tpot,
            self.duration,
            self.acceptance,
            self.accepted_per_round,
            self.proposed,
            self.accepted,
            self.k,
            self.draft_latency,
            self.verify_latency,
            self.fallbacks,
            self.branches,
            self.predraft_hits,
            self.split_drafted,
            self.slots,
        )
        self._set_tags()

    def set_draft(self, draft: str) -> None:
        """Label what is observed from now on with `draft` (a hot swap of the draft model)."""
        self._tags = {**self._tags, "draft": draft}
        self._set_tags()

    def _set_tags(self) -> None:
        for metric in self._metrics:  # each takes the tags it has keys for (`variant`: the request's own metrics)
            metric.set_default_tags({key: value for key, value in self._tags.items() if key in metric._tag_keys})

    def round(
        self,
        k: int,
        proposed: int,
        accepted: int,
        method: str | None = None,
        variant: str = NO_VARIANT,
        predrafted: bool = False,
        branched: bool = False,
        split: bool = False,
    ) -> None:
        """`k` chosen, `proposed` drafts made by `method` (none for k > 0: a fallback, where no draft replica held
        the session; k = 0 is plain decoding, chosen by the request or by `auto`, not a fallback), for a request
        drafting with `variant`; `predrafted`: they were a branch pre-drafted the round before; `branched`: a
        branch for the next round was pre-drafted during this one; `split`: they were drafted while the other group
        of a split batch was verified."""
        self.k.observe(k, tags={"variant": variant})
        if branched:
            self.branches.inc(tags={"variant": variant})
        if predrafted:
            self.predraft_hits.inc(tags={"variant": variant})
        if split:
            self.split_drafted.inc(tags={"variant": variant})
        if proposed > 0:
            tags = {"method": method or "unknown", "variant": variant}
            self.accepted_per_round.observe(accepted, tags=tags)
            self.proposed.inc(proposed, tags=tags)
            if accepted:
                self.accepted.inc(accepted, tags=tags)
        elif k > 0:
            self.fallbacks.inc(tags={"variant": variant})

    def finished(self, output: Any, start: float, first_token: float | None, variant: str = NO_VARIANT) -> None:
        now = time.monotonic()
        self.requests.inc(
            tags={"finish_reason": output.finish_reason.value, "code": _code_of_output(output), "variant": variant}
        )
        self.duration.observe(now - start)
        if first_token is not None:
            self.ttft.observe(first_token - start)
            if output.num_output_tokens > 1:
                self.tpot.observe((now - first_token) / (output.num_output_tokens - 1))
        if output.stats.proposed:
            self.acceptance.observe(output.stats.accepted / output.stats.proposed, tags={"variant": variant})

    def ended_with(self, error: BaseException, ran: bool) -> None:
        """A request ended by `error` rather than by a final output: refused, unless the engine had `ran` it (or its
        client cancelled it first)."""
        if isinstance(error, asyncio.CancelledError):
            self.requests.inc(tags={"finish_reason": FinishReason.CANCELLED.value, "code": "cancelled"})
        else:
            self.requests.inc(tags={"finish_reason": "error" if ran else REFUSED, "code": _code(error)})

    def slots_in_use(self, worker: str, count: int) -> None:
        self.slots.set(count, tags={"worker": worker})


def _code(error: BaseException) -> str:
    """The status a client gets for `error`, as the `code` label spells it: gRPC's name in lower case."""
    return status_of(error).grpc.name.lower()


def _code_of_output(output: Any) -> str:
    if output.finish_reason is FinishReason.ERROR:
        return _code(output.error) if output.error is not None else "internal"
    return "cancelled" if output.finish_reason is FinishReason.CANCELLED else "ok"


class WorkerMetrics:
    """A worker replica's prefix cache, tagged by `worker` (target or draft) and `model`. The counters follow the
    worker's own (`WorkerStats`): `update` adds what they gained since the last call."""

    def __init__(self, worker: str, model: str) -> None:
        tags = ("worker", "model")
        self.queried = Counter(
            "specdec_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache (all a cache could have supplied).",
            tag_keys=tags,
        )
        self.hits = Counter(
            "specdec_prefix_cache_hit_tokens",
            "Prompt tokens found in the prefix cache: reused, not computed.",
            tag_keys=tags,
        )
        self.evictions = Counter(
            "specdec_prefix_cache_evictions",
            "Prefix-cache entries evicted to make room for new sequences.",
            tag_keys=tags,
        )
        self.bytes = Gauge(
            "specdec_prefix_cache_bytes", "KV bytes held by prefix-cache entries (ended sequences).", tag_keys=tags
        )
        self.entries = Gauge(
            "specdec_prefix_cache_entries", "Prefix-cache entries held (ended sequences).", tag_keys=tags
        )
        self.worker = worker
        self.serve_model(model)

    def serve_model(self, model: str) -> None:
        """Tag what follows with `model`, whose worker's counters start from zero (a hot swap's new runner)."""
        for metric in (self.queried, self.hits, self.evictions, self.bytes, self.entries):
            metric.set_default_tags({"worker": self.worker, "model": model})
        self._last = (0, 0, 0)

    def update(self, stats: Any) -> None:
        """`stats`: the worker's `WorkerStats`."""
        now = (stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens, stats.prefix_cache_evictions)
        for counter, new, old in zip((self.queried, self.hits, self.evictions), now, self._last):
            if new > old:  # a Ray counter takes only positive increments
                counter.inc(new - old)
        self._last = now
        self.bytes.set(stats.prefix_cache_bytes)
        self.entries.set(stats.prefix_cache_entries)


class WatchMetrics:
    """The router's online watch (`specdec_core.watch`), per draft variant: each `export` sets the gauges from one
    variant's window (its last N rounds, the watch's `window_rounds`), tagged `variant` besides the pair.

    A field the window cannot tell (None: no proposals, no plain rounds in it) leaves its gauge unset: it keeps the
    value it last had, or stays absent. Position gauges are tagged `position` "1".."16".
    The alert rules read these by name: a rename here must change k8s/monitoring/specdec-alerts.yaml too.
    """

    def __init__(self, target: str, draft: str) -> None:
        tags = (*_PAIR, "variant")
        self.acceptance = Gauge(
            "specdec_draft_window_acceptance_rate",
            "Accepted / proposed draft tokens over the variant's window of rounds.",
            tag_keys=tags,
        )
        self.position_acceptance = Gauge(
            "specdec_draft_window_position_acceptance_rate",
            "Acceptance at a draft position, given the drafts before it were accepted, over the variant's window.",
            tag_keys=(*tags, "position"),
        )
        self.tokens_per_round = Gauge(
            "specdec_draft_window_tokens_per_round",
            "Tokens committed per speculative round (k > 0) over the variant's window.",
            tag_keys=tags,
        )
        self.speculative_rate = Gauge(
            "specdec_draft_window_speculative_tokens_per_second",
            "Tokens per second per sequence in speculative rounds over the variant's window.",
            tag_keys=tags,
        )
        self.plain_rate = Gauge(
            "specdec_draft_window_plain_tokens_per_second",
            "Tokens per second per sequence of plain decoding (k = 0), measured or estimated.",
            tag_keys=tags,
        )
        self.replicas = Gauge(
            "specdec_draft_replicas", "Draft replicas this router can reach for the variant.", tag_keys=tags
        )
        self.weight = Gauge("specdec_draft_variant_weight", "The variant's share of new requests.", tag_keys=tags)
        self.demotions = Counter(
            "specdec_draft_variant_demotions",
            "Times the variant was demoted (its weight cut for doing worse than the others).",
            tag_keys=tags,
        )
        for metric in (
            self.acceptance,
            self.position_acceptance,
            self.tokens_per_round,
            self.speculative_rate,
            self.plain_rate,
            self.replicas,
            self.weight,
            self.demotions,
        ):
            metric.set_default_tags({"target": target, "draft": draft})

    def export(self, snapshot: WindowSnapshot, replicas: int | None, weight: float) -> None:
        """Sets the variant's gauges from `snapshot`; `replicas` None for a variant that needs no draft model."""
        variant = {"variant": snapshot.variant}
        for gauge, value in (
            (self.acceptance, snapshot.acceptance_rate),
            (self.tokens_per_round, snapshot.tokens_per_round),
            (self.speculative_rate, snapshot.speculative_tokens_per_s),
            (self.plain_rate, snapshot.plain_tokens_per_s),
            (self.replicas, replicas),
            (self.weight, weight),
        ):
            if value is not None:
                gauge.set(value, tags=variant)
        for position, rate in enumerate(snapshot.position_acceptance, start=1):
            if rate is not None:
                self.position_acceptance.set(rate, tags={**variant, "position": str(position)})

    def demoted(self, variant: str) -> None:
        self.demotions.inc(tags={"variant": variant})
