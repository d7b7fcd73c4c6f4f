"""Request bodies of the OpenAI-compatible API: what is accepted, and refusals that name the parameter."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments import worker_codec
from deployments.generation_codec import MAX_JSON_DEPTH
from deployments.openai.codec import DEFAULT_COMPLETION_MAX_TOKENS, DEFAULT_TEMPERATURE, decode_chat, decode_completion
from deployments.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from specdec.v1 import worker_pb2 as wpb
from specdec_core.chat import ChatMessage
from specdec_core.config import AUTO
from specdec_core.errors import InvalidArgument
from specdec_core.grammar.constraint import Constraint
from specdec_core.target import PrefillItem

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**extra):
    return decode_chat(parse_body(ChatCompletionRequest, {**CHAT, **extra}), default_max_tokens=33)


def test_a_plain_chat_request_takes_openais_defaults_and_the_servers_length():
    call = chat()
    params = call.generate.request.params
    assert params.temperature == DEFAULT_TEMPERATURE and params.top_p == 1.0 and params.max_tokens == 33
    assert call.generate.prompt.messages == (ChatMessage("user", "hi"),)
    assert call.generate.request.num_speculative_tokens is None and not call.stream


def test_every_implemented_field_reaches_the_call():
    call = chat(
        max_completion_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=3,
        stop=["\n", "END"],
        stream=True,
        stream_options={"include_usage": True},
        top_k=5,
        ignore_eos=True,
        cache_salt="tenant-a",
        num_speculative_tokens="auto",
        return_token_ids=True,
        user="someone",
        metadata={"a": "b"},
    )
    params = call.generate.request.params
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (7, 0.5, pytest.approx(0.9), 3)
    assert params.stop == ("\n", "END") and params.top_k == 5 and params.ignore_eos
    assert call.generate.request.num_speculative_tokens == AUTO and call.generate.request.cache_salt == "tenant-a"
    assert call.stream and call.include_usage and call.return_token_ids


def test_text_parts_and_developer_turns():
    call = chat(
        messages=[
            {"role": "developer", "content": "be terse"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    )
    assert call.generate.prompt.messages == (ChatMessage("system", "be terse"), ChatMessage("user", "ab"))


@pytest.mark.parametrize(
    ("prompt", "text", "ids"),
    [
        ("hello", "hello", None),
        (["hello"], "hello", None),
        ([1, 2, 3], None, (1, 2, 3)),
        ([[4, 5]], None, (4, 5)),
    ],
)
def test_completion_prompts_are_raw_text_or_token_ids(prompt, text, ids):
    call = decode_completion(parse_body(CompletionRequest, {"model": "m", "prompt": prompt}))
    assert call.generate.prompt.text == text and call.generate.prompt.token_ids == ids
    assert call.generate.prompt.raw == (text is not None)  # text is sent as is, never through the chat template
    assert call.generate.request.params.max_tokens == DEFAULT_COMPLETION_MAX_TOKENS


def test_no_op_values_of_unimplemented_fields_are_accepted():
    call = chat(
        frequency_penalty=0,
        presence_penalty=0.0,
        logprobs=False,
        logit_bias={},
        tools=[],
        response_format={"type": "text"},
        n=1,
    )
    assert call.generate.request.params.max_tokens == 33


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


DEEP = _nested(MAX_JSON_DEPTH)  # twice as many levels: past the limit wherever in the body it sits
DEEP_CALL = {"name": "f", "arguments": '{"a": ' * 1000 + "1" + "}" * 1000}  # text: json.loads would recurse


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"not_an_openai_field": 1}, "not_an_openai_field"),
        ({"store": True}, "store"),
        ({"n": 2}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": 0.0001}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"num_speculative_tokens": "fast"}, "num_speculative_tokens"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"cache_salt": 5}, "cache_salt"),
        ({"top_k": -2}, "top_k"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content",
        ),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"model": None}, "model"),
        # Values the workers' wire (or the sampler) cannot hold with their meaning: refused here, not in a batch.
        ({"top_k": 2**40}, "top_k"),
        ({"top_p": 1e-50}, "top_p"),  # 0 in float32
        ({"cache_salt": "\ud800"}, "cache_salt"),  # JSON's escapes can write a lone surrogate
        ({"stop": ["ok", "a\udfff"]}, "stop[1]"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages[0].content[0].text",
        ),
        ({"\ud800": 1}, "body"),  # an unknown key, which the error would otherwise quote
        ({"metadata": {"\ud800": "x"}}, "metadata"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": DEEP}}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]}, "tools"),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": DEEP_CALL}]}
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_chat_fields_are_refused_naming_the_parameter(extra, param):
    with pytest.raises(InvalidArgument) as caught:
        chat(**extra)
    assert caught.value.field == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "m", "prompt": {"text": "a"}}, "prompt"),
        ({"model": "m", "prompt": "a", "echo": True}, "echo"),
        ({"model": "m", "prompt": "a", "best_of": 2}, "best_of"),
        ({"model": "m", "prompt": "a", "messages": []}, "messages"),
        ({"model": "m", "prompt": "a\ud800"}, "prompt"),  # never reaches the tokenizer
        ({"model": "m", "prompt": ["\udc00"]}, "prompt[0]"),
        (["not", "an", "object"], "body"),
    ],
)
def test_bad_completion_bodies_are_refused_naming_the_parameter(body, param):
    with pytest.raises(InvalidArgument) as caught:
        decode_completion(parse_body(CompletionRequest, body))
    assert caught.value.field == param


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize(
    ("response_format", "constraint"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, Constraint("json_object", compact=True)),
        # OpenAI's strict defaults to false: keywords the server cannot enforce are dropped, the rest enforced.
        (
            {"type": "json_schema", "json_schema": {"name": "n-1", "schema": SCHEMA}},
            Constraint("json_schema", json.dumps(SCHEMA), strict=False, compact=True),
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "n", "description": "a count", "schema": SCHEMA, "strict": True},
            },
            Constraint("json_schema", json.dumps(SCHEMA), strict=True, compact=True),
        ),
    ],
)
def test_response_format_becomes_the_engines_constraint(response_format, constraint):
    assert chat(response_format=response_format).generate.request.params.constraint == constraint
    completion = decode_completion(
        parse_body(CompletionRequest, {"model": "m", "prompt": "a", "response_format": response_format})
    )
    assert completion.generate.request.params.constraint == constraint


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ("json", "response_format"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_object", "schema": SCHEMA}, "response_format.schema"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_object", "json_schema": {"name": "n", "schema": SCHEMA}}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "n"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "n", "schema": [1]}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "n", "schema": "{}"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}, "response_format.json_schema.name"),
        (
            {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": "yes"}},
            "response_format.json_schema.strict",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "format": 1}},
            "response_format.json_schema.format",
        ),
    ],
)
def test_a_bad_response_format_is_refused_naming_its_path(response_format, param):
    with pytest.raises(InvalidArgument) as caught:
        chat(response_format=response_format)
    assert caught.value.field == param


def test_ignore_eos_is_refused_with_a_response_format():
    with pytest.raises(InvalidArgument) as caught:
        chat(response_format={"type": "json_object"}, ignore_eos=True)
    assert caught.value.field == "ignore_eos"


def test_the_engines_constraint_errors_name_the_response_format():
    """A schema that does not compile is refused by the engine naming its kind; the client reads its body's path."""
    from deployments.openai.codec import http_param

    assert http_param("json_schema") == "response_format.json_schema.schema"
    assert http_param("json_object") == "response_format"


