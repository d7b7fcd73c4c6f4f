"""The one client of `specdec bench peer`: a completions request both servers get alike, sent `concurrency` at a
time, and its answer read as either server gives it (token ids, speculation counts)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from specdec_tools.bench import peer_llama as llama

REQUEST_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    text: str
    completion_tokens: int  # as the server's usage counts them
    drafted: int  # draft tokens proposed (ours: `speculation.proposed`; llama-server: `timings.draft_n`)
    accepted: int
    ids_from: str  # "server", or "text" where the server returned no ids and the text was re-tokenized


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server as the client drives it. `extras`: the fields only this server's requests carry
    (those that return the token ids; ours, the speculation setting and cache salt)."""

    base_url: str
    model: str
    headers: Mapping[str, str] = field(default_factory=dict)
    extras: Mapping[str, Any] = field(default_factory=dict)


def completion_body(
    endpoint: Endpoint, prompt_ids: Sequence[int], max_tokens: int, ignore_eos: bool = True
) -> dict[str, Any]:
    """The one request body both servers get, but for `endpoint.extras`."""
    return {
        "model": endpoint.model,
        "prompt": list(prompt_ids),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": ignore_eos,
        "stream": False,
        **endpoint.extras,
    }


def _http(url: str, headers: Mapping[str, str], body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
            return dict(json.loads(answer.read()))
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url}: HTTP {exc.code} {exc.read().decode(errors='replace')[:500]}") from None


def model_id(base_url: str, headers: Mapping[str, str]) -> str:
    """The served model's id (GET /v1/models): what each server wants as `model`."""
    return str(_http(f"{base_url}/v1/models", headers)["data"][0]["id"])


def parse_completion(response: Mapping[str, Any], retokenize: Callable[[str], list[int]]) -> Completion:
    """A completions answer: ids as ours (`token_ids`) or llama-server (`__verbose.tokens`) return them, else
    `retokenize` of the text; speculation counts as ours (`speculation`) or llama-server (`timings`) give them."""
    choice = response["choices"][0]
    ids = choice.get("token_ids")
    if ids is None:
        ids = llama.token_ids(dict(response))
    ids_from = "server" if ids is not None else "text"
    if ids is None:
        ids = retokenize(choice["text"])
    ours, theirs = response.get("speculation") or {}, response.get("timings") or {}
    return Completion(
        token_ids=tuple(ids),
        text=choice["text"],
        completion_tokens=int(response["usage"]["completion_tokens"]),
        drafted=int(ours.get("proposed", theirs.get("draft_n", 0))),
        accepted=int(ours.get("accepted", theirs.get("draft_n_accepted", 0))),
        ids_from=ids_from,
    )


def complete(endpoint: Endpoint, prompt_ids: Sequence[int], max_tokens: int, ignore_eos: bool = True) -> dict[str, Any]:
    body = completion_body(endpoint, prompt_ids, max_tokens, ignore_eos)
    return _http(f"{endpoint.base_url}/v1/completions", endpoint.headers, body)


def run_set(
    endpoint: Endpoint,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    concurrency: int,
    retokenize: Callable[[str], list[int]],
) -> tuple[float, tuple[Completion, ...]]:
    """Every prompt once, `concurrency` at a time (client threads): the wall time of the whole set, and the
    completions in prompt order."""

    def one(prompt_ids: Sequence[int]) -> Completion:
        return parse_completion(complete(endpoint, prompt_ids, max_tokens), retokenize)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        start = time.perf_counter()
        completions = tuple(pool.map(one, prompts))
        seconds = time.perf_counter() - start
    return seconds, completions


Conversation = list[tuple[str, str]]  # (role, content) in order: a system prompt, then user and assistant turns


def run_sessions(
    endpoint: Endpoint,
    sessions: Sequence[tuple[str, Sequence[str]]],
    max_tokens: int,
    encode: Callable[[Conversation], list[int]],
    retokenize: Callable[[str], list[int]],
) -> tuple[float, tuple[Completion, ...]]:
    """Each (system prompt, user turns) conversation replayed one turn after another, one request at a time, each
    turn sent with the whole conversation so far, this server's own answers included (as a chat client sends it;
    `encode` makes it token ids). Answers end at eos (or `max_tokens`), as a conversation's do. The time and the
    completions of the turns after the first, where a server can reuse what it cached of the conversation: a
    conversation's first turn costs a prefill of the whole system prompt on either server."""
    seconds, later = 0.0, []
    for system, turns in sessions:
        conversation: Conversation = [("system", system)]
        for number, turn in enumerate(turns):
            conversation.append(("user", turn))
            start = time.perf_counter()
            answer = parse_completion(complete(endpoint, encode(conversation), max_tokens, False), retokenize)
            if number:
                seconds += time.perf_counter() - start
                later.append(answer)
            conversation.append(("assistant", answer.text))
    return seconds, tuple(later)
