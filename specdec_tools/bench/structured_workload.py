"""The workload of `specdec bench structured`: JSONL, one request a line, each standing for the chat completion the
HTTP API would receive, so that its prompt and its constraint are built by the API's own code (`decode_chat`).

- extraction: `{"prompt": "...", "schema": {...}}`: a `response_format` of type json_schema, strict (every keyword
  enforced, or the line is refused), compact as the API makes it;
- a forced tool call: `{"prompt": "...", "tools": [...], "tool_choice": {"type": "function", "function": {...}}}`
  (or "required"): the chat template renders the tools, and the API's grammar forces the call.

Optional on either: "id" (default `line-N`), "system" (a system turn before the prompt). A line is checked whole,
its constraint compiled, before any model loads; an error names the file and the line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deployments.openai.codec import decode_chat
from deployments.openai.protocol import ChatCompletionRequest, parse_body
from deployments.openai.tools import ToolCallFormat
from specdec_core.chat import encode_chat
from specdec_core.errors import InvalidArgument
from specdec_core.grammar.compiler import check
from specdec_core.grammar.constraint import Constraint
from specdec_tools.bench.structured_check import OutputCheck, SchemaCheck, ToolCallCheck

SCHEMA, TOOL = "schema", "tool"
KEYS = {SCHEMA: {"id", "system", "prompt", "schema"}, TOOL: {"id", "system", "prompt", "tools", "tool_choice"}}
MODEL = "specdec-bench"  # the body's model field: a request names one, nothing here reads it
_UNUSED_MAX_TOKENS = 1  # `decode_chat` wants a default length; the bench sets its own per request


@dataclass(frozen=True)
class StructuredItem:
    """One line: the chat completion request it stands for."""

    name: str
    kind: str  # SCHEMA or TOOL
    body: ChatCompletionRequest


@dataclass(frozen=True)
class StructuredRequest:
    """One line encoded for a tokenizer: what every mode runs, and what its output must be."""

    name: str
    kind: str
    prompt: tuple[int, ...]  # token ids: the chat template over the turns (and the tools)
    constraint: Constraint  # the API's: compact JSON for a schema, the forced call's grammar for tools
    check: OutputCheck  # is an output valid: it parses and its schema accepts it


def _lines(path: Path, flag: str) -> Iterator[tuple[int, Any]]:
    if not path.is_file():
        raise InvalidArgument(flag, f"{str(path)!r} is not a file")
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(flag, f"{path}:{number}: not JSON: {exc}") from None


def _body(item: Any) -> tuple[str, dict[str, Any]]:
    """The line's kind and its chat completion body; `InvalidArgument` naming what is wrong."""
    if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
        raise InvalidArgument("prompt", 'expected a JSON object with a non-empty "prompt"')
    kind = SCHEMA if "schema" in item else TOOL if "tools" in item else None
    if kind is None or ("schema" in item and "tools" in item):
        raise InvalidArgument("schema", 'give exactly one of "schema" and "tools" (with "tool_choice")')
    unknown = sorted(set(item) - KEYS[kind])
    if unknown:
        known = ", ".join(sorted(KEYS[kind]))
        raise InvalidArgument(unknown[0], f"unknown key(s) {', '.join(unknown)} (known: {known})")
    messages = [{"role": "system", "content": item["system"]}] if "system" in item else []
    body: dict[str, Any] = {"model": MODEL, "messages": [*messages, {"role": "user", "content": item["prompt"]}]}
    if kind == SCHEMA:
        # strict: a keyword the engine cannot enforce is refused here, so every output is held to the whole schema.
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "extraction", "schema": item["schema"], "strict": True},
        }
    else:
        body.update(tools=item["tools"], tool_choice=item.get("tool_choice"))
    return kind, body


def _item(number: int, item: Any) -> StructuredItem:
    kind, data = _body(item)
    body = parse_body(ChatCompletionRequest, data)
    call = decode_chat(body, _UNUSED_MAX_TOKENS)
    constraint = call.generate.request.params.constraint
    if constraint is None:
        raise InvalidArgument("tool_choice", 'must force a call: "required" or {"type": "function", ...}')
    check(constraint)  # markers as text here: their token ids need the tokenizer (`encode`)
    name = item.get("id", f"line-{number}")
    if not isinstance(name, str) or not name:
        raise InvalidArgument("id", "must be a non-empty string")
    return StructuredItem(name, kind, body)


def read_structured(path: Path, flag: str = "--prompts") -> tuple[StructuredItem, ...]:
    """Every line of the workload, checked; errors name `flag` and `path:line`."""
    items: list[StructuredItem] = []
    for number, value in _lines(path, flag):
        try:
            item = _item(number, value)
        except InvalidArgument as exc:
            raise InvalidArgument(flag, f"{path}:{number}: {exc.field}: {exc.message}") from None
        if any(i.name == item.name for i in items):
            raise InvalidArgument(flag, f"{path}:{number}: the id {item.name!r} is taken by an earlier line")
        items.append(item)
    if not items:
        raise InvalidArgument(flag, f"{path} holds no requests")
    return tuple(items)


def encode(item: StructuredItem, tokenizer: Any) -> StructuredRequest:
    """The line as the API would run it for this tokenizer: the call markers by token id where it has them."""
    call = decode_chat(item.body, _UNUSED_MAX_TOKENS, ToolCallFormat.of(tokenizer))
    prompt = call.generate.prompt
    ids = tuple(encode_chat(tokenizer, prompt.messages, prompt.tools))
    constraint = call.generate.request.params.constraint
    if item.kind == SCHEMA:
        return StructuredRequest(
            item.name, item.kind, ids, constraint, SchemaCheck(item.body.response_format.json_schema.json_schema)
        )
    schemas = {t.function.name: t.function.parameters for t in item.body.tools}
    return StructuredRequest(item.name, item.kind, ids, constraint, ToolCallCheck(call.tools, schemas))
