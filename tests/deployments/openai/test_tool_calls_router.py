"""Tool calls through the router in process: a real engine over the tiny models (no Ray), its HTTP app called as
Serve's proxy calls it, and the official `openai` client over an in-process transport.

The tiny target's weights are random: under tool_choice auto it writes no call, so calls are tested where they are
forced, and auto for what it renders and how it answers."""

from __future__ import annotations

import asyncio
import json

import httpx2
import openai

from tests.deployments.test_router import TOKEN, _post

COUNT_ARGS = {
    "type": "object",
    "properties": {"op": {"enum": ["add", "mean", "count"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["op", "n"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "count", "description": "Count things", "parameters": COUNT_ARGS, "strict": True},
    },
    {"type": "function", "function": {"name": "noop", "strict": True}},
]
NAMED = {"type": "function", "function": {"name": "count"}}
MESSAGES = [{"role": "user", "content": "count to three"}]
MAX_SEQ_LEN = 512  # the tiny models' positions: the tools' JSON takes ~400 of them (about a token a character)
MAX_TOKENS = 80  # a call to count takes ~70


def body(router, **extra) -> dict:
    return {
        "model": router.served_model_name,
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "return_token_ids": True,
        "tools": TOOLS,
        **extra,
    }


def valid_count(arguments: str) -> bool:
    value = json.loads(arguments)
    return set(value) == {"op", "n"} and value["op"] in ("add", "mean", "count") and 0 <= value["n"] <= 99


def without_ids(message: dict) -> dict:
    return {**message, "tool_calls": [{**c, "id": c["id"][:5]} for c in message.get("tool_calls") or []]}


def test_a_forced_call_is_a_valid_call_and_the_same_with_speculation_on_and_off(make_router):
    """T = 0: the named function's call block with arguments its schema accepts (or a cut one), token for token
    what decoding without speculation gives."""
    router, _ = make_router(max_seq_len=MAX_SEQ_LEN)
    app = router.__serve_build_asgi_app__()
    replies = {}
    for k in (0, 3):
        status, replies[k] = asyncio.run(
            _post(app, "/v1/chat/completions", body(router, tool_choice=NAMED, num_speculative_tokens=k))
        )
        assert status == 200, replies[k]
    off, on = replies[0]["choices"][0], replies[3]["choices"][0]
    assert on["token_ids"] == off["token_ids"] and without_ids(on["message"]) == without_ids(off["message"])
    assert on["finish_reason"] == off["finish_reason"] and replies[3]["speculation"]["proposed"] > 0
    message = on["message"]
    if on["finish_reason"] == "length":
        assert message["content"].startswith("<tool_call>\n") and "tool_calls" not in message
        return
    (call,) = message["tool_calls"]
    assert on["finish_reason"] == "tool_calls" and message["content"] is None
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "count"
    assert valid_count(call["function"]["arguments"])


async def _with_client(app, scenario):
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://router") as http:
        client = openai.AsyncOpenAI(base_url="http://router/v1", api_key=TOKEN, max_retries=0, http_client=http)
        return await scenario(client)


def test_the_clients_stream_accumulates_to_the_unary_answer(make_router):
    """The official client's stream helper reads the stream event by event (it parses strict tools' arguments
    as they complete) and ends on the message the unary request answers."""
    router, _ = make_router(max_seq_len=MAX_SEQ_LEN)
    args = dict(
        model=router.served_model_name,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )

    async def scenario(client):
        unary = await client.chat.completions.create(**args)
        async with client.chat.completions.stream(**args) as stream:
            kinds = {event.type async for event in stream}
            final = await stream.get_final_completion()
        return unary, kinds, final

    unary, kinds, final = asyncio.run(_with_client(router.__serve_build_asgi_app__(), scenario))
    want, got = unary.choices[0], final.choices[0]
    assert got.finish_reason == want.finish_reason == "tool_calls"
    assert got.message.content == want.message.content is None
    (call,) = got.message.tool_calls
    (wanted,) = want.message.tool_calls
    assert (call.function.name, call.function.arguments) == (wanted.function.name, wanted.function.arguments)
    assert call.function.parsed_arguments == json.loads(wanted.function.arguments)  # the client parsed it
    assert "tool_calls.function.arguments.done" in kinds and "content.delta" not in kinds
    if call.function.name == "count":
        assert valid_count(call.function.arguments)


def test_auto_renders_the_tools_and_answers_text_and_none_renders_nothing(make_router):
    """auto leaves the output free (the random model writes text, no call); a conversation with an earlier call
    and its result is rendered for the model; none tells the model of no tools."""
    router, _ = make_router(max_seq_len=MAX_SEQ_LEN)
    app = router.__serve_build_asgi_app__()
    history = MESSAGES + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "count", "arguments": '{"op": "count", "n": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "1 2 3"},
    ]
    prompt_tokens = {}
    for name, extra in {
        "auto": {},
        "history": {"messages": history},
        "none": {"tool_choice": "none"},
        "plain": {"tools": None},
    }.items():
        request = body(router, max_tokens=8, **{"tools": TOOLS[:1], **extra})
        status, reply = asyncio.run(_post(app, "/v1/chat/completions", request))
        assert status == 200, reply
        choice = reply["choices"][0]
        assert choice["finish_reason"] in ("stop", "length") and "tool_calls" not in choice["message"]
        prompt_tokens[name] = reply["usage"]["prompt_tokens"]
    assert prompt_tokens["none"] == prompt_tokens["plain"] < prompt_tokens["auto"] < prompt_tokens["history"]
