"""Tools on the chat API, before the engine: what a body may say (refusals name its path), what the chat template
is given, and the grammar of a forced call, compiled for a tokenizer that spells the markers in text and for one
that has them as tokens (as Qwen2.5's has)."""

from __future__ import annotations

import json

import pytest

from deployments.openai.codec import decode_chat
from deployments.openai.protocol import ChatCompletionRequest, parse_body
from deployments.openai.tools import ToolCallFormat, ToolPlan
from specdec_core.chat import ChatMessage, Tool, ToolCall, encode_chat
from specdec_core.errors import InvalidArgument
from specdec_core.grammar.compiler import GrammarCompiler
from specdec_core.grammar.state import GrammarState
from specdec_core.models.tiny import EOS_TOKEN, build_tiny_tokenizer

WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER_ARGS, "strict": True},
    },
    {"type": "function", "function": {"name": "noop"}},
]
USER = [{"role": "user", "content": "weather in Paris?"}]


def chat(**extra):
    return decode_chat(
        parse_body(ChatCompletionRequest, {"model": "m", "messages": USER, **extra}), default_max_tokens=50
    )


def refused(**extra) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as caught:
        chat(**extra)
    return caught.value


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
        ({"tools": [{"type": "function", "function": {"name": "f", "colour": 1}}]}, "tools[0].function.colour"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),  # defined twice
        ({"tools": "get_weather"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": 3}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}},
            "tool_choice.function.name",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "function": {"name": "noop"}}}, "tool_choice.type"),
        ({"tool_choice": "required"}, "tool_choice"),  # nothing to choose from
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "user", "tool_calls": []}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "tool", "tool_call_id": "call_1"}]}, "messages[0].content"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {
                "messages": USER
                + [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}],
                    }
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].id",
        ),
    ],
)
def test_bad_tool_fields_are_refused_naming_their_path(extra, param):
    assert refused(**extra).field == param


@pytest.mark.parametrize(
    ("choice", "forced", "plan"),
    [
        (None, False, ToolPlan(("get_weather", "noop"), True)),  # auto: OpenAI's default with tools
        ("auto", False, ToolPlan(("get_weather", "noop"), True)),
        ("required", True, ToolPlan(("get_weather", "noop"), True)),
        ({"type": "function", "function": {"name": "noop"}}, True, ToolPlan(("get_weather", "noop"), True)),
        ("none", False, None),
    ],
)
def test_tool_choice_decides_the_prompt_the_grammar_and_the_reading(choice, forced, plan):
    call = chat(tools=TOOLS, **({} if choice is None else {"tool_choice": choice}))
    constraint = call.generate.request.params.constraint
    assert (constraint is not None) == forced and call.tools == plan
    assert [t.name for t in call.generate.prompt.tools] == ([] if plan is None else ["get_weather", "noop"])
    if forced:
        assert constraint.kind == "grammar"


def test_no_tools_is_a_plain_chat_request():
    for extra in ({}, {"tools": []}, {"tools": [], "tool_choice": "none"}, {"parallel_tool_calls": False}):
        call = chat(**extra)
        assert (
            call.tools is None and call.generate.prompt.tools == () and call.generate.request.params.constraint is None
        )


def test_history_with_calls_and_results_reaches_the_prompt():
    messages = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18 C"}]},
    ]
    prompt = chat(messages=messages, tools=TOOLS).generate.prompt
    assert prompt.messages[1] == ChatMessage(
        "assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Paris", "unit": "c"}'),)
    )
    assert prompt.messages[2] == ChatMessage("tool", "18 C", tool_call_id="call_1")
    assert prompt.tools[0] == Tool("get_weather", "Weather now", json.dumps(WEATHER_ARGS))


# -- rendering through the chat template -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def rendered(tokenizer, **extra) -> str:
    prompt = chat(**extra).generate.prompt
    return tokenizer.decode(encode_chat(tokenizer, prompt.messages, prompt.tools))


def test_the_template_tells_the_model_of_the_tools(tokenizer):
    text = rendered(tokenizer, tools=TOOLS)
    assert json.dumps(TOOLS[1]) in text and '"name": "get_weather", "description": "Weather now"' in text
    assert "<tool_call>" in text and text.endswith("<|im_start|>assistant\n")
    assert rendered(tokenizer, tools=TOOLS, tool_choice="none") == rendered(tokenizer)  # none: not told


def test_calls_and_results_render_as_the_model_writes_and_reads_them(tokenizer):
    messages = USER + [
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    text = rendered(tokenizer, messages=messages, tools=TOOLS)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
        "\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n"
    ) in text


