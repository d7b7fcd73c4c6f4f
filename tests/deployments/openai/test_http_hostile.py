"""Hostile input over the OpenAI-compatible HTTP API (real Ray Serve, the real HTTP proxy, tiny models).

Random bodies mixing valid values, values of the wrong type or out of range, and fields that are unknown or not
implemented: every request gets 200, or a 4xx whose OpenAI error names a parameter of the body; the server keeps
serving afterwards and leaves no session in the workers.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import wait_until_idle

TIMEOUT_S = 60
JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
ANY_JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
        "content": st.one_of(
            st.text(max_size=40),
            st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}), min_size=1, max_size=2
            ),
        ),
    }
)

# Each field: a valid value, or (when the example picks it as hostile) anything JSON can say, or edge values.
FIELDS = {
    "messages": (st.lists(MESSAGE, min_size=1, max_size=3), ANY_JSON),
    "prompt": (
        st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 383), min_size=1, max_size=20)),
        st.one_of(ANY_JSON, st.lists(st.integers(-5, 2**33), max_size=5)),
    ),
    "max_tokens": (st.integers(1, 6), st.one_of(ANY_JSON, st.integers(-3, 10**6))),
    "temperature": (st.one_of(st.just(0), st.floats(0.1, 2.0)), st.one_of(ANY_JSON, st.floats(-1, 1e-3))),
    "top_p": (st.floats(0.1, 1.0), ANY_JSON),
    "top_k": (st.integers(-1, 40), ANY_JSON),
    "seed": (st.integers(0, 2**63 - 1), ANY_JSON),
    "stop": (st.lists(st.text(min_size=1, max_size=5), max_size=3), ANY_JSON),
    "n": (st.just(1), ANY_JSON),
    "stream": (st.booleans(), ANY_JSON),
    "num_speculative_tokens": (st.one_of(st.integers(0, 8), st.just("auto")), ANY_JSON),
    "ignore_eos": (st.booleans(), ANY_JSON),
    "cache_salt": (st.text(min_size=1, max_size=10), ANY_JSON),
    "frequency_penalty": (st.just(0), ANY_JSON),
    "logprobs": (st.just(False), ANY_JSON),
    "user": (st.text(max_size=8), ANY_JSON),
}
UNKNOWN = st.dictionaries(
    st.text(min_size=1, max_size=8).filter(lambda k: k not in FIELDS and k != "model"), ANY_JSON, max_size=1
)


@st.composite
def bodies(draw) -> tuple[str, dict]:
    chat = draw(st.booleans())
    names = [n for n in FIELDS if n != ("prompt" if chat else "messages")]
    present = draw(st.sets(st.sampled_from(names), max_size=6)) | {"messages" if chat else "prompt", "max_tokens"}
    hostile = draw(st.sets(st.sampled_from(sorted(present)), max_size=2))
    body = {name: draw(FIELDS[name][name in hostile]) for name in sorted(present)}
    return ("/chat/completions" if chat else "/completions"), {**body, **draw(UNKNOWN)}


def post(base: str, path: str, body: dict) -> tuple[int, object]:
    request = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            raw = response.read().decode()
            if response.headers["Content-Type"].startswith("text/event-stream"):
                events = [e for e in raw.split("\n\n") if e]
                assert events[-1] == "data: [DONE]", events[-3:]
                return response.status, [json.loads(e[6:]) for e in events[:-1]]
            return response.status, json.loads(raw)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def api(served):
    _, config = served
    return f"http://127.0.0.1:{config.http_port}/v1", config


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(case=bodies())
def test_every_body_gets_200_or_a_4xx_naming_a_parameter(api, case):
    base, config = api
    path, body = case
    status, reply = post(base, path, {"model": config.served_name, **body})
    if status == 200:
        events = reply if isinstance(reply, list) else [reply]
        assert not any("error" in e for e in events), events
        return
    assert 400 <= status < 500, (status, reply)
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    param = error["param"]
    root = param.split("[")[0].split(".")[0]  # a nested field's top-level key; an unknown key is named whole
    assert param in body or root in body or root in ("model", "body", "prompt", "messages"), (error, body)


def test_the_server_still_serves_and_holds_no_session(api, served):
    base, config = api
    status, reply = post(
        base,
        "/completions",
        {"model": config.served_name, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True},
    )
    assert status == 200 and reply["usage"]["completion_tokens"] == 3
    assert wait_until_idle(served)
