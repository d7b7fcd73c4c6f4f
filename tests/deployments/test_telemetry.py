"""Tracing: a request span with the GenAI attributes, one span per round, workers' spans in the same trace, a
client's traceparent continued, and spans arriving over the wire at a real OTLP receiver."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from deployments.remote_drafter import RemoteDrafter
from deployments.remote_target import RemoteTarget
from deployments.replica_pool import ReplicaPool
from deployments.telemetry import RequestTracer, context_from_metadata
from deployments.workers import DraftServicer, TargetServicer, start_server
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.config import SamplingParams
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.engine import SpecEngine
from specdec_core.models.loader import load_model
from specdec_core.request import Request
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.target import LocalTarget

EXPORTER = InMemorySpanExporter()
_provider = TracerProvider()
_provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
trace.set_tracer_provider(_provider)  # this test process's global provider: the in-process workers use it

RUNNER = RunnerConfig(num_slots=4, max_seq_len=256, prefix_caching=True)
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"


@pytest.fixture(scope="module")
def stack(tiny_dir, near_draft_dir):
    target = load_model(tiny_dir / "target", dtype="float32")
    draft = load_model(near_draft_dir, dtype="float32")
    t = TargetServicer(LocalTarget(ModelRunner(target.model, RUNNER)), "tiny-target")
    d = DraftServicer(DraftModelDrafter(ModelRunner(draft.model, RUNNER), target.model.vocab_size), "tiny-draft")
    (ts, tport), (ds, dport) = start_server(t, "127.0.0.1"), start_server(d, "127.0.0.1")
    yield target, f"127.0.0.1:{tport}", f"127.0.0.1:{dport}"
    ts.stop(0)
    ds.stop(0)


def run_traced(stack, tracer: RequestTracer, parent=None, max_tokens=20):
    """What the router does for one request: a request span, the engine's rounds, each output observed."""
    target, taddr, daddr = stack
    engine = SpecEngine(
        RemoteTarget(ReplicaPool("target", [taddr], wpb_grpc.TargetServiceStub, 30), tracer),
        RemoteDrafter(ReplicaPool("draft", [daddr], wpb_grpc.DraftServiceStub, 30), tracer),
        target.tokenizer,
        target.eos_token_ids,
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tracer.start_request("s1", params, parent, "client-request-1")
    engine.add_request(Request("s1", tuple(range(5, 25)), params, num_speculative_tokens=3))
    last = None
    while engine.has_work:
        for out in engine.step():
            tracer.observe("s1", out)
            last = out
    return last


def test_a_request_span_and_one_span_per_round_in_one_trace(stack):
    EXPORTER.clear()
    final = run_traced(stack, RequestTracer("tiny-target", "tiny-draft"))
    spans = EXPORTER.get_finished_spans()
    [request] = [s for s in spans if s.name.startswith("text_completion")]
    attrs = request.attributes
    assert attrs["gen_ai.operation.name"] == "text_completion" and attrs["gen_ai.request.model"] == "tiny-target"
    assert attrs["gen_ai.request.max_tokens"] == 20 and attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.usage.input_tokens"] == 20 and attrs["gen_ai.usage.output_tokens"] == 20
    assert list(attrs["gen_ai.response.finish_reasons"]) == ["length"]
    assert attrs["gen_ai.server.time_to_first_token"] > 0
    rounds = sorted((s for s in spans if s.name == "specdec.round"), key=lambda s: s.attributes["specdec.round.index"])
    assert len(rounds) == final.stats.rounds > 0
    assert all(r.parent.span_id == request.context.span_id for r in rounds)
    assert sum(r.attributes["specdec.round.committed"] for r in rounds) == 20 - 1  # the first token: prefill
    assert sum(r.attributes["specdec.round.accepted"] for r in rounds) == final.stats.accepted
    assert all(
        r.attributes["specdec.round.verify_ms"] > 0 and r.attributes["specdec.round.bytes_sent"] > 0 for r in rounds
    )
    workers = [s for s in spans if s.name.startswith("specdec.target.") or s.name.startswith("specdec.draft.")]
    assert {s.name for s in workers} >= {
        "specdec.target.Prefill",
        "specdec.target.Verify",
        "specdec.draft.Start",
        "specdec.draft.Propose",
    }
    trace_id = request.context.trace_id
    assert all(s.context.trace_id == trace_id for s in workers)
    round_ids = {r.context.span_id for r in rounds}
    verifies = [s for s in workers if s.name == "specdec.target.Verify"]
    assert len(verifies) == len(rounds) and all(s.parent.span_id in round_ids for s in verifies)


def test_the_request_span_counts_the_prompt_tokens_read_from_the_cache(stack):
    tracer = RequestTracer("tiny-target", "tiny-draft")
    run_traced(stack, tracer, max_tokens=4)
    EXPORTER.clear()
    final = run_traced(stack, tracer, max_tokens=4)  # the same prompt: all of it but its last token is cached
    [request] = [s for s in EXPORTER.get_finished_spans() if s.name.startswith("text_completion")]
    assert request.attributes["gen_ai.usage.cache_read.input_tokens"] == final.num_cached_tokens == 19
    assert request.attributes["gen_ai.usage.input_tokens"] == 20  # cached tokens are input tokens too


def test_a_clients_traceparent_is_continued(stack):
    EXPORTER.clear()
    parent, _ = context_from_metadata([("traceparent", f"00-{CLIENT_TRACE}-b7ad6b7169203331-01")])
    run_traced(stack, RequestTracer("tiny-target", "tiny-draft"), parent=parent, max_tokens=6)
    spans = EXPORTER.get_finished_spans()
    assert spans and all(f"{s.context.trace_id:032x}" == CLIENT_TRACE for s in spans)


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans = []

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_spans_arrive_at_an_otlp_receiver(stack):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    receiver = _Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True)))
        final = run_traced(
            stack, RequestTracer("tiny-target", "tiny-draft", provider.get_tracer("specdec")), max_tokens=8
        )
        provider.force_flush()
        names = [s.name for s in receiver.spans]
        assert names.count("specdec.round") == final.stats.rounds
        assert sum(n.startswith("text_completion") for n in names) == 1
    finally:
        provider.shutdown()
        server.stop(0)
