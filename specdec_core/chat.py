"""Conversations: chat messages, and the one path from messages to prompt token ids (the tokenizer's own chat
template). The gRPC API's `messages`, its `prompt` (a single user turn) and the HTTP API's chat completions all
come through `encode_chat`, so the same conversation gives the same prompt whichever way it arrives.

Tools and tool calls are rendered by the template too: a template that knows them (Qwen2.5's, ...) writes the
tools' definitions into the prompt and earlier calls into the assistant's turns; the prompt says which output
format the model was trained to call them in, which the server does not decide."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specdec_core.errors import InvalidArgument

ROLES = ("system", "user", "assistant", "tool")
MAX_MESSAGES = 1024


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant turn made: a function's name and its arguments, a JSON object as text."""

    id: str
    name: str
    arguments: str

    def __post_init__(self) -> None:
        try:
            value = json.loads(self.arguments)
        except (TypeError, json.JSONDecodeError):
            value = None
        if not isinstance(value, dict):
            raise InvalidArgument("messages.tool_calls.arguments", "must be a JSON object, as text")


@dataclass(frozen=True)
class Tool:
    """A function the model may call. `parameters`: its arguments' JSON Schema as text (None: it takes none)."""

    name: str
    description: str | None = None
    parameters: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """OpenAI's shape, which is what templates that render tools are written for (they mostly `tojson` it)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ChatMessage:
    role: str  # one of ROLES
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # assistant turns only
    tool_call_id: str | None = None  # tool turns: the call this is the result of

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidArgument("messages.role", f"must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise InvalidArgument("messages.content", "must be a string")
        if self.tool_calls and self.role != "assistant":
            raise InvalidArgument("messages.tool_calls", f"only assistant turns make tool calls, not {self.role}")

    def as_template_dict(self) -> dict[str, Any]:
        """The message as transformers' templates read it: a call's arguments as a mapping (Qwen2.5's `tojson`s them,
        so a JSON string would be quoted twice); keys a plain turn never had stay absent (templates test for them)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None and self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
        return message


def check_messages(messages: Sequence[ChatMessage]) -> None:
    if not messages:
        raise InvalidArgument("messages", "a conversation needs at least one message")
    if len(messages) > MAX_MESSAGES:
        raise InvalidArgument("messages", f"at most {MAX_MESSAGES} messages, got {len(messages)}")


def encode_chat(tokenizer: Any, messages: Sequence[ChatMessage], tools: Sequence[Tool] = ()) -> list[int]:
    """The prompt for `messages`: the tokenizer's chat template with the assistant's turn opened. With `tools`,
    a template that does not render them is refused (naming `tools`): the model would never learn of them."""
    check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("messages", "this model's tokenizer has no chat template: send a raw prompt instead")
    conversation = [m.as_template_dict() for m in messages]
    ids = _apply(tokenizer, conversation, None)
    if not tools:
        return ids
    with_tools = _apply(tokenizer, conversation, [t.as_template_dict() for t in tools])
    if with_tools == ids:
        raise InvalidArgument("tools", "this model's chat template does not render tools")
    return with_tools


def _apply(tokenizer: Any, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    try:
        ids = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True)
    except Exception as exc:  # the template itself may refuse an order of roles (jinja's raise_exception)
        raise InvalidArgument("messages", f"the chat template refused the conversation: {exc}") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def encode_prompt(tokenizer: Any, text: str, raw: bool = False) -> list[int]:
    """Token ids for a user prompt: one user turn of the chat template when the tokenizer has one (and not
    `raw`), else the text as is."""
    if not raw and getattr(tokenizer, "chat_template", None):
        return encode_chat(tokenizer, [ChatMessage("user", text)])
    return list(tokenizer(text)["input_ids"])
