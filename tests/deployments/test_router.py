"""The router's request logic without Ray: a real engine over the tiny models, handed to the router as its parts.

Only the gRPC servicer context is a stand-in (the metadata in, the status out), as grpc.aio hands the handlers
one. The target's verify rounds can be gated, so that a test decides how far a request gets: a cancelled request
is then freed by the cancellation, never by running to its end.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import threading
import time
import types
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from deployments.auth import BearerAuth
from deployments.prometheus import ServingMetrics
from deployments.proposal_log import ProposalLog
from deployments.router import RequestFailed, Router, RouterParts
from deployments.serve_config import parse_config
from deployments.telemetry import RequestTracer
from specdec.v1 import generation_pb2 as pb
from specdec_core.config import SamplingParams
from specdec_core.drafters import registry as methods
from specdec_core.drafters.base import DraftContext
from specdec_core.engine import EngineConfig, SpecEngine
from specdec_core.grammar.constraint import Constraint
from specdec_core.models.loader import LoadedTokenizer, load_tokenizer
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.target import LocalTarget
from tests.helpers import SERVED_SCHEMA, asgi_post, make_engine, run_to_completion, satisfies_served_schema

TOKEN = "router-test-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
PROMPT = list(range(5, 30))
SLOTS = 4
WAIT_S = 60.0  # a bound for what takes milliseconds: reached only when the router is broken


class Context:
    """What the router uses of a gRPC servicer context: the call's metadata in, its status out."""

    def __init__(self, metadata=()) -> None:
        self.metadata = tuple(metadata)
        self.code: grpc.StatusCode | None = None
        self.details: str | None = None

    def invocation_metadata(self):
        return self.metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


class GatedTarget(LocalTarget):
    """The tiny target, whose verify rounds each take a permit when gated: prefills run, rounds wait."""

    def __init__(self, runner: ModelRunner, gated: bool) -> None:
        super().__init__(runner)
        self.gated = gated
        self.permits = threading.Semaphore(0)

    def verify(self, items):
        if self.gated:
            self.permits.acquire()
        return super().verify(items)


@pytest.fixture()
def make_router(tiny_dir, near_draft_dir, pair):
    """make_router(gated=False) -> (router, engine): the service's config for the tiny pair, its drafter built
    through the registry as a router builds an in-process one, and the router over them. `max_seq_len` up to the
    tiny models' 512 positions (a prompt that lists tools takes a few hundred)."""
    routers = []

    def make(
        gated: bool = False,
        prefix_caching: bool = False,
        method: str = "draft_model",
        max_seq_len: int = 256,
        proposals: ProposalLog | None = None,
        **router: Any,
    ) -> tuple[Router, SpecEngine]:
        """`router`: more router config keys."""
        config = parse_config(
            {
                "target": {"model": str(tiny_dir / "target"), "dtype": "float32"},
                "draft": {
                    "method": method,
                    "model": str(near_draft_dir),
                    "dtype": "float32",
                    "num_speculative_tokens": 3,
                },
                "router": {
                    "max_seq_len": max_seq_len,
                    "default_max_tokens": 16,
                    "max_output_tokens": 100,
                    "calibrate": False,
                    **router,
                },
            }
        )
        target, draft = pair
        runner_config = RunnerConfig(num_slots=SLOTS, max_seq_len=max_seq_len, prefix_caching=prefix_caching)
        runner = ModelRunner(target.model, runner_config)
        context = DraftContext(config.draft.spec, runner.vocab_size, ModelRunner(draft.model, runner_config))
        tokenizer = load_tokenizer(tiny_dir / "target")
        drafter = methods.assemble(config.draft.drafting, config.draft.drafting.build(context), context)
        engine = SpecEngine(
            GatedTarget(runner, gated),
            drafter,
            tokenizer.tokenizer,
            tokenizer.eos_token_ids,
            EngineConfig(config.draft.max_speculative_tokens, config.draft.num_speculative_tokens),
        )
        parts = RouterParts(
            config=config,
            engine=engine,
            tokenizer=tokenizer,
            auth=BearerAuth(TOKEN),
            tracer=RequestTracer(config.target.model, config.draft.label),
            metrics=ServingMetrics(config.target.model, config.draft.label),
            max_seq_len=runner.max_seq_len,
            proposals=proposals,
        )
        router = Router(lambda: parts)
        routers.append((router, engine))
        return router, engine

    yield make
    for router, engine in routers:
        engine.target.gated = False
        engine.target.permits.release(1000)  # a round still waiting (only where a test failed) ends
        router.close()


def request(prompt_ids, k=None, **sampling) -> pb.GenerateRequest:
    message = pb.GenerateRequest(prompt_token_ids=prompt_ids, sampling=pb.SamplingParams(**sampling))
    if k is not None:
        message.speculation.num_speculative_tokens = k
    return message


