"""Reading outputs for tool calls: whole texts, the same texts cut anywhere (a stream's rounds), and the stream's
chunks accumulated by the official `openai` client's own accumulator, which must give the unary answer."""

from __future__ import annotations

import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from deployments.openai import codec
from deployments.openai.protocol import ChatCompletionRequest, parse_body
from deployments.openai.tool_parser import ParsedCall, ToolCallParser
from deployments.openai.tools import ToolPlan
from specdec_core.outputs import RequestOutput, SpecStats
from specdec_core.stopping import FinishReason

PLAN = ToolPlan(("get_weather", "noop"), parallel=True)
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
NOOP = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'


def read(text: str, plan: ToolPlan = PLAN) -> tuple[str | None, list[tuple[str, dict]]]:
    """(content or None, [(name, arguments)]) as the unary answer reads `text`."""
    parser = ToolCallParser(plan)
    return summary(parser.feed(text) + parser.finish())


def summary(events) -> tuple[str | None, list[tuple[str, dict]]]:
    content = "".join(e for e in events if isinstance(e, str)) or None
    return content, [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ParsedCall)]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("plain text, no call", "plain text, no call", []),
        (WEATHER, None, [("get_weather", {"city": "Paris", "days": 2})]),
        (WEATHER + "\n" + NOOP + "\n", None, [("get_weather", {"city": "Paris", "days": 2}), ("noop", {})]),
        (
            "Let me check.\n" + WEATHER + "\n\nDone.",
            "Let me check.Done.",
            [("get_weather", {"city": "Paris", "days": 2})],
        ),
        ("a < b and <tool> is not a call", "a < b and <tool> is not a call", []),
        ("ends in a half marker <tool_c", "ends in a half marker <tool_c", []),
        ("text ending in a newline\n", "text ending in a newline\n", []),
    ],
)
def test_calls_and_the_content_around_them(text, content, calls):
    assert read(text) == (content, calls)


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',  # not JSON
        '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',  # not one of the request's tools
        '<tool_call>\n{"name": "noop", "arguments": "{}"}\n</tool_call>',  # arguments not an object
        '<tool_call>\n["noop", {}]\n</tool_call>',
        '<tool_call>\n{"name": "noop", "arguments": {}',  # never closed: cut by max_tokens
    ],
)
def test_a_block_that_is_not_a_call_is_content_verbatim(block):
    assert read("Before.\n" + block) == ("Before.\n" + block, [])
    content, calls = read(WEATHER + "\n" + block)  # a good call before it still counts
    assert content == block and len(calls) == 1


def test_without_parallel_calls_only_the_first_is_returned():
    assert read(WEATHER + "\n" + NOOP, ToolPlan(PLAN.names, parallel=False)) == (
        None,
        [("get_weather", {"city": "Paris", "days": 2})],
    )


TEXTS = [WEATHER, "Checking.\n" + WEATHER + "\n" + NOOP + "\nThat is all.", "x <tool_c y " + NOOP + " z <"]


@pytest.mark.parametrize("text", TEXTS)
def test_any_cut_of_the_stream_reads_as_the_whole_text(text):
    """Cut in two anywhere, and in single characters: the same content and calls, and content never carries a
    piece of a call or of a marker (these texts have no "<" outside their markers but in "x <tool_c" and " <")."""
    whole = read(text)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        parser = ToolCallParser(PLAN)
        events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
        assert summary(events) == whole, pieces
        leaked = [e for e in events if isinstance(e, str) and ("tool_call>" in e or "{" in e)]
        assert not leaked, pieces


def test_ids_are_openais_shape_and_indexes_count_calls():
    parser = ToolCallParser(PLAN)
    calls = [e for e in parser.feed(WEATHER + NOOP) if isinstance(e, ParsedCall)]
    assert [c.index for c in calls] == [0, 1] and all(c.id.startswith("call_") for c in calls)
    assert len({c.id for c in calls}) == 2


# -- the stream, through the openai client's accumulator ------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "noop"}},
]


def outputs(text: str, cuts: list[int], reason: FinishReason) -> list[RequestOutput]:
    """`text` as rounds ending at `cuts`, one token id per character (the ids only have to travel)."""
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    done = 0
    rounds = []
    for i, piece in enumerate(pieces):
        done += len(piece)
        rounds.append(
            RequestOutput(
                "s", tuple(range(len(piece))), piece, reason if i == len(pieces) - 1 else None, 7, done, SpecStats()
            )
        )
    return rounds


def streamed(call, rounds) -> tuple[ChatCompletionStreamState, list[dict]]:
    state = ChatCompletionStreamState()
    parser = ToolCallParser(call.tools)
    bodies = [codec.first_chunk(call, "r")] + [b for o in rounds for b in codec.chunks(call, "r", o, parser)]
    for body in bodies:
        state.handle_chunk(ChatCompletionChunk.model_validate(json.loads(json.dumps(body))))
    return state, bodies


@pytest.mark.parametrize(
    ("text", "reason", "finish"),
    [
        ("Checking.\n" + WEATHER + "\n" + NOOP, FinishReason.EOS, "tool_calls"),
        (WEATHER, FinishReason.EOS, "tool_calls"),
        ("No call needed.", FinishReason.EOS, "stop"),
        (WEATHER + '\n<tool_call>\n{"name": "noop", "argu', FinishReason.LENGTH, "length"),
    ],
)
def test_the_clients_accumulated_stream_is_the_unary_answer(text, reason, finish):
    call = codec.decode_chat(
        parse_body(
            ChatCompletionRequest,
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "tools": TOOLS,
                "stream": True,
                "return_token_ids": True,
            },
        ),
        default_max_tokens=50,
    )
    unary = codec.response(call, "r", outputs(text, [], reason))["choices"][0]
    assert unary["finish_reason"] == finish
    for cuts in ([], [3], [5, 12, 40], list(range(1, len(text)))):
        state, bodies = streamed(call, outputs(text, cuts, reason))
        final = state.current_completion_snapshot.choices[0]  # get_final_completion refuses a "length" finish
        message = final.message
        assert final.finish_reason == finish and message.content == unary["message"]["content"]
        want = [(c["id"][:5], c["function"]) for c in unary["message"].get("tool_calls", [])]
        got = [
            (c.id[:5], {"name": c.function.name, "arguments": c.function.arguments}) for c in message.tool_calls or []
        ]
        assert got == want
        assert sum(len(b["choices"][0].get("token_ids", [])) for b in bodies) == len(text)  # every round's ids
