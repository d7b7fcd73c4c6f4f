"""Whether a structured output is what its request asked for, checked independently of the grammar engine that
produced it: a JSON Schema validator (`jsonschema`) for extraction, and for tool calls the HTTP API's own reader
of calls (`ToolCallParser`), then the validator on each call's arguments. Only outputs that ended of themselves are
checked: one cut by max_tokens is unfinished, not invalid."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from jsonschema.exceptions import best_match
from jsonschema.validators import validator_for

from deployments.openai.tool_parser import ParsedCall, ToolCallParser
from deployments.openai.tools import NO_ARGUMENTS, ToolPlan


class OutputCheck(Protocol):
    def problem(self, text: str) -> str | None:
        """Why `text` is not a valid output; None where it is."""


def schema_problem(schema: Mapping[str, Any], value: Any) -> str | None:
    """The validator's most relevant error for `value` under `schema` (its own draft, 2020-12 by default)."""
    error = best_match(validator_for(schema)(schema).iter_errors(value))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where or '(root)'}: {error.message}"


@dataclass(frozen=True)
class SchemaCheck:
    """The output is one JSON value that `schema` accepts."""

    schema: Mapping[str, Any]

    def problem(self, text: str) -> str | None:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"not JSON: {exc}"
        return schema_problem(self.schema, value)


@dataclass(frozen=True)
class ToolCallCheck:
    """The output is calls only, as the API reads them (`plan`), each with arguments its tool's schema accepts."""

    plan: ToolPlan
    parameters: Mapping[str, Mapping[str, Any] | None]  # by tool name; None: the tool takes no arguments

    def problem(self, text: str) -> str | None:
        parser = ToolCallParser(self.plan)
        events = parser.feed(text) + parser.finish()
        content = "".join(e for e in events if isinstance(e, str)).strip()
        calls = [e for e in events if isinstance(e, ParsedCall)]
        if content:
            return f"not a call: {content[:80]!r}"
        if not calls:
            return "no call"
        for call in calls:
            schema = self.parameters[call.name]
            problem = schema_problem(NO_ARGUMENTS if schema is None else schema, json.loads(call.arguments))
            if problem is not None:
                return f"{call.name} arguments: {problem}"
        return None
