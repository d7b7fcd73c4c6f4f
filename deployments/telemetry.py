"""Tracing: a span per request in the router, a child span per round, and the workers' spans in the same trace.

Names and attributes follow OpenTelemetry's GenAI semantic conventions for the request span
(`gen_ai.operation.name`, `gen_ai.request.*`, `gen_ai.usage.*`, `gen_ai.response.finish_reasons`); what is
particular to speculative decoding lives under `specdec.*`. The router's calls to the workers carry the round's
W3C `traceparent` in gRPC metadata, so a worker's span joins the trace; a batched call serves several requests,
so the other requests' round spans are sent as links (`specdec-links`).

Export is configured from the standard OTEL_* environment in every process (the builder passes the environment of
the process that runs `specdec serve` to every deployment): `OTEL_TRACES_EXPORTER` = otlp (the default when an
OTLP endpoint is set) | console | none (the default otherwise), `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_TRACES_SAMPLER`
(and `_ARG`), `OTEL_SERVICE_NAME`. Spans are exported in batches from a background thread: never on a round's path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from specdec_core import environment

TRACER_NAME = "specdec"
LINKS_KEY = "specdec-links"
_propagator = TraceContextTextMapPropagator()
_setup_lock = threading.Lock()
_configured = False


def setup_tracing(default_service_name: str) -> None:
    """Install this process's tracer provider from the OTEL_* environment (once; later calls do nothing)."""
    global _configured
    with _setup_lock:
        if _configured:
            return
        _configured = True
    otel = environment.otel_variables()
    has_endpoint = any(otel.get(k) for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    kind = otel.get("OTEL_TRACES_EXPORTER", "otlp" if has_endpoint else "none").strip().lower()
    if kind == "none":
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if kind == "console":
        exporter: Any = ConsoleSpanExporter()
    elif kind == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    else:
        raise ValueError(f"OTEL_TRACES_EXPORTER={kind!r}: use otlp, console or none")
    resource = Resource.create({"service.name": otel.get("OTEL_SERVICE_NAME", default_service_name)})
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)


def otel_environment() -> dict[str, str]:
    """The OTEL_* variables of this process: handed to every deployment so they all export alike."""
    return environment.otel_variables()


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


# -- propagation --------------------------------------------------------------------------------------------------


def carrier_metadata(spans: Sequence[Span]) -> list[tuple[str, str]]:
    """gRPC metadata for a call made on behalf of `spans`: the first as the parent, the others as links."""
    metadata: list[tuple[str, str]] = []
    if not spans:
        return metadata
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(spans[0]))
    metadata += [(k, v) for k, v in carrier.items()]
    links = []
    for span in spans[1:]:
        link: dict[str, str] = {}
        _propagator.inject(link, context=trace.set_span_in_context(span))
        if "traceparent" in link:
            links.append(link["traceparent"])
    if links:
        metadata.append((LINKS_KEY, ",".join(links)))
    return metadata


def context_from_metadata(metadata: Iterable[tuple[str, str]]) -> tuple[otel_context.Context, list[Link]]:
    """The parent context and the links a call's metadata carries."""
    pairs = {k.lower(): v for k, v in metadata}
    parent = _propagator.extract(pairs)
    links = []
    for traceparent in filter(None, pairs.get(LINKS_KEY, "").split(",")):
        span_context = trace.get_current_span(_propagator.extract({"traceparent": traceparent})).get_span_context()
        if span_context.is_valid:
            links.append(Link(span_context))
    return parent, links


# -- the router's spans -------------------------------------------------------------------------------------------


@dataclass
class _Request:
    span: Span
    start: float
    first_token: float | None = None
    round_span: Span | None = None
    rounds: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    bytes_sent: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    draft_variant: str | None = None  # where the server A/B-tests drafts: on the request's span and each round's


