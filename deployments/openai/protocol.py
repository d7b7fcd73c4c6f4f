"""Request bodies of the OpenAI-compatible API, validated at the edge.

Unknown fields are refused with a 400 naming them, never silently ignored. Three kinds of known field:
- implemented: model, messages / prompt, max_tokens / max_completion_tokens, temperature, top_p, seed, stop, n (1),
  stream, stream_options.include_usage, response_format (text, json_object, json_schema), chat's tools, tool_choice
  and parallel_tool_calls (`tool_protocol`), and vLLM's extensions top_k, ignore_eos, cache_salt,
  return_token_ids, plus our num_speculative_tokens, speculation_method and draft_variant;
- informational, accepted and ignored: user, metadata, store (false), service_tier, and per message `name`;
- OpenAI features this server does not implement: accepted only at their no-op value (a harness that sends
  `frequency_penalty: 0` still works), refused naming the field at any other value.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, model_validator

from deployments.generation_codec import MAX_JSON_DEPTH
from deployments.openai.tool_protocol import MessageToolCall, ToolChoice, ToolDefinition
from specdec_core.errors import InvalidArgument

INFORMATIONAL = ("user", "metadata", "store", "service_tier")

# Not implemented: the values that mean "off". Anything else is refused naming the field.
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "tools": ([],),  # completions: chat requests implement the three
    "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),
    "prediction": (),
    "modalities": (["text"],),
    "reasoning_effort": (),
    "web_search_options": (),
    "audio": (),
    "functions": ([],),
    "function_call": ("none",),
    "min_tokens": (0,),
}

MAX_SALT_LENGTH = 256  # as the gRPC API's (deployments.generation_codec.MAX_CACHE_SALT)
MAX_TOOLS = 128  # OpenAI's limit


def _unsupported(field: str, value: Any) -> InvalidArgument:
    return InvalidArgument(field, f"{value!r} is not supported by this server (only its no-op value is accepted)")


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`, as OpenAI defines it. `strict` false or unset (OpenAI's default): schema
    keywords the server cannot enforce are dropped and the rest enforced; true: they are a 400 naming them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # OpenAI's rule
    description: str | None = None  # informational: the model is not told (no prompt is rewritten)
    # `schema` would shadow BaseModel.schema(): the alias keeps the body's name, which errors report.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: one model rather than a union on `type`, so that errors name the body's path
    (`response_format.json_schema.schema`) with no union branch in it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise InvalidArgument("json_schema", "required with type json_schema, and only with it")
        return self


class _Body(BaseModel):
    # Unknown fields are collected (extra="allow") and refused in `_refuse_unknown`, which knows the informational
    # and no-op ones; pydantic's own "extra fields not permitted" could not tell them apart.
    model_config = ConfigDict(extra="allow", frozen=True)

    model: str
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: StrictInt | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    n: StrictInt = 1  # one choice per request: other values are refused
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # Extensions, as vLLM names them (OpenAI clients send them through extra_body).
    top_k: StrictInt | None = Field(None, ge=-1)  # -1 or 0: off
    ignore_eos: StrictBool = False
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_LENGTH)
    return_token_ids: StrictBool = False
    num_speculative_tokens: Annotated[StrictInt, Field(ge=0)] | Literal["auto"] | None = None
    # auto, none, or a method the server runs (draft_model, suffix, ngram): the engine checks the name.
    speculation_method: str | None = Field(None, min_length=1, max_length=64)
    # A/B of drafts: the variant to draft with (the router checks the name); None: assigned by weight.
    draft_variant: str | None = Field(None, min_length=1, max_length=64)

    @model_validator(mode="after")
    def _refuse_unknown(self) -> _Body:
        for name, value in (self.model_extra or {}).items():
            if name in INFORMATIONAL:
                if name == "store" and value not in (None, False):
                    raise _unsupported(name, value)
                continue
            if name not in NO_OP_VALUES:
                raise InvalidArgument(name, "unknown parameter")
            if value is not None and value not in NO_OP_VALUES[name]:
                raise _unsupported(name, value)
        if self.n != 1:
            raise InvalidArgument("n", f"only n = 1 is supported (one choice per request), got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise InvalidArgument("stream_options", "only allowed with stream: true")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: usage on every chunk


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only where an assistant turn made tool calls
    name: str | None = None  # informational
    tool_calls: list[MessageToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call answered (given to the chat template; not checked)

    @model_validator(mode="after")
    def _shape_of_the_role(self) -> Message:
        if self.tool_calls is not None and self.role != "assistant":
            raise InvalidArgument("tool_calls", f"only assistant messages carry tool calls, not {self.role}")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise InvalidArgument("content", "required (only an assistant message with tool_calls may leave it out)")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # None: auto with tools, none without (OpenAI's defaults)
    parallel_tool_calls: StrictBool | None = None  # None: true (OpenAI's default)

    @model_validator(mode="after")
    def _one_length(self) -> ChatCompletionRequest:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise InvalidArgument("max_tokens", "max_tokens and max_completion_tokens disagree: send one of them")
        return self

    @model_validator(mode="after")
    def _tools_agree(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or ()]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise InvalidArgument(f"tools[{i}].function.name", f"{name!r} is defined twice")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise InvalidArgument("tool_choice", "needs tools to choose from")
        if isinstance(choice, BaseModel) and choice.function.name not in names:
            raise InvalidArgument("tool_choice.function.name", f"{choice.function.name!r} is not one of the tools")
        if self.tool_mode != "none" and self.response_format is not None and self.response_format.type != "text":
            raise InvalidArgument("response_format", "cannot be combined with tools unless tool_choice is none")
        return self

    @property
    def tool_mode(self) -> str:
        """none, auto, required, or "function" (the one `tool_choice` names)."""
        if not self.tools:
            return "none"
        if self.tool_choice is None:
            return "auto"
        return self.tool_choice if isinstance(self.tool_choice, str) else "function"

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Body):
    # A string, token ids, or a batch of one of either (a batch of more is refused: one choice per request).
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if (
            isinstance(self.prompt, list)
            and self.prompt
            and isinstance(self.prompt[0], (str, list))
            and len(self.prompt) != 1
        ):
            raise InvalidArgument("prompt", "send one prompt per request (a batch of prompts is not supported)")
        if self.prompt in ("", []) or self.prompt == [[]]:
            raise InvalidArgument("prompt", "the prompt is empty")
        return self

    @property
    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return prompt[0]
        return prompt

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens


def parse_body(cls: type[_Body], data: Any) -> Any:
    """`data` (decoded JSON) as a `cls`; `InvalidArgument` naming the parameter (OpenAI's `param`) otherwise."""
    if not isinstance(data, dict):
        raise InvalidArgument("body", "expected a JSON object")
    check_json_values(data)
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidArgument):  # a model's own check: its field, under the model's place in the body
            where = _param(error["loc"])
            raise InvalidArgument(f"{where}.{cause.field}" if where else cause.field, cause.message) from None
        raise InvalidArgument(_param(error["loc"]) or "body", error["msg"]) from None


