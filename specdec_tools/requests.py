"""What every client in specdec_tools sends: prompts read from JSONL, and the GenerateRequest built from them.

The one place that turns a speculation setting (a fixed k, "auto", or the server's default) into the proto's
`speculation` oneof, and the one reader of prompt and session files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.v1 import generation_pb2 as pb
from specdec_core.config import AUTO
from specdec_core.errors import InvalidArgument

# Clients may receive long completions (token ids and text): more than gRPC's default 4 MiB.
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]

Speculation = int | str | None  # a fixed k (0 = off), "auto", or None for the server's setting


@dataclass(frozen=True)
class Prompt:
    text: str
    max_tokens: int


def _jsonl_objects(path: Path, flag: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON or None where the line is not JSON) for each non-blank line of a JSONL file."""
    if not path.is_file():
        raise InvalidArgument(flag, f"{str(path)!r} is not a file")
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError:
            yield number, None


def read_prompts(path: Path, max_new_tokens: int, flag: str = "--prompts") -> tuple[Prompt, ...]:
    """Each `{"prompt": "...", "max_tokens": N (optional)}` line of a JSONL file; `max_new_tokens` where a line
    gives none. Errors name `flag`, the option that gave the path."""
    prompts = []
    for number, item in _jsonl_objects(path, flag):
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise InvalidArgument(flag, f'{path}:{number}: expected a JSON object with a non-empty "prompt"')
        max_tokens = item.get("max_tokens", max_new_tokens)
        if type(max_tokens) is not int or max_tokens <= 0:
            raise InvalidArgument(flag, f'{path}:{number}: "max_tokens" must be a positive integer')
        prompts.append(Prompt(item["prompt"], max_tokens))
    if not prompts:
        raise InvalidArgument(flag, f"{path} holds no prompts")
    return tuple(prompts)


@dataclass(frozen=True)
class Session:
    """A conversation to replay: a system prompt, then user turns, each sent after the answers to the ones before."""

    id: str
    system: str
    turns: tuple[str, ...]


SESSION_KEYS = ("id", "system", "turns")


def read_sessions(path: Path, flag: str = "--sessions") -> tuple[Session, ...]:
    """Each `{"system": "...", "turns": ["...", ...], "id": "..." (optional)}` line of a JSONL file; a session
    without an id is named by its line number. Errors name `flag`."""
    sessions: list[Session] = []
    for number, item in _jsonl_objects(path, flag):
        where = f"{path}:{number}"
        if not isinstance(item, dict):
            raise InvalidArgument(flag, f'{where}: expected a JSON object {{"system": ..., "turns": [...]}}')
        unknown = sorted(set(item) - set(SESSION_KEYS))
        if unknown:
            raise InvalidArgument(
                flag, f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(SESSION_KEYS)})"
            )
        system, turns, session_id = item.get("system"), item.get("turns"), item.get("id", f"line-{number}")
        if not isinstance(system, str) or not system:
            raise InvalidArgument(flag, f'{where}: "system" must be a non-empty string')
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise InvalidArgument(flag, f'{where}: "turns" must be a non-empty list of non-empty strings')
        if not isinstance(session_id, str) or not session_id:
            raise InvalidArgument(flag, f'{where}: "id" must be a non-empty string')
        if any(s.id == session_id for s in sessions):
            raise InvalidArgument(flag, f"{where}: the id {session_id!r} is taken by an earlier session")
        sessions.append(Session(session_id, system, tuple(turns)))
    if not sessions:
        raise InvalidArgument(flag, f"{path} holds no sessions")
    return tuple(sessions)


def read_prompt_texts(path: Path, flag: str = "--prompts") -> list[str]:
    """The text of each prompt in a JSONL file (for tools that set one output length for all)."""
    return [prompt.text for prompt in read_prompts(path, 1, flag)]


def read_messages(path: Path, flag: str = "--messages") -> list[tuple[str, str]]:
    """A conversation from a JSON file: `[{"role": "system" | "user" | "assistant" | "tool", "content": "..."}]`."""
    if not path.is_file():
        raise InvalidArgument(flag, f"{str(path)!r} is not a file")
    try:
        items = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InvalidArgument(flag, f"{path} is not JSON: {exc}") from None
    if not isinstance(items, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in items
    ):
        raise InvalidArgument(flag, f'{path}: expected a JSON array of {{"role": ..., "content": ...}} objects')
    return [(m["role"], m["content"]) for m in items]


def parse_speculation(text: str | None) -> Speculation:
    """A command-line speculation setting: N (0 = off), `auto`, or None (the server's default)."""
    if text is None or text == AUTO:
        return text
    if not text.strip().isdigit():
        raise InvalidArgument("--num-speculative-tokens", f"must be a non-negative integer or auto, got {text!r}")
    return int(text)


def generate_request(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] = (),
    messages: Sequence[tuple[str, str]] = (),
    raw: bool = False,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    max_tokens: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    speculation: Speculation = None,
    request_id: str = "",
    cache_salt: str = "",
    speculation_method: str = "",
) -> pb.GenerateRequest:
    """A GenerateRequest; unset optional fields stay unset, so the server's defaults apply."""
    request = pb.GenerateRequest(
        request_id=request_id,
        raw_prompt=raw,
        prompt_token_ids=list(token_ids),
        cache_salt=cache_salt,
        speculation_method=speculation_method,
    )
    if prompt is not None:
        request.prompt = prompt
    for role, content in messages:
        request.messages.add(role=role, content=content)
    s = request.sampling
    s.temperature = temperature
    s.top_k = top_k
    s.ignore_eos = ignore_eos
    s.stop.extend(stop)
    if top_p is not None:
        s.top_p = top_p
    if seed is not None:
        s.seed = seed
    if max_tokens is not None:
        s.max_tokens = max_tokens
    if speculation == AUTO:
        request.speculation.adaptive = True
    elif speculation is not None:
        request.speculation.num_speculative_tokens = int(speculation)
    return request