# Values a client can send for the fields that reach the workers, the unrepresentable ones included.
TEXT = st.one_of(st.text(max_size=8), st.sampled_from(["\ud800", "a\udfff", "\udc00b"]))
FLOATS = st.one_of(st.floats(), st.floats(0, 1), st.sampled_from([1e-50, 1e-40, 2.0**-126, 3e38, 1e39]))
SAMPLING_FIELDS = {
    "temperature": FLOATS,
    "top_p": FLOATS,
    "top_k": st.one_of(st.integers(-2, 100), st.integers(-(2**70), 2**70)),
    "seed": st.integers(-(2**70), 2**70),
    "cache_salt": TEXT,
    "stop": st.lists(TEXT, max_size=3),
}


@settings(max_examples=300, deadline=None)
@given(fields=st.fixed_dictionaries({}, optional=SAMPLING_FIELDS), content=TEXT)
def test_every_body_the_edge_accepts_can_be_sent_to_the_workers(fields, content):
    """What parse_body and decode_chat accept, the router can put on the workers' wire (a value it cannot would fail
    every request admitted with it), and the worker reads the shaping the sampler would use in process (float32)."""
    try:
        call = chat(messages=[{"role": "user", "content": content}], **fields)
    except InvalidArgument:
        return
    request = call.generate.request
    shaping = request.params.shaping
    item = PrefillItem("s", [1, 2], shaping, 0.5, request.cache_salt)
    sent = wpb.PrefillRequest.FromString(worker_codec.encode_prefill([item]).SerializeToString())
    back = worker_codec.decode_prefill(sent, 400)[0]
    assert back.cache_salt == request.cache_salt and back.shaping.top_k == shaping.top_k
    for name in ("temperature", "top_p"):
        assert np.float32(getattr(back.shaping, name)) == np.float32(getattr(shaping, name)), name
    worker_codec.encode_start("s", [1, 2], request.cache_salt).SerializeToString()