def test_a_template_that_ignores_tools_is_refused_naming_tools(tokenizer):
    plain = build_tiny_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(InvalidArgument) as caught:
        encode_chat(plain, [ChatMessage("user", "hi")], [Tool("noop")])
    assert caught.value.field == "tools"


# -- the grammar of a forced call ------------------------------------------------------------------------------------


def with_marker_tokens():
    """The tiny tokenizer with the markers added as single tokens, as Qwen2.5's vocabulary has them."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    return tokenizer


@pytest.fixture(scope="module", params=["text markers", "marker tokens"])
def grammar_tokenizer(request):
    tokenizer = build_tiny_tokenizer() if request.param == "text markers" else with_marker_tokens()
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer), [eos])


def takes(grammar_tokenizer, extra: dict, text: str) -> bool:
    """The forced grammar of a request with `extra`, for the tokenizer: `text`, as its tokens, is a whole output."""
    tokenizer, compiler = grammar_tokenizer
    body = parse_body(ChatCompletionRequest, {"model": "m", "messages": USER, "tools": TOOLS, **extra})
    constraint = decode_chat(body, 50, ToolCallFormat.of(tokenizer)).generate.request.params.constraint
    state = GrammarState(compiler.compile(constraint))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return state.advance(tokens) == len(tokens) and state.can_end()


def block(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_the_markers_are_tokens_where_the_vocabulary_has_them(grammar_tokenizer):
    tokenizer, _ = grammar_tokenizer
    fmt = ToolCallFormat.of(tokenizer)
    single = len(tokenizer.encode("<tool_call>", add_special_tokens=False)) == 1
    assert (fmt.begin_token is not None) == (fmt.end_token is not None) == single


NAMED = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
PARIS = block("get_weather", '{"city": "Paris", "unit": "c"}')


@pytest.mark.parametrize(
    ("extra", "text", "taken"),
    [
        (NAMED, PARIS, True),
        (NAMED, block("noop", "{}"), False),  # another function than the named one
        (NAMED, block("get_weather", '{"city": "Paris"}'), False),  # the schema's required
        (NAMED, block("get_weather", '{"city": "Paris", "unit": "k"}'), False),
        (NAMED, block("get_weather", '{"city": "Paris, France, Europe", "unit": "c"}'), False),  # maxLength
        (NAMED, block("get_weather", '{"city":"Paris","unit":"c"}'), False),  # the template's separators only
        (NAMED, PARIS + "\n" + PARIS, False),  # one call
        (NAMED, "Sure. " + PARIS, False),  # nothing but the call
        ({"tool_choice": "required"}, PARIS + "\n" + block("noop", "{}"), True),  # any of them, several
        ({"tool_choice": "required"}, block("noop", '{"x": 1}'), False),  # no parameters: no arguments
        ({"tool_choice": "required", "parallel_tool_calls": False}, PARIS + "\n" + block("noop", "{}"), False),
        ({"tool_choice": "required", "parallel_tool_calls": False}, block("noop", "{}"), True),
    ],
)
def test_a_forced_call_is_a_call_block_of_an_allowed_tool_with_valid_arguments(grammar_tokenizer, extra, text, taken):
    assert takes(grammar_tokenizer, extra, text) == taken


def test_a_parameters_schema_the_server_cannot_enforce(grammar_tokenizer):
    """strict: a 400 naming the tool's parameters; not strict (OpenAI's default): the keyword is dropped."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}, "required": ["n"]}
    for strict in (True, False):
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema, "strict": strict}}]
        if strict:
            error = refused(tools=tools, tool_choice="required")
            assert error.field == "tools[0].function.parameters" and "not" in error.message
            chat(tools=tools)  # auto does not enforce schemas: nothing to refuse
        else:
            assert takes(grammar_tokenizer, {"tools": tools, "tool_choice": "required"}, block("f", '{"n": 3}'))
    error = refused(
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], tool_choice="required"
    )
    assert error.field == "tools[0].function.parameters" and "object" in error.message


def test_a_schemas_refs_resolve_in_its_own_document(grammar_tokenizer):
    schema = {
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/place"}},
        "required": ["at"],
        "additionalProperties": False,
        "$defs": {"place": {"enum": ["home", "work"]}},
    }
    extra = {
        "tools": [{"type": "function", "function": {"name": "go", "parameters": schema}}],
        "tool_choice": "required",
    }
    assert takes(grammar_tokenizer, extra, block("go", '{"at": "work"}'))
    assert not takes(grammar_tokenizer, extra, block("go", '{"at": "moon"}'))
