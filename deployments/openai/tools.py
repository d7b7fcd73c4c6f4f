"""Tool calls on the chat API: the format a model writes them in, the tools as the chat template gets them, and the
grammar that forces a call when `tool_choice` asks for one.

The format is Hermes's, which Qwen2.5 (and Qwen3, Hermes 2/3, ...) are trained on and their templates ask for:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, blocks separated by a newline. It is the one format this server forces and parses: a model whose
template asks for another (Llama 3.1's, Mistral's) still gets forced calls in this one, but its own calls under
`auto` come back as content.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deployments.openai.protocol import ChatCompletionRequest
from deployments.openai.tool_protocol import ToolDefinition
from specdec_core.chat import Tool
from specdec_core.errors import InvalidArgument
from specdec_core.grammar.compiler import check
from specdec_core.grammar.constraint import Constraint

BEGIN, END, SEPARATOR = "<tool_call>", "</tool_call>", "\n"
# JSON written as the templates write earlier calls into the prompt (json.dumps' separators, one line), so that a
# forced call looks like the model's own.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters left out


@dataclass(frozen=True)
class ToolCallFormat:
    """How a grammar spells the call markers for one tokenizer: by token id where the tokenizer added the marker as
    one token (Qwen2.5's are), since llguidance treats every added token as special and a quoted string never
    matches one; as text otherwise (the model writes it in ordinary tokens)."""

    begin_token: int | None = None
    end_token: int | None = None

    @classmethod
    def of(cls, tokenizer: Any) -> ToolCallFormat:
        added = tokenizer.get_added_vocab()  # {token text: id}
        return cls(added.get(BEGIN), added.get(END))

    def marker(self, text: str, token: int | None) -> str:
        return f"<[{token}]>" if token is not None else json.dumps(text)


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's output is read for calls (`tool_parser.ToolCallParser`)."""

    names: tuple[str, ...]  # the functions it may call: a block naming another is not a call
    parallel: bool  # false: only the first call is returned


def prompt_tools(body: ChatCompletionRequest) -> tuple[Tool, ...]:
    """The tools the chat template renders. tool_choice none renders none: the model is not to call any, and a
    model told of tools may still write a call, which would then reach the client as text."""
    if body.tool_mode == "none":
        return ()
    return tuple(
        Tool(
            t.function.name,
            t.function.description,
            None if t.function.parameters is None else json.dumps(t.function.parameters),
        )
        for t in body.tools or ()
    )


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    if body.tool_mode == "none":
        return None
    return ToolPlan(tuple(t.function.name for t in body.tools or ()), body.parallel_tool_calls is not False)


def forced_constraint(body: ChatCompletionRequest, fmt: ToolCallFormat) -> Constraint | None:
    """The grammar of a forced call (tool_choice required, or a named function): the output is exactly one call
    block, or with required and parallel_tool_calls one or more, each a function among those allowed with
    arguments its schema accepts, then the end of the output. None where calls are not forced."""
    mode = body.tool_mode
    if mode not in ("required", "function"):
        return None
    tools = list(enumerate(body.tools or ()))
    if mode == "function":
        tools = [(i, t) for i, t in tools if t.function.name == body.tool_choice.function.name]
    several = mode == "required" and body.parallel_tool_calls is not False
    return Constraint("grammar", call_grammar(tools, fmt, several))


def call_grammar(tools: Sequence[tuple[int, ToolDefinition]], fmt: ToolCallFormat, several: bool) -> str:
    """Lark (llguidance's): each tool's call is its name as a literal and its arguments as a `%json` of its own
    schema, which stays the root of its `$ref`s and keeps its own strictness."""
    block = f'{fmt.marker(BEGIN, fmt.begin_token)} "\\n" call "\\n" {fmt.marker(END, fmt.end_token)}'
    lines = [
        f"start: block ({json.dumps(SEPARATOR)} block)*" if several else "start: block",
        f"block: {block}",
        "call: " + " | ".join(f"call_{i}" for i, _ in tools),
    ]
    for i, tool in tools:
        opening = '{"name": ' + json.dumps(tool.function.name) + ', "arguments": '
        lines.append(f'call_{i}: {json.dumps(opening)} args_{i} "}}"')
        lines.append(f"args_{i}: %json {json.dumps(arguments_schema(i, tool))}")
    return "\n".join(lines) + "\n"


def arguments_schema(index: int, tool: ToolDefinition) -> dict[str, Any]:
    """The tool's parameters as the schema its forced arguments follow; refused naming
    `tools[i].function.parameters` where it does not compile (or, strict, uses what cannot be enforced)."""
    field = f"tools[{index}].function.parameters"
    function = tool.function
    schema = dict(NO_ARGUMENTS if function.parameters is None else function.parameters)
    if schema.setdefault("type", "object") != "object":
        raise InvalidArgument(field, f"must describe an object (the arguments), not type {schema['type']!r}")
    strict = bool(function.strict)
    # Ours over the schema's own "x-guidance": the calls' JSON style, and strictness a schema cannot turn off.
    own = schema.get("x-guidance")
    schema["x-guidance"] = {**(own if isinstance(own, dict) else {}), **JSON_STYLE, "lenient": not strict}
    try:
        check(Constraint("json_schema", json.dumps(schema), strict=strict))
    except InvalidArgument as exc:
        raise InvalidArgument(field, exc.message) from None
    return schema
