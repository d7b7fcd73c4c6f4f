"""Conversations: chat messages, and the one path from messages to prompt token ids (the tokenizer's own chat
template). The gRPC API's `messages`, its `prompt` (a single user turn) and the HTTP API's chat completions all
come through `encode_chat`, so the same conversation gives the same prompt whichever way it arrives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from specdec_core.errors import InvalidArgument

ROLES = ("system", "user", "assistant", "tool")
MAX_MESSAGES = 1024


@dataclass(frozen=True)
class ChatMessage:
    role: str  # one of ROLES
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidArgument("messages.role", f"must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise InvalidArgument("messages.content", "must be a string")


def check_messages(messages: Sequence[ChatMessage]) -> None:
    if not messages:
        raise InvalidArgument("messages", "a conversation needs at least one message")
    if len(messages) > MAX_MESSAGES:
        raise InvalidArgument("messages", f"at most {MAX_MESSAGES} messages, got {len(messages)}")


def encode_chat(tokenizer: Any, messages: Sequence[ChatMessage]) -> list[int]:
    """The prompt for `messages`: the tokenizer's chat template with the assistant's turn opened."""
    check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("messages", "this model's tokenizer has no chat template: send a raw prompt instead")
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    try:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    except Exception as exc:  # the template itself may refuse an order of roles (jinja's raise_exception)
        raise InvalidArgument("messages", f"the chat template refused the conversation: {exc}") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def encode_prompt(tokenizer: Any, text: str, raw: bool = False) -> list[int]:
    """Token ids for a user prompt: one user turn of the chat template when the tokenizer has one (and not
    `raw`), else the text as is."""
    if not raw and getattr(tokenizer, "chat_template", None):
        return encode_chat(tokenizer, [ChatMessage("user", text)])
    return list(tokenizer(text)["input_ids"])