def check_json_values(body: dict[str, Any]) -> None:
    """Refuse what no field may hold, before any model reads the body: a string or key that is not Unicode text (a
    lone surrogate, which JSON's escapes can write: protobuf, tokenizers and UTF-8 encoders refuse it), named by its
    path; nesting deeper than MAX_JSON_DEPTH, named by the top-level field it is under (the path is that deep)."""
    stack: list[tuple[str, str, Any, int]] = []  # (top-level field, path, value, depth: the body is 1)
    _push(stack, "", "", body.items(), 2)
    while stack:
        top, path, value, depth = stack.pop()
        if isinstance(value, str):
            _check_text(path, value, "the value")
        elif depth > MAX_JSON_DEPTH:
            raise InvalidArgument(top, f"nesting deeper than {MAX_JSON_DEPTH} levels")
        else:
            _push(stack, top, path, value.items() if isinstance(value, dict) else enumerate(value), depth + 1)


def _push(stack: list[tuple[str, str, Any, int]], top: str, path: str, items: Any, depth: int) -> None:
    """A container's strings, arrays and objects onto `stack` (other scalars hold nothing to refuse); keys checked."""
    for key, value in items:
        if isinstance(key, str):
            _check_text(path or "body", key, f"the key {ascii(key[:64])}")
        if isinstance(value, (str, dict, list)):
            where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
            stack.append((top or key, where, value, depth))


def _check_text(field: str, text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(field, f"{what} is not valid Unicode text (it holds a lone surrogate)") from None


def _param(loc: tuple[Any, ...]) -> str:
    """pydantic's location as OpenAI writes a param: messages[0].content. Union branch names are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _BRANCH_NAMES or "[" in str(part) or "-" in str(part):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


_BRANCH_NAMES = {
    "str",
    "int",
    "float",
    "bool",
    "list",
    "dict",
    "list[str]",
    "list[int]",
    "list[TextPart]",
    "literal['auto']",
    "function-after",
    "constrained-int",
}