class RequestTracer:
    """The spans of the router's requests and their rounds. Request spans start and end on any thread; rounds are
    opened and closed by the engine thread (the remote drafter and target, then each round's output)."""

    def __init__(self, model: str, draft: str, tracer_: trace.Tracer | None = None) -> None:
        self._tracer = tracer_ or tracer()
        self._model, self._draft = model, draft
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()

    def set_draft(self, draft: str) -> None:
        """Label the requests that start from now on with `draft` (a hot swap of the draft model)."""
        self._draft = draft

    def start_request(
        self,
        seq_id: str,
        params: Any,
        parent: otel_context.Context | None,
        request_id: str,
        draft_variant: str | None = None,
    ) -> None:
        span = self._tracer.start_span(
            "text_completion " + self._model,  # GenAI convention: "{operation} {model}"
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": "text_completion",
                "gen_ai.request.model": self._model,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.request.top_k": params.top_k,
                "gen_ai.request.max_tokens": params.max_tokens,
                **({"gen_ai.request.seed": params.seed} if params.seed is not None else {}),
                "specdec.request_id": request_id,
                "specdec.draft": self._draft,
                **({"specdec.draft_variant": draft_variant} if draft_variant is not None else {}),
            },
        )
        with self._lock:
            self._requests[seq_id] = _Request(span, time.monotonic(), draft_variant=draft_variant)

    def spans(self, seq_ids: Sequence[str], rounds: bool) -> list[Span]:
        """The spans calls for these sequences run under: their open round spans (`rounds`) or request spans."""
        out = []
        with self._lock:
            for sid in seq_ids:
                req = self._requests.get(sid)
                if req is not None:
                    out.append(req.round_span if rounds and req.round_span is not None else req.span)
        return out

    def begin_round(self, seq_ids: Sequence[str]) -> None:
        with self._lock:
            for sid in seq_ids:
                req = self._requests.get(sid)
                if req is None or req.round_span is not None:
                    continue
                req.round_span = self._tracer.start_span(
                    "specdec.round",
                    context=trace.set_span_in_context(req.span),
                    attributes={"specdec.round.index": req.rounds},
                )

    def add_call(self, seq_ids: Sequence[str], phase: str, seconds: float, bytes_by_seq: Sequence[int]) -> None:
        """A draft or verify call of this round took `seconds` and sent each sequence's share of bytes."""
        with self._lock:
            for sid, nbytes in zip(seq_ids, bytes_by_seq):
                req = self._requests.get(sid)
                if req is None:
                    continue
                setattr(req, f"{phase}_ms", getattr(req, f"{phase}_ms") + 1000 * seconds)
                req.bytes_sent += nbytes

    def observe(self, seq_id: str, output: Any) -> None:
        """An engine output for `seq_id`: closes its round span, and its request span when it finished."""
        with self._lock:
            req = self._requests.get(seq_id)
            if req is None:
                return
            if req.first_token is None and output.new_token_ids:
                req.first_token = time.monotonic()
            info = output.round
            if info is not None and req.round_span is not None:
                span = req.round_span
                span.set_attributes(
                    {
                        "specdec.round.k": info.k,
                        "specdec.round.method": info.method or "none",
                        "specdec.round.proposed": len(info.proposed_token_ids),
                        "specdec.round.accepted": info.num_accepted,
                        "specdec.round.bonus": info.bonus,
                        "specdec.round.recovered": not info.bonus,
                        "specdec.round.committed": len(output.new_token_ids),
                        "specdec.round.predrafted": info.predrafted,
                        "specdec.round.branched": info.branched,
                        "specdec.round.split": info.split,
                        "specdec.round.draft_ms": req.draft_ms,
                        "specdec.round.verify_ms": req.verify_ms,
                        "specdec.round.bytes_sent": req.bytes_sent,
                        **({"specdec.round.draft_variant": req.draft_variant} if req.draft_variant is not None else {}),
                    }
                )
                span.end()
                req.round_span, req.draft_ms, req.verify_ms, req.bytes_sent = None, 0.0, 0.0, 0
                req.rounds += 1
            if output.finished:
                self._finish(seq_id, req, output)

    def _finish(self, seq_id: str, req: _Request, output: Any) -> None:
        if req.round_span is not None:
            req.round_span.end()
        span = req.span
        span.set_attributes(
            {
                "gen_ai.usage.input_tokens": output.num_prompt_tokens,
                "gen_ai.usage.output_tokens": output.num_output_tokens,
                "gen_ai.usage.cache_read.input_tokens": output.num_cached_tokens,  # included in input_tokens
                "gen_ai.response.finish_reasons": [output.finish_reason.value],
                "specdec.rounds": output.stats.rounds,
                "specdec.proposed": output.stats.proposed,
                "specdec.accepted": output.stats.accepted,
            }
        )
        if req.first_token is not None:
            span.set_attribute("gen_ai.server.time_to_first_token", req.first_token - req.start)
        if output.error is not None:
            span.set_status(Status(StatusCode.ERROR, str(output.error)))
        span.end()
        del self._requests[seq_id]

    def abandon(self, seq_id: str, error: BaseException) -> None:
        """A request refused before it started."""
        with self._lock:
            req = self._requests.pop(seq_id, None)
        if req is not None:
            req.span.set_status(Status(StatusCode.ERROR, str(error)))
            req.span.end()