async def _stream(router: Router, message: pb.GenerateRequest, context: Context) -> list[pb.GenerateStreamResponse]:
    return [chunk async for chunk in router.GenerateStream(message, context)]


async def _until(condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "the engine did not get there"
        await asyncio.sleep(0.01)


def test_generate_and_stream_give_plain_decodings_tokens(make_router, pair):
    router, _ = make_router()
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = run_to_completion(make_engine(pair[0]), [("r", PROMPT, params, 0)])["r"][0]
    message = request(PROMPT, k=3, max_tokens=24, ignore_eos=True)

    context = Context(AUTH)
    response = asyncio.run(router.Generate(message, context))
    assert list(response.token_ids) == expected and context.code is None
    assert response.finish_reason == pb.FINISH_REASON_LENGTH and response.usage.completion_tokens == 24
    assert response.speculation.proposed >= response.speculation.accepted > 0  # the drafts went through the engine

    context = Context(AUTH)
    chunks = asyncio.run(_stream(router, message, context))
    assert [t for c in chunks for t in c.token_ids] == expected and context.code is None
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    assert router.scheduler.num_active == 0


def test_model_info_reports_the_config_to_authenticated_callers_only(make_router):
    router, _ = make_router()
    info = asyncio.run(router.GetModelInfo(pb.GetModelInfoRequest(), Context(AUTH)))
    assert info.draft_method == "draft_model" and info.num_speculative_tokens == "3"
    assert info.max_context_length == 256 and info.max_speculative_tokens == 8
    context = Context()
    with pytest.raises(RequestFailed):
        asyncio.run(router.GetModelInfo(pb.GetModelInfoRequest(), context))
    assert context.code == grpc.StatusCode.UNAUTHENTICATED


def test_health_check_needs_no_token_and_is_not_serving_without_a_usable_target(make_router):
    router, _ = make_router()
    check = health_pb2.HealthCheckRequest(service="specdec.v1.GenerationService")
    assert asyncio.run(router.Check(check, Context())).status == health_pb2.HealthCheckResponse.SERVING
    router.target_pool = types.SimpleNamespace(has_usable=False)  # its only target replica failed
    assert asyncio.run(router.Check(check, Context())).status == health_pb2.HealthCheckResponse.NOT_SERVING
    context = Context()
    with pytest.raises(RequestFailed):
        asyncio.run(router.Check(health_pb2.HealthCheckRequest(service="specdec.v1.DraftService"), context))
    assert context.code == grpc.StatusCode.NOT_FOUND and "specdec.v1.DraftService" in context.details


def test_hybrid_serves_each_speculation_method_with_plain_decodings_tokens(make_router, pair):
    router, _ = make_router(method="hybrid")
    info = asyncio.run(router.GetModelInfo(pb.GetModelInfoRequest(), Context(AUTH)))
    assert info.draft_method == "hybrid" and list(info.speculation_methods) == ["suffix", "draft_model"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = run_to_completion(make_engine(pair[0]), [("r", PROMPT, params, 0)])["r"][0]
    proposed = {}
    for method in ("", "auto", "suffix", "draft_model", "none", "suffix"):  # suffix again: it read the earlier answers
        message = pb.GenerateRequest(
            prompt_token_ids=PROMPT,
            speculation_method=method,
            sampling=pb.SamplingParams(max_tokens=24, ignore_eos=True),
        )
        context = Context(AUTH)
        response = asyncio.run(router.Generate(message, context))
        assert list(response.token_ids) == expected and context.code is None, method
        proposed[method] = response.speculation.proposed
    assert proposed["none"] == 0 and proposed["draft_model"] > 0 and proposed["suffix"] > 0


@pytest.mark.parametrize(
    "metadata, message, code, named",
    [
        ((), request(PROMPT), grpc.StatusCode.UNAUTHENTICATED, "bearer"),
        ((("authorization", "Bearer wrong"),), request(PROMPT), grpc.StatusCode.UNAUTHENTICATED, "bearer"),
        (AUTH, pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (AUTH, request([5, 10_000]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
        (AUTH, request(PROMPT, max_tokens=101), grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens"),
        # Refused by the engine, on its thread: the error comes back through the request's queue.
        (AUTH, request(PROMPT, k=99), grpc.StatusCode.INVALID_ARGUMENT, "speculation.num_speculative_tokens"),
        (
            AUTH,
            pb.GenerateRequest(prompt_token_ids=PROMPT, speculation_method="ngram"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "speculation_method",
        ),
    ],
)
def test_a_refused_request_sets_the_status_naming_why(make_router, metadata, message, code, named):
    router, engine = make_router()
    for call in (router.Generate, lambda m, c: _stream(router, m, c)):
        context = Context(metadata)
        with pytest.raises(RequestFailed):
            asyncio.run(call(message, context))
        assert context.code == code and named in context.details.lower()
    assert router.scheduler.num_active == 0 and not engine.has_work


@pytest.mark.parametrize("handler", ["Generate", "GenerateStream"])
def test_a_cancelled_request_frees_its_sequence_in_target_and_drafter(make_router, handler):
    router, engine = make_router(gated=True)
    message = request(PROMPT, k=3, max_tokens=100, ignore_eos=True)  # more tokens than the permits below allow

    async def scenario() -> None:
        call = (
            router.Generate(message, Context(AUTH))
            if handler == "Generate"
            else _stream(router, message, Context(AUTH))
        )
        task = asyncio.ensure_future(call)
        # Prefilled, drafting started: the first round waits at the gate.
        await _until(lambda: engine.target.active_sequences == 1 and engine.drafter.active_sequences == 1)
        task.cancel()  # what Serve does when the client goes away
        with pytest.raises(asyncio.CancelledError):
            await task
        engine.target.permits.release(3)  # lets the waiting round end, and two more: far from 100 tokens
        await _until(lambda: not engine.has_work)

    asyncio.run(scenario())
    assert engine.target.active_sequences == 0 and engine.target.free_slots == SLOTS
    assert engine.drafter.active_sequences == 0
    assert router.scheduler.num_active == 0


def test_the_cache_salt_reaches_the_engine_and_usage_counts_cached_tokens(make_router):
    router, _ = make_router(prefix_caching=True)
    cached = []
    for salt in ("a", "a", "b", ""):  # "": no salt, the shared namespace
        message = request(PROMPT, k=3, max_tokens=4, ignore_eos=True)
        message.cache_salt = salt
        context = Context(AUTH)
        cached.append(asyncio.run(router.Generate(message, context)).usage.cached_tokens)
        assert context.code is None
    assert cached == [0, len(PROMPT) - 1, 0, 0]


# -- structured output ---------------------------------------------------------------------------------------------

STRUCTURED_PROMPT = "class Counter:"


def _structured_request(structured: pb.StructuredOutput, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=STRUCTURED_PROMPT,
        raw_prompt=True,
        structured=structured,
        sampling=pb.SamplingParams(**sampling),
        speculation=pb.SpeculationOptions(num_speculative_tokens=3),
    )


def test_a_json_schema_request_gives_constrained_plain_decodings_json(make_router, pair):
    """Over gRPC at T = 0: valid JSON, token for token what constrained greedy decoding gives (compact: the served
    default, which the expected run is given by hand). Streamed alike."""
    router, _ = make_router()
    schema = json.dumps(SERVED_SCHEMA)
    target = pair[0]
    params = SamplingParams(max_tokens=80, constraint=Constraint("json_schema", schema, compact=True))
    prompt = target.tokenizer(STRUCTURED_PROMPT)["input_ids"]
    expected = run_to_completion(make_engine(target), [("r", prompt, params, 0)])["r"][0]
    message = _structured_request(pb.StructuredOutput(json_schema=schema), max_tokens=80)
    context = Context(AUTH)
    response = asyncio.run(router.Generate(message, context))
    assert context.code is None and list(response.token_ids) == expected
    assert response.finish_reason == pb.FINISH_REASON_EOS and satisfies_served_schema(json.loads(response.text))
    assert response.speculation.proposed > 0
    chunks = asyncio.run(_stream(router, message, Context(AUTH)))
    assert [t for c in chunks for t in c.token_ids] == expected


def test_max_tokens_cuts_the_json_with_finish_reason_length(make_router):
    router, _ = make_router()
    message = _structured_request(pb.StructuredOutput(json_schema=json.dumps(SERVED_SCHEMA)), max_tokens=5)
    response = asyncio.run(router.Generate(message, Context(AUTH)))
    assert response.finish_reason == pb.FINISH_REASON_LENGTH and len(response.token_ids) == 5
    assert response.text.startswith("{")


@pytest.mark.parametrize(
    "structured, sampling, field",
    [
        (pb.StructuredOutput(json_schema='{"type": "integer", "not": {"const": 3}}'), {}, "structured.json_schema"),
        (pb.StructuredOutput(json_schema='{"type": '), {}, "structured.json_schema"),
        (pb.StructuredOutput(regex="[a-"), {}, "structured.regex"),
        (pb.StructuredOutput(grammar="start: item\n"), {}, "structured.grammar"),
        (pb.StructuredOutput(lenient_schema=True), {}, "structured"),
        (pb.StructuredOutput(json_object=True), {"ignore_eos": True}, "sampling.ignore_eos"),
    ],
)
def test_a_bad_constraint_is_invalid_argument_naming_the_field(make_router, structured, sampling, field):
    router, engine = make_router()
    context = Context(AUTH)
    with pytest.raises(RequestFailed):
        asyncio.run(router.Generate(_structured_request(structured, **sampling), context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and context.details.startswith(f"{field}: ")
    assert router.scheduler.num_active == 0 and not engine.has_work


def test_a_lenient_schema_drops_what_cannot_be_enforced(make_router):
    router, _ = make_router()
    schema = json.dumps({**SERVED_SCHEMA, "not": {"required": ["note"]}})
    message = _structured_request(pb.StructuredOutput(json_schema=schema, lenient_schema=True), max_tokens=80)
    context = Context(AUTH)
    response = asyncio.run(router.Generate(message, context))
    assert context.code is None and satisfies_served_schema(json.loads(response.text))


async def _post(app, path: str, body: dict) -> tuple[int, dict]:
    """One HTTP request through the router's ASGI app, in process (Serve's HTTP proxy does no more)."""
    status, reply, _ = await asgi_post(
        app, path, json.dumps(body).encode(), [(b"authorization", f"Bearer {TOKEN}".encode())]
    )
    return status, reply


def test_http_response_format_is_the_grpc_constraint(make_router):
    """OpenAI's response_format reaches the engine as gRPC's structured does: same tokens; a schema the server
    cannot enforce under strict is a 400 naming response_format.json_schema.schema."""
    router, _ = make_router()
    app = router.__serve_build_asgi_app__()
    messages = [{"role": "user", "content": "a counter"}]
    body = {
        "model": router.served_model_name,
        "messages": messages,
        "temperature": 0,
        "max_tokens": 80,
        "return_token_ids": True,
        "num_speculative_tokens": 3,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "counter", "schema": SERVED_SCHEMA, "strict": True},
        },
    }
    status, reply = asyncio.run(_post(app, "/v1/chat/completions", body))
    want = asyncio.run(
        router.Generate(
            pb.GenerateRequest(
                messages=[pb.ChatMessage(**m) for m in messages],
                sampling=pb.SamplingParams(max_tokens=80),
                structured=pb.StructuredOutput(json_schema=json.dumps(SERVED_SCHEMA)),
            ),
            Context(AUTH),
        )
    )
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["token_ids"] == list(want.token_ids) and choice["message"]["content"] == want.text
    assert choice["finish_reason"] == "stop" and satisfies_served_schema(json.loads(want.text))

    refused = {
        **body,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "counter", "schema": {"type": "integer", "not": {"const": 3}}, "strict": True},
        },
    }
    status, error = asyncio.run(_post(app, "/v1/chat/completions", refused))
    assert status == 400 and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == "response_format.json_schema.schema" and "not" in error["error"]["message"]
    assert router.scheduler.num_active == 0


# -- limits before work, and what every request leaves behind ----------------------------------------------------------

BIG = "é" * 1_000_000  # 2 MB of UTF-8 (a million characters): over the default router.max_prompt_bytes (1 MiB)


class CountingTokenizer:
    """The router's tokenizer, counting the calls that tokenize: a text, or a conversation through its template."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner.apply_chat_template(*args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner.encode(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def count_tokenizer(router: Router) -> CountingTokenizer:
    """Put a counting wrapper around the router's tokenizer (the one prompts are encoded with)."""
    counting = CountingTokenizer(router.tokenizer.tokenizer)
    router.tokenizer = dataclasses.replace(router.tokenizer, tokenizer=counting)
    return counting


class RecordedCounter:
    """Stands in for a Ray counter: what was counted, by its tags."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self.counts[tuple(sorted((tags or {}).items()))] += value

    def by(self, **tags: str) -> float:
        return sum(n for key, n in self.counts.items() if set(tags.items()) <= set(key))


def record_requests(router: Router) -> RecordedCounter:
    """Record what the router counts in `specdec_requests`."""
    router.metrics.requests = recorded = RecordedCounter()
    return recorded


@pytest.mark.parametrize(
    "message, field",
    [
        (pb.GenerateRequest(prompt=BIG), "prompt"),
        (pb.GenerateRequest(prompt=BIG, raw_prompt=True), "prompt"),
        (pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=BIG)]), "messages"),
        # Many messages, each small: their total counts.
        (pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=BIG[:4000])] * 300), "messages"),
    ],
)
def test_a_prompt_over_max_prompt_bytes_is_refused_before_it_is_tokenized(make_router, message, field):
    router, engine = make_router()
    tokenizer = count_tokenizer(router)
    for call in (router.Generate, lambda m, c: _stream(router, m, c)):
        context = Context(AUTH)
        with pytest.raises(RequestFailed):
            asyncio.run(call(message, context))
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT and context.details.startswith(f"{field}: ")
        assert "router.max_prompt_bytes" in context.details
    assert tokenizer.calls == 0 and not engine.has_work
    # The next request is served (tokenized: the counter does count).
    context = Context(AUTH)
    response = asyncio.run(
        router.Generate(
            pb.GenerateRequest(prompt="def add(a, b):", raw_prompt=True, sampling=pb.SamplingParams(max_tokens=4)),
            context,
        )
    )
    assert context.code is None and len(response.token_ids) == 4 and tokenizer.calls == 1


def test_max_prompt_bytes_counts_utf8_bytes_not_characters(make_router):
    router, _ = make_router(max_prompt_bytes=100)
    tokenizer = count_tokenizer(router)
    context = Context(AUTH)
    with pytest.raises(RequestFailed):  # 60 characters, 120 bytes
        asyncio.run(router.Generate(pb.GenerateRequest(prompt="é" * 60, raw_prompt=True), context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and context.details.startswith("prompt: 120 bytes")
    assert tokenizer.calls == 0
    context = Context(AUTH)  # 50 characters, 100 bytes: at the limit
    response = asyncio.run(
        router.Generate(
            pb.GenerateRequest(prompt="é" * 50, raw_prompt=True, sampling=pb.SamplingParams(max_tokens=2)), context
        )
    )
    assert context.code is None and len(response.token_ids) == 2


@pytest.mark.parametrize(
    "router_config, longest, key",
    [
        ({}, 255, "context of 256"),  # by default the context, less one output token
        ({"max_prompt_tokens": 64}, 64, "(router.max_prompt_tokens)"),
        ({"max_prompt_tokens": 1000}, 255, "context of 256"),  # a limit beyond the context is the context
    ],
)
def test_max_prompt_tokens_defaults_to_the_context(make_router, router_config, longest, key):
    router, engine = make_router(**router_config)
    tokenizer = count_tokenizer(router)
    context = Context(AUTH)
    with pytest.raises(RequestFailed):  # token ids: counted before any other check on them
        asyncio.run(router.Generate(request([5] * (longest + 1), max_tokens=1), context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details.startswith(f"prompt: {longest + 1} tokens; this server takes at most {longest} ")
    assert key in context.details and "router.max_prompt_tokens" in context.details
    text = " ".join(["word"] * 400)  # more tokens than any limit above (a few hundred at least)
    context = Context(AUTH)
    with pytest.raises(RequestFailed):  # text: counted once tokenized
        asyncio.run(router.Generate(pb.GenerateRequest(prompt=text, raw_prompt=True), context))
    assert context.details.startswith("prompt: ") and key in context.details and tokenizer.calls == 1
    context = Context(AUTH)
    response = asyncio.run(router.Generate(request([5] * longest, max_tokens=1), context))
    assert context.code is None and len(response.token_ids) == 1 and not engine.has_work


async def _every_way_a_request_ends(router: Router, engine: SpecEngine, timeout_s: float) -> None:
    """Against a gated router whose requests time out after `timeout_s`: one request served, two refused by the
    router (unauthenticated, a limit), one by the engine, one past its deadline after its first output, one
    cancelled while it runs."""
    engine.target.gated = False
    response = await router.Generate(request(PROMPT, k=3, max_tokens=4, ignore_eos=True), Context(AUTH))
    assert len(response.token_ids) == 4
    engine.target.gated = True
    for metadata, message in [
        ((), request(PROMPT)),
        (AUTH, request(PROMPT, max_tokens=101)),
        (AUTH, request(PROMPT, k=99)),
    ]:
        with pytest.raises(RequestFailed):
            await router.Generate(message, Context(metadata))

    context = Context(AUTH)
    stream = router.GenerateStream(request(PROMPT, k=3, max_tokens=100, ignore_eos=True), context)
    assert len((await anext(stream)).token_ids) == 1  # prefilled; its first round waits at the gate
    await asyncio.sleep(timeout_s * 1.5)  # past its deadline, which the engine checks before the next round
    engine.target.permits.release(1)
    with pytest.raises(RequestFailed):
        while True:  # that round's output, then the deadline: one permit cannot take it to 100 tokens
            await asyncio.wait_for(anext(stream), WAIT_S)
    assert context.code == grpc.StatusCode.DEADLINE_EXCEEDED

    task = asyncio.ensure_future(router.Generate(request(PROMPT, k=3, max_tokens=100, ignore_eos=True), Context(AUTH)))
    await _until(lambda: engine.target.active_sequences == 1)
    if router.proposals is not None:
        assert router.proposals.num_pending == 1  # sampled while it runs
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    engine.target.permits.release(3)
    await _until(lambda: not engine.has_work and router.scheduler.num_active == 0)


def test_no_request_stays_in_the_proposal_log_however_it_ends(make_router, tmp_path):
    log = ProposalLog(tmp_path, sample_rate=1.0, target="t", draft="d")
    router, engine = make_router(gated=True, proposals=log, request_timeout_s=1.0)
    asyncio.run(_every_way_a_request_ends(router, engine, 1.0))
    assert log.num_pending == 0
    log.close()
    assert (tmp_path / "proposals.jsonl").read_text().count("\n") > 0  # the served request's rounds were logged


def test_every_request_is_counted_once_with_why_it_ended(make_router):
    router, engine = make_router(gated=True, request_timeout_s=1.0)
    recorded = record_requests(router)
    asyncio.run(_every_way_a_request_ends(router, engine, 1.0))

    async def cancelled_counted() -> None:  # the engine reports the cancellation on its thread
        await _until(lambda: recorded.by(finish_reason="cancelled") == 1)

    asyncio.run(cancelled_counted())
    counts = {(dict(key)["finish_reason"], dict(key)["code"]): n for key, n in recorded.counts.items()}
    assert counts == {
        ("length", "ok"): 1,
        ("refused", "unauthenticated"): 1,
        ("refused", "invalid_argument"): 2,
        ("error", "deadline_exceeded"): 1,
        ("cancelled", "cancelled"): 1,
    }


# -- A/B of draft variants ---------------------------------------------------------------------------------------------


class Seen:
    """A drafter, recording the sequences it is asked about."""

    def __init__(self, drafter) -> None:
        self.drafter, self.name, self.seq_ids = drafter, drafter.name, set()

    def start(self, seq_id, prompt_ids, cache_salt=None):
        self.seq_ids.add(seq_id)
        return self.drafter.start(seq_id, prompt_ids, cache_salt)

    def cached(self, seq_id, token_ids, cache_salt=None):
        return self.drafter.cached(seq_id, token_ids, cache_salt)

    def propose(self, requests):
        self.seq_ids.update(r.seq_id for r in requests)
        return self.drafter.propose(requests)

    def observe(self, seq_id, num_committed):
        self.drafter.observe(seq_id, num_committed)

    def release(self, seq_id):
        self.drafter.release(seq_id)


@pytest.fixture()
def ab_router(tiny_dir, near_draft_dir, pair):
    """A router A/B-testing two drafts of the tiny target: `good` (the near draft) and `bad` (its contrarian,
    wrong wherever it can be), weights 3 : 1, demoted after one check 10% below the control."""
    from specdec_core.drafters.draft_model import DraftModelDrafter
    from specdec_core.drafters.variants import VariantDrafter
    from tests.helpers import contrarian

    variant = {"method": "draft_model", "model": str(near_draft_dir), "dtype": "float32", "num_speculative_tokens": 3}
    config = parse_config(
        {
            "target": {"model": str(tiny_dir / "target"), "dtype": "float32"},
            "drafts": [{"name": "good", "weight": 3, **variant}, {"name": "bad", "weight": 1, **variant}],
            "ab": {
                "demotion": {
                    "metric": "acceptance",
                    "margin": 0.1,
                    "window_rounds": 200,
                    "min_rounds": 20,
                    "consecutive_checks": 1,
                }
            },
            "router": {"max_seq_len": 256, "default_max_tokens": 16, "calibrate": False},
        }
    )
    target, draft = pair
    runner_config = RunnerConfig(num_slots=SLOTS, max_seq_len=256)
    runner = ModelRunner(target.model, runner_config)
    seen = {
        "good": Seen(DraftModelDrafter(ModelRunner(draft.model, runner_config), runner.vocab_size)),
        "bad": Seen(DraftModelDrafter(ModelRunner(contrarian(draft.model), runner_config), runner.vocab_size)),
    }
    tokenizer = load_tokenizer(tiny_dir / "target")
    engine = SpecEngine(
        LocalTarget(runner),
        VariantDrafter(seen, "good"),
        tokenizer.tokenizer,
        tokenizer.eos_token_ids,
        EngineConfig(config.draft.max_speculative_tokens, 3),
    )
    parts = RouterParts(
        config=config,
        engine=engine,
        tokenizer=tokenizer,
        auth=BearerAuth(TOKEN),
        tracer=RequestTracer(config.target.model, config.draft.label),
        metrics=ServingMetrics(config.target.model, config.draft.label),
        max_seq_len=256,
    )
    router = Router(lambda: parts)
    yield router, seen
    router.close()


def _generate_all(router, messages):
    async def run():
        return await asyncio.gather(*(router.Generate(m, Context(AUTH)) for m in messages))

    return asyncio.run(run())


def test_variants_are_assigned_by_weight_sticky_and_named_in_the_response(ab_router, pair):
    router, seen = ab_router
    prompts = [[5 + i % 50, 6, 7 + i % 7, 8] for i in range(48)]
    responses = _generate_all(router, [request(p, max_tokens=6, ignore_eos=True) for p in prompts])
    expected = run_to_completion(
        make_engine(pair[0]),
        [(str(i), p, SamplingParams(max_tokens=6, ignore_eos=True), 0) for i, p in enumerate(prompts)],
    )
    assert [list(r.token_ids) for r in responses] == [expected[str(i)][0] for i in range(len(prompts))]
    names = [r.speculation.draft_variant for r in responses]
    assert set(names) == {"good", "bad"} and 24 <= names.count("good") <= 44  # 3 : 1 of 48, loosely
    # Sticky: no request was ever drafted by both, and each drafted only with the variant its response names.
    assert not seen["good"].seq_ids & seen["bad"].seq_ids
    assert (len(seen["good"].seq_ids), len(seen["bad"].seq_ids)) == (names.count("good"), names.count("bad"))
    assert router.scheduler.engine.drafter._assigned == {}  # every assignment forgotten once its request ended

    pinned = _generate_all(
        router,
        [pb.GenerateRequest(prompt_token_ids=[5, 6, 7], draft_variant="bad", sampling=pb.SamplingParams(max_tokens=4))]
        * 4,
    )
    assert {r.speculation.draft_variant for r in pinned} == {"bad"}
    context = Context(AUTH)
    with pytest.raises(RequestFailed):
        asyncio.run(router.Generate(pb.GenerateRequest(prompt_token_ids=[5], draft_variant="ugly"), context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and "draft_variant" in context.details


def test_a_variant_below_the_control_is_demoted_and_pinned_requests_still_reach_it(ab_router):
    router, _ = ab_router
    message = request([5, 6, 7, 8], max_tokens=12, ignore_eos=True)
    for variant in ("good", "bad"):
        pinned = pb.GenerateRequest()
        pinned.CopyFrom(message)
        pinned.draft_variant = variant
        _generate_all(router, [pinned] * 10)
    assert router.ab.tick() == ["bad"]
    info = asyncio.run(router.GetModelInfo(pb.GetModelInfoRequest(), Context(AUTH)))
    assert {(v.name, v.weight, v.control) for v in info.draft_variants} == {("good", 3.0, True), ("bad", 0.0, False)}
    names = {r.speculation.draft_variant for r in _generate_all(router, [message] * 12)}
    assert names == {"good"}
    assert router.ab.tick() == []  # demoted once


def test_a_single_draft_is_the_variant_default(make_router):
    router, _ = make_router()
    response = asyncio.run(router.Generate(request(PROMPT, k=3, max_tokens=4), Context(AUTH)))
    assert response.speculation.draft_variant == "default"
    context = Context(AUTH)
    with pytest.raises(RequestFailed):
        asyncio.run(router.Generate(pb.GenerateRequest(prompt_token_ids=[5], draft_variant="b"), context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and "draft_variant" in context.details


def test_http_pins_a_variant_and_names_it_in_speculation(ab_router):
    router, _ = ab_router
    app = router.__serve_build_asgi_app__()
    body = {"model": router.served_model_name, "prompt": "ab", "max_tokens": 4, "draft_variant": "bad"}
    status, reply = asyncio.run(_post(app, "/v1/completions", body))
    assert status == 200 and reply["speculation"]["draft_variant"] == "bad", reply
    status, error = asyncio.run(_post(app, "/v1/completions", {**body, "draft_variant": "ugly"}))
    assert status == 400 and error["error"]["param"] == "draft_variant"


# -- what a constraint costs, and a model without structured output ------------------------------------------------


def counted_compiles(engine: SpecEngine) -> list[Constraint]:
    """The constraints `engine` is asked to compile from now on, compiled by its own (real) compiler."""
    compiled, real = [], engine.compile

    def compile(constraint: Constraint):
        compiled.append(constraint)
        return real(constraint)

    engine.compile = compile
    return compiled


def test_a_full_queue_refuses_a_structured_request_before_compiling_it(make_router):
    """RESOURCE_EXHAUSTED for the queue, as the scheduler would say, with no compile paid for it; once there is
    room the same request compiles and runs."""
    router, engine = make_router(gated=True, max_queued_requests=0)
    compiled = counted_compiles(engine)
    structured = _structured_request(pb.StructuredOutput(json_schema=json.dumps(SERVED_SCHEMA)), max_tokens=8)

    async def scenario() -> None:
        busy = [
            asyncio.ensure_future(router.Generate(request(PROMPT, k=3, max_tokens=100, ignore_eos=True), Context(AUTH)))
            for _ in range(SLOTS)
        ]
        # Requests join between rounds: a round at a time until every slot is taken (one needs 25 rounds to end).
        deadline = time.monotonic() + WAIT_S
        while engine.target.active_sequences < SLOTS:
            assert time.monotonic() < deadline, "the requests did not all start"
            engine.target.permits.release(1)
            await asyncio.sleep(0.05)
        context = Context(AUTH)
        with pytest.raises(RequestFailed):  # at once: not after the round the engine thread is held in
            await asyncio.wait_for(router.Generate(structured, context), 10)
        assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED and context.details.startswith("queue: ")
        assert compiled == []
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
        engine.target.gated = False
        engine.target.permits.release(1000)
        await _until(lambda: not engine.has_work and router.scheduler.num_active == 0)
        await router.Generate(structured, Context(AUTH))

    asyncio.run(scenario())
    assert compiled  # the router's compile, and the engine's (which finds it compiled)


def test_a_constraint_over_max_schema_bytes_is_refused_naming_its_field_before_it_compiles(make_router):
    router, engine = make_router(max_schema_bytes=64)
    compiled = counted_compiles(engine)
    schema = json.dumps(SERVED_SCHEMA)
    assert len(schema) > 64
    context = Context(AUTH)
    with pytest.raises(RequestFailed):
        asyncio.run(router.Generate(_structured_request(pb.StructuredOutput(json_schema=schema)), context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details.startswith("structured.json_schema: ") and "router.max_schema_bytes" in context.details
    body = {
        "model": router.served_model_name,
        "prompt": PROMPT,
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SERVED_SCHEMA}},
    }
    status, reply = asyncio.run(_post(router.__serve_build_asgi_app__(), "/v1/completions", body))
    assert status == 400 and reply["error"]["param"] == "response_format.json_schema.schema"
    assert compiled == []
    within = _structured_request(pb.StructuredOutput(regex="[0-9]{3}"), max_tokens=4)
    assert asyncio.run(router.Generate(within, Context(AUTH))).text.isdigit()  # a short constraint still serves
    assert compiled


def test_a_model_without_grammars_serves_and_refuses_structured_requests_naming_the_field(tiny_dir, pair):
    """A target whose tokenizer the grammar engine cannot read: the router comes up and serves; a structured
    request is INVALID_ARGUMENT (gRPC) or 400 (HTTP) naming its field and saying why."""
    from tests.specdec_core.test_structured import EOS_ID, wordlevel_tokenizer

    tokenizer = wordlevel_tokenizer()
    config = parse_config(
        {
            "target": {"model": str(tiny_dir / "target"), "dtype": "float32"},
            "draft": {"method": "none"},
            "router": {"max_seq_len": 64, "default_max_tokens": 4, "calibrate": False},
        }
    )
    runner = ModelRunner(pair[0].model, RunnerConfig(num_slots=SLOTS, max_seq_len=64))
    engine = SpecEngine(LocalTarget(runner), None, tokenizer, frozenset({EOS_ID}))
    parts = RouterParts(
        config=config,
        engine=engine,
        tokenizer=LoadedTokenizer(tokenizer, tiny_dir / "target", {}),
        auth=BearerAuth(TOKEN),
        tracer=RequestTracer(config.target.model, config.draft.label),
        metrics=ServingMetrics(config.target.model, config.draft.label),
        max_seq_len=64,
    )
    router = Router(lambda: parts)
    try:
        plain = request([5, 6, 7], max_tokens=4, ignore_eos=True)
        assert len(asyncio.run(router.Generate(plain, Context(AUTH))).token_ids) == 4
        structured = pb.GenerateRequest(
            prompt_token_ids=[5, 6, 7], structured=pb.StructuredOutput(json_schema='{"type": "object"}')
        )
        context = Context(AUTH)
        with pytest.raises(RequestFailed):
            asyncio.run(router.Generate(structured, context))
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT
        assert context.details.startswith("structured.json_schema: structured output is unavailable for this model")
        body = {"model": router.served_model_name, "prompt": [5, 6, 7], "response_format": {"type": "json_object"}}
        status, reply = asyncio.run(_post(router.__serve_build_asgi_app__(), "/v1/completions", body))
        assert status == 400 and reply["error"]["param"] == "response_format"
        assert "structured output is unavailable for this model" in reply["error"]["message"]
    finally:
        router.close()


def test_tenants_share_cached_prefixes_only_among_themselves(make_router):
    """Tokens per tenant: a tenant's repeat finds its own prompt cached; the same prompt from another tenant, or
    from the shared token's callers, finds nothing, so `cached_tokens` tells no tenant about another's prompts."""
    from deployments.auth import BearerAuth

    router, _ = make_router(prefix_caching=True)
    router.auth = BearerAuth(TOKEN, {"alice": "alice-token", "bob": "bob-token"})

    def cached(token):
        context = Context((("authorization", f"Bearer {token}"),))
        response = asyncio.run(router.Generate(request(PROMPT, k=3, max_tokens=4, ignore_eos=True), context))
        assert context.code is None
        return response.usage.cached_tokens

    runs = [cached(t) for t in ("alice-token", "bob-token", TOKEN, "alice-token", "bob-token", TOKEN)]
    assert runs == [0, 0, 0, len(PROMPT) - 1, len(PROMPT) - 1, len(PROMPT) - 1]
