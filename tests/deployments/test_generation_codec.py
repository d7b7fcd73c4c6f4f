"""The public protocol's codec (GenerationService <-> engine): requests decoded with errors that name the field."""

from __future__ import annotations

import pytest

from deployments import generation_codec
from specdec.v1 import generation_pb2 as pb
from specdec_core.config import AUTO, SamplingParams
from specdec_core.errors import InvalidArgument
from specdec_core.grammar.constraint import Constraint

DEEP_SCHEMA = '{"type": "array", "items": ' * 1000 + "{}" + "}" * 1000  # parsers recurse: a RecursionError


@pytest.mark.parametrize(
    "request_kwargs, field",
    [
        ({}, "prompt"),
        ({"prompt": "hi", "prompt_token_ids": [1]}, "prompt"),
        ({"prompt": "hi", "messages": [pb.ChatMessage(role="user", content="x")]}, "prompt"),
        ({"prompt_token_ids": [1], "messages": [pb.ChatMessage(role="user", content="x")]}, "prompt_token_ids"),
        ({"messages": [pb.ChatMessage(role="robot", content="x")]}, "messages.role"),
        ({"messages": [pb.ChatMessage(role="user", content="x")], "raw_prompt": True}, "raw_prompt"),
        ({"prompt": "hi", "sampling": pb.SamplingParams(temperature=-1)}, "sampling.temperature"),
        ({"prompt": "hi", "sampling": pb.SamplingParams(temperature=1e-45)}, "sampling.temperature"),  # overflows
        ({"prompt": "hi", "sampling": pb.SamplingParams(top_p=1.5)}, "sampling.top_p"),
        ({"prompt": "hi", "sampling": pb.SamplingParams(max_tokens=0)}, "sampling.max_tokens"),
        ({"prompt": "hi", "sampling": pb.SamplingParams(top_k=2**32 - 1)}, "sampling.top_k"),
        ({"prompt": "hi", "sampling": pb.SamplingParams(top_p=1e-40)}, "sampling.top_p"),  # subnormal in float32
        ({"prompt": "hi", "structured": pb.StructuredOutput(json_schema=DEEP_SCHEMA)}, "structured.json_schema"),
    ],
)
def test_bad_requests_name_the_field(request_kwargs, field):
    with pytest.raises(InvalidArgument) as err:
        generation_codec.decode_generate(pb.GenerateRequest(**request_kwargs), default_max_tokens=16)
    assert err.value.field == field


def test_defaults_and_speculation_options():
    call = generation_codec.decode_generate(pb.GenerateRequest(prompt="x"), default_max_tokens=33)
    assert call.request.params == SamplingParams(max_tokens=33) and call.request.num_speculative_tokens is None
    off = pb.GenerateRequest(prompt="x", speculation=pb.SpeculationOptions(num_speculative_tokens=0))
    assert generation_codec.decode_generate(off, 1).request.num_speculative_tokens == 0
    auto = pb.GenerateRequest(prompt="x", speculation=pb.SpeculationOptions(adaptive=True))
    assert generation_codec.decode_generate(auto, 1).request.num_speculative_tokens == AUTO


def test_engine_errors_are_named_as_request_fields():
    assert generation_codec.in_request_terms(InvalidArgument("max_tokens", "too many")).field == "sampling.max_tokens"
    speculation = generation_codec.in_request_terms(InvalidArgument("num_speculative_tokens", "x"))
    assert str(speculation).startswith("speculation.")
    same = InvalidArgument("prompt", "empty")
    assert generation_codec.in_request_terms(same) is same


STRUCTURED = [
    (
        pb.StructuredOutput(json_schema='{"type": "integer"}'),
        Constraint("json_schema", '{"type": "integer"}', compact=True),
    ),
    (
        pb.StructuredOutput(json_schema='{"type": "integer"}', lenient_schema=True),
        Constraint("json_schema", '{"type": "integer"}', strict=False, compact=True),
    ),
    (pb.StructuredOutput(json_object=True), Constraint("json_object", compact=True)),
    (pb.StructuredOutput(regex="[a-z]+"), Constraint("regex", "[a-z]+")),
    (pb.StructuredOutput(grammar='start: "yes"'), Constraint("grammar", 'start: "yes"')),
]


@pytest.mark.parametrize("structured, constraint", STRUCTURED)
def test_structured_output_decodes_to_the_engines_constraint_and_back(structured, constraint):
    request = pb.GenerateRequest.FromString(pb.GenerateRequest(prompt="x", structured=structured).SerializeToString())
    params = generation_codec.decode_generate(request, 8).request.params
    assert params.constraint == constraint
    assert generation_codec.encode_structured(constraint) == structured
    assert generation_codec.decode_generate(pb.GenerateRequest(prompt="x"), 8).request.params.constraint is None


@pytest.mark.parametrize(
    "structured, sampling, field",
    [
        (pb.StructuredOutput(), {}, "structured"),
        (pb.StructuredOutput(lenient_schema=True), {}, "structured"),
        (pb.StructuredOutput(json_object=False), {}, "structured.json_object"),
        (pb.StructuredOutput(regex="a", lenient_schema=True), {}, "structured.lenient_schema"),
        (pb.StructuredOutput(json_schema="  "), {}, "structured.json_schema"),
        (pb.StructuredOutput(grammar=""), {}, "structured.grammar"),
        (pb.StructuredOutput(json_object=True), {"ignore_eos": True}, "sampling.ignore_eos"),
    ],
)
def test_bad_structured_output_is_refused_naming_the_field(structured, sampling, field):
    request = pb.GenerateRequest(prompt="x", structured=structured, sampling=pb.SamplingParams(**sampling))
    with pytest.raises(InvalidArgument) as err:
        generation_codec.decode_generate(request, 8)
    assert err.value.field == field


def test_compile_errors_are_named_as_structured_fields():
    """The engine compiles the constraint and names its kind; the client reads its request's field."""
    for kind in ("json_schema", "json_object", "regex", "grammar"):
        assert generation_codec.in_request_terms(InvalidArgument(kind, "bad")).field == f"structured.{kind}"


@pytest.mark.parametrize(
    "text, depth",
    [
        ("1", 0),
        ('{"a": [1, {"b": 2}]}', 3),
        ('{"a": "[[[{{{"}', 1),  # brackets in a string do not nest
        ('["\\\\", ["\\"]"]]', 2),  # nor do escaped quotes end a string
        ("[" * 2000 + "]" * 2000, 2000),
    ],
)
def test_json_depth_counts_nesting_without_parsing(text, depth):
    assert generation_codec.json_depth(text) == depth


def test_a_schema_at_the_depth_limit_is_accepted():
    levels = generation_codec.MAX_JSON_DEPTH - 1  # and the innermost {}
    schema = '{"type": "array", "items": ' * levels + "{}" + "}" * levels
    request = pb.GenerateRequest(prompt="x", structured=pb.StructuredOutput(json_schema=schema))
    assert generation_codec.decode_generate(request, 16).request.params.constraint.value == schema
