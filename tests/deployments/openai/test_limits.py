"""Limits that apply before any work, over the HTTP API of a router in process (a real engine over the tiny models, no
Ray): a prompt over `router.max_prompt_bytes` is a 400 naming it before the tokenizer sees it, a body over the
body limit is refused unread, and both are counted as refused."""

from __future__ import annotations

import asyncio
import json

import pytest

from deployments.openai.http import MAX_BODY_BYTES, error_body
from specdec_core.errors import InvalidArgument
from tests.deployments.test_router import BIG, TOKEN, count_tokenizer, record_requests
from tests.helpers import asgi_post

AUTH = [(b"authorization", f"Bearer {TOKEN}".encode())]


def _post(app, path: str, body: dict, headers=AUTH) -> tuple[int, dict]:
    status, reply, _ = asyncio.run(asgi_post(app, path, json.dumps(body, ensure_ascii=False).encode(), headers))
    return status, reply


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": BIG}]}]},
            "messages",
        ),
        ("/v1/completions", {"prompt": BIG}, "prompt"),
    ],
)
def test_a_prompt_over_max_prompt_bytes_is_400_before_it_is_tokenized(make_router, path, body, param):
    router, engine = make_router()
    tokenizer = count_tokenizer(router)
    recorded = record_requests(router)
    app = router.__serve_build_asgi_app__()
    status, error = _post(app, path, {"model": router.served_model_name, "max_tokens": 4, **body})
    assert status == 400 and error["error"]["param"] == param, error
    assert error["error"]["type"] == "invalid_request_error" and "router.max_prompt_bytes" in error["error"]["message"]
    assert tokenizer.calls == 0 and not engine.has_work
    assert recorded.by(finish_reason="refused", code="invalid_argument") == 1
    # The next request is served.
    status, reply = _post(
        app,
        "/v1/chat/completions",
        {
            "model": router.served_model_name,
            "max_tokens": 4,
            "ignore_eos": True,  # sampled at temperature 1: exactly 4 tokens, whatever the tiny model draws
            "messages": [{"role": "user", "content": "hello"}],
        },
    )
    assert status == 200 and reply["usage"]["completion_tokens"] == 4 and tokenizer.calls > 0, reply


def test_the_tools_count_towards_the_prompt(make_router):
    router, _ = make_router(max_prompt_bytes=2000)
    tokenizer = count_tokenizer(router)
    app = router.__serve_build_asgi_app__()
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 3000}}]
    status, error = _post(
        app,
        "/v1/chat/completions",
        {"model": router.served_model_name, "tools": tools, "messages": [{"role": "user", "content": "hello"}]},
    )
    assert status == 400 and error["error"]["param"] == "tools"
    assert "router.max_prompt_bytes" in error["error"]["message"]
    assert tokenizer.calls == 0


def test_a_body_over_the_limit_is_refused_unread_and_counted(make_router):
    router, engine = make_router()
    recorded = record_requests(router)
    app = router.__serve_build_asgi_app__()
    declared = [(b"content-length", str(MAX_BODY_BYTES + 1).encode())]
    status, error, reads = asyncio.run(asgi_post(app, "/v1/completions", b"{}", AUTH + declared))
    assert status == 400 and error["error"]["param"] == "body" and reads == 0
    status, error, _ = asyncio.run(asgi_post(app, "/v1/completions", b"x" * (MAX_BODY_BYTES + 1), AUTH))
    assert status == 400 and error["error"]["param"] == "body"
    status, error, _ = asyncio.run(asgi_post(app, "/v1/completions", b"{}", []))  # no token
    assert status == 401
    assert recorded.by(finish_reason="refused", code="invalid_argument") == 2
    assert recorded.by(finish_reason="refused", code="unauthenticated") == 1
    status, error, _ = asyncio.run(asgi_post(app, "/v1/completions", b"{}", [(b"content-length", b"2"), *AUTH]))
    assert status == 400 and error["error"]["param"] != "body" and not engine.has_work  # read: {} lacks a model


def _deep_schema(levels: int) -> str:
    return '{"type": "array", "items": ' * levels + "{}" + "}" * levels


@pytest.mark.parametrize(
    "path, raw, param",
    [
        # Nesting: past the JSON parser's recursion, then past the bound parsers and schema compilers share.
        ("/v1/completions", '{"prompt": "x", "metadata": ' + "[" * 5000 + "]" * 5000 + "}", "body"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", '
            f'"json_schema": {{"name": "n", "schema": {_deep_schema(100)}}}}}}}',
            "response_format",
        ),
        # Lone surrogates (JSON's escapes write them): in the prompt, before the tokenizer; in a key an error quotes.
        ("/v1/completions", '{"prompt": "a\\ud800"}', "prompt"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x", "\\ud800": 1}]}', "messages[0]"),
    ],
)
def test_values_no_field_may_hold_are_400_naming_it_before_any_work(make_router, path, raw, param):
    router, engine = make_router()
    tokenizer = count_tokenizer(router)
    app = router.__serve_build_asgi_app__()
    body = raw.replace("{", f'{{"model": {json.dumps(router.served_model_name)}, ', 1).encode()
    status, error, _ = asyncio.run(asgi_post(app, path, body, AUTH))
    assert status == 400 and error["error"]["param"] == param, error
    assert tokenizer.calls == 0 and not engine.has_work
    status, reply = _post(app, "/v1/completions", {"model": router.served_model_name, "prompt": "hi", "max_tokens": 2})
    assert status == 200 and reply["usage"]["completion_tokens"] == 2, reply


def test_an_error_that_quotes_a_lone_surrogate_is_still_sent():
    """The error body is UTF-8: what it quotes of the request is escaped rather than failing the response."""
    status, body = error_body(InvalidArgument("tools[0].\ud800", "unknown key \ud800"))
    assert status == 400 and json.loads(json.dumps(body, ensure_ascii=False).encode())["error"]["param"] == (
        "tools[0].\\ud800"
    )
