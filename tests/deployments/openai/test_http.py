"""The OpenAI-compatible HTTP API of the served stack, through the official `openai` client: the same router and
engine as gRPC, so the same request gives the same tokens on both."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers import SERVED_SCHEMA, satisfies_served_schema

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def api(served):
    _, config = served
    base = f"http://127.0.0.1:{config.http_port}/v1"
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120) as client:
        yield client, config, base


@pytest.fixture(scope="module")
def stub(served):
    address, _ = served
    with grpc.insecure_channel(address) as channel:
        yield pb_grpc.GenerationServiceStub(channel)


def post(base: str, path: str, body: object, headers: dict | None = None) -> tuple[int, dict]:
    """A raw POST (the SDK would hide the status of some errors behind its own exceptions)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        base + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_models_lists_the_served_model(api):
    client, config, _ = api
    (card,) = client.models.list().data
    assert card.id == config.served_name and card.object == "model"
    assert client.models.retrieve(config.served_name).id == config.served_name


def test_chat_equals_grpc_messages(api, stub):
    client, config, _ = api
    reply = client.chat.completions.create(
        model=config.served_name,
        messages=CHAT,
        temperature=0,
        max_tokens=8,
        extra_body={"num_speculative_tokens": 3, "return_token_ids": True},
    )
    want = stub.Generate(
        pb.GenerateRequest(
            messages=[pb.ChatMessage(**m) for m in CHAT],
            sampling=pb.SamplingParams(max_tokens=8),
            speculation=pb.SpeculationOptions(num_speculative_tokens=3),
        ),
        timeout=60,
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.model_extra["token_ids"] == list(want.token_ids)
    assert reply.usage.prompt_tokens == want.usage.prompt_tokens
    assert reply.usage.completion_tokens == want.usage.completion_tokens == len(want.token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    spec = reply.model_extra["speculation"]
    assert spec["rounds"] > 0 and 0 <= spec["accepted"] <= spec["proposed"]
    assert choice.finish_reason in ("stop", "length") and reply.id.startswith("chatcmpl-")


def test_a_raw_completion_equals_grpc_generate_with_raw_prompt(api, stub):
    client, config, _ = api
    prompt = "def add(a, b):"
    reply = client.completions.create(
        model=config.served_name,
        prompt=prompt,
        temperature=0,
        max_tokens=10,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    want = stub.Generate(
        pb.GenerateRequest(prompt=prompt, raw_prompt=True, sampling=pb.SamplingParams(max_tokens=10, ignore_eos=True)),
        timeout=60,
    )
    assert reply.choices[0].text == want.text
    assert reply.choices[0].model_extra["token_ids"] == list(want.token_ids)
    assert reply.usage.completion_tokens == 10 and reply.choices[0].finish_reason == "length"


def test_a_token_id_prompt(api, stub):
    client, config, _ = api
    reply = client.completions.create(
        model=config.served_name, prompt=[5, 6, 7, 8], temperature=0, max_tokens=5, extra_body={"ignore_eos": True}
    )
    want = stub.Generate(
        pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], sampling=pb.SamplingParams(max_tokens=5, ignore_eos=True)),
        timeout=60,
    )
    assert reply.choices[0].text == want.text and reply.usage.prompt_tokens == 4


@pytest.mark.parametrize("chat", [True, False])
def test_a_stream_adds_up_to_the_unary_answer_and_ends_with_usage(api, chat):
    client, config, _ = api
    common = dict(model=config.served_name, temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    if chat:
        unary = client.chat.completions.create(messages=CHAT, **common).choices[0].message.content
        chunks = list(
            client.chat.completions.create(messages=CHAT, stream=True, stream_options={"include_usage": True}, **common)
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        unary = client.completions.create(prompt="hello", **common).choices[0].text
        chunks = list(
            client.completions.create(prompt="hello", stream=True, stream_options={"include_usage": True}, **common)
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == unary
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.model_extra["speculation"]["rounds"] > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_the_stream_ends_with_done(api):
    _, config, base = api
    request = urllib.request.Request(
        base + "/completions",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"model": config.served_name, "prompt": "hi", "max_tokens": 3, "stream": True}).encode(),
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in response.read().decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_stop_strings_cut_the_text(api):
    client, config, _ = api
    common = dict(model=config.served_name, prompt="the", temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    full = client.completions.create(**common).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = client.completions.create(stop=[stop], **common).choices[0]
    assert stop not in cut.text and full.startswith(cut.text) and cut.finish_reason == "stop"


def test_the_same_seed_gives_the_same_text(api):
    client, config, _ = api
    common = dict(model=config.served_name, messages=CHAT, temperature=1.0, top_p=0.95, max_tokens=12)
    first = client.chat.completions.create(seed=1234, **common).choices[0].message.content
    again = client.chat.completions.create(seed=1234, **common).choices[0].message.content
    assert first == again


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"some_unknown_field": 1}, "some_unknown_field"),
        ({"num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"speculation_method": "beam"}, "speculation_method"),
        ({"speculation_method": "suffix"}, "speculation_method"),  # a method this server does not run
        ({"max_tokens": 100000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x" * 5000}]}, "messages"),
    ],
)
def test_bad_requests_are_400_naming_the_parameter(api, body, param):
    _, config, base = api
    status, error = post(base, "/chat/completions", {"model": config.served_name, "messages": CHAT, **body})
    assert status == 400, error
    assert error["error"]["param"] == param and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"]


def test_malformed_json_and_an_unknown_model(api):
    _, config, base = api
    status, error = post(base, "/completions", b"{not json")
    assert status == 400 and error["error"]["param"] == "body"
    status, error = post(base, "/completions", {"model": "no-such-model", "prompt": "hi"})
    assert status == 404 and error["error"]["param"] == "model" and error["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        api[0].models.retrieve("no-such-model")


def test_health_answers_without_a_body(api):
    _, _, base = api
    with urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=30) as response:
        assert response.status == 200 and response.read() == b""


def test_cached_tokens_are_reported_and_salts_keep_caches_apart(api):
    client, config, _ = api
    messages = [{"role": "system", "content": "You review code. " * 8}, {"role": "user", "content": "def f(): pass"}]
    common = dict(model=config.served_name, messages=messages, temperature=0, max_tokens=4)
    first = client.chat.completions.create(extra_body={"cache_salt": "http-a"}, **common)
    again = client.chat.completions.create(extra_body={"cache_salt": "http-a"}, **common)
    other = client.chat.completions.create(extra_body={"cache_salt": "http-b"}, **common)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].message.content == first.choices[0].message.content == other.choices[0].message.content


def test_response_format_json_schema_equals_grpc_structured_output(api, stub):
    """Through the served stack (remote target and draft workers): the JSON of a json_schema request at T = 0 is
    the gRPC answer under the same constraint, and satisfies the schema unless max_tokens cut it; a schema the
    server cannot enforce under strict is a 400 naming it."""
    client, config, base = api
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "counter", "schema": SERVED_SCHEMA, "strict": True},
    }
    reply = client.chat.completions.create(
        model=config.served_name,
        messages=CHAT,
        temperature=0,
        max_tokens=80,
        response_format=response_format,
        extra_body={"num_speculative_tokens": 3, "return_token_ids": True},
    )
    want = stub.Generate(
        pb.GenerateRequest(
            messages=[pb.ChatMessage(**m) for m in CHAT],
            sampling=pb.SamplingParams(max_tokens=80),
            speculation=pb.SpeculationOptions(num_speculative_tokens=3),
            structured=pb.StructuredOutput(json_schema=json.dumps(SERVED_SCHEMA)),
        ),
        timeout=60,
    )
    choice = reply.choices[0]
    assert choice.message.content == want.text and choice.model_extra["token_ids"] == list(want.token_ids)
    if choice.finish_reason == "length":
        assert want.finish_reason == pb.FINISH_REASON_LENGTH and want.text.startswith("{")
    else:
        assert choice.finish_reason == "stop" and satisfies_served_schema(json.loads(choice.message.content))

    bad = {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": {"type": "integer", "not": {"const": 3}}, "strict": True},
    }
    status, error = post(
        base, "/chat/completions", {"model": config.served_name, "messages": CHAT, "response_format": bad}
    )
    assert status == 400 and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == "response_format.json_schema.schema"


@pytest.mark.parametrize(
    "structured",
    [
        pb.StructuredOutput(json_schema=json.dumps(SERVED_SCHEMA)),
        pb.StructuredOutput(regex="(add|mean|count)\\([a-z]{1,3}(, [a-z]{1,3}){0,3}\\)"),
    ],
)
def test_constrained_speculation_in_the_served_stack_is_constrained_plain_decoding(stub, structured):
    """The draft workers draft under the grammar the router sends them: at T = 0, speculative output (draft model
    only) is constrained plain decoding's (`speculation_method: none`), token for token."""

    def generate(method: str) -> pb.GenerateResponse:
        return stub.Generate(
            pb.GenerateRequest(
                messages=[pb.ChatMessage(**m) for m in CHAT],
                sampling=pb.SamplingParams(max_tokens=60),
                speculation=pb.SpeculationOptions(num_speculative_tokens=3),
                speculation_method=method,
                structured=structured,
            ),
            timeout=60,
        )

    plain, speculative = generate("none"), generate("draft_model")
    assert list(speculative.token_ids) == list(plain.token_ids) and speculative.text == plain.text
    assert plain.speculation.proposed == 0 and speculative.speculation.proposed > 0


def test_a_named_tool_call_through_the_served_stack(api):
    """tools + tool_choice naming a function, by the official client, unary and streamed: the call it forces, with
    the arguments its schema allows (the router's context is 256 tokens: a function without parameters fits)."""
    client, config, _ = api
    tools = [{"type": "function", "function": {"name": "noop", "strict": True}}]
    args = dict(
        model=config.served_name,
        messages=[{"role": "user", "content": "hi"}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "noop"}},
        temperature=0,
        max_tokens=64,
    )
    reply = client.chat.completions.create(**args)
    choice = reply.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("noop", {})
    with client.chat.completions.stream(**args) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content is None
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [("noop", "{}")]
