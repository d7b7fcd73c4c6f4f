"""The tool-calling parts of a chat request body, as OpenAI defines them: `tools`, `tool_choice`, and the calls an
assistant turn made (`messages[i].tool_calls`). Validated at the edge; a refusal names its path in the body
(`tools[0].function.name`), as `protocol.parse_body` reports it."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, Tag, model_validator

from deployments.generation_codec import check_json_depth
from specdec_core.errors import InvalidArgument

FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None: the function takes no arguments
    # As response_format's: true, a schema keyword the server cannot enforce is a 400; false (OpenAI's default), it
    # is dropped. Either way a schema is enforced only where the call is forced (tool_choice required or named).
    strict: StrictBool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: the model must call that function."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"]
    function: FunctionName


def _choice_kind(value: Any) -> str | None:
    return "str" if isinstance(value, str) else "dict" if isinstance(value, dict) else None


# Tagged by the value's JSON type, so that an error names the branch the client meant (a bad name inside an object
# is not reported as "should be 'none', 'auto' or 'required'"); the tags are names `parse_body` leaves out of paths.
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("str")] | Annotated[NamedToolChoice, Tag("dict")],
    Discriminator(
        _choice_kind,
        custom_error_type="tool_choice",
        custom_error_message="must be none, auto, required or {type: function, function: {name}}",
    ),
]


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    arguments: str  # OpenAI sends the arguments as JSON text

    @model_validator(mode="after")
    def _an_object(self) -> CalledFunction:
        check_json_depth("arguments", self.arguments)  # before json.loads, which recurses once a level
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError as exc:
            raise InvalidArgument("arguments", f"not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise InvalidArgument("arguments", "must be a JSON object (as text)")
        return self


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made, as this server's responses return it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1)
    type: Literal["function"]
    function: CalledFunction
