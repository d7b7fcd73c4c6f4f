"""Reading a model's output for tool calls, as it streams: the same reader answers unary requests (fed the whole
text at once), so a stream accumulates to the unary answer.

What it returns, in order, is content text and whole calls; never part of a call, nor part of a marker:
- text outside call blocks is content; text that may yet become `<tool_call>` is held until it does or cannot;
- a block (`<tool_call>` ... `</tool_call>`) is held until it closes; then a JSON object whose "name" is one of the
  request's tools and whose "arguments" is an object is a call; anything else is content, the block verbatim
  (the schema is not checked here: a forced call's grammar has enforced it, and an `auto` call is the model's);
- whitespace between a call and the text around it is dropped (the newline between calls is the format's), so a
  model that only called tools has no content;
- a block still open at the end (max_tokens, a stop string) is content, as the model wrote it;
- without parallel calls, calls after the first are dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from deployments.openai.tools import BEGIN, END, ToolPlan


@dataclass(frozen=True)
class ParsedCall:
    index: int  # 0, 1, ... in the order the model made them (OpenAI's tool_calls[].index)
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Event = str | ParsedCall  # content text, or a whole call


class ToolCallParser:
    """One request's output, read for calls. Mutates as it is fed; `finish` once, at the end of the output."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._buffer = ""  # text read but not yet returned
        self._gap = ""  # the whitespace before the open block: content again if the block is not a call
        self._in_block = False
        self._after_call = False  # whitespace that follows a call is dropped
        self.num_calls = 0  # calls returned

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._step(events):
            pass
        return _merged(events)

    def finish(self) -> list[Event]:
        """What the held text is, now that no more will come."""
        events: list[Event] = []
        if self._in_block:
            events.append(self._gap + BEGIN + self._buffer)
        elif not self._after_call:
            events.append(self._buffer)
        self._buffer, self._in_block = "", False
        return _merged(events)

    def _step(self, events: list[Event]) -> bool:
        """Return what the buffer decides; True while what is left may decide more."""
        if self._in_block:
            end = self._buffer.find(END)
            if end < 0:
                return False
            body, self._buffer = self._buffer[:end], self._buffer[end + len(END) :]
            self._in_block = False
            self._close(body, events)
            return True
        if self._after_call:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._after_call = False
        start = self._buffer.find(BEGIN)
        if start >= 0:
            before = self._buffer[:start]
            text = before.rstrip()
            events.append(text)
            self._gap, self._buffer, self._in_block = before[len(text) :], self._buffer[start + len(BEGIN) :], True
            return True
        # Held: a tail that may begin a marker, and the whitespace before it (dropped if a call follows).
        head = self._buffer[: len(self._buffer) - _marker_prefix(self._buffer)]
        text = head.rstrip()
        events.append(text)
        self._buffer = self._buffer[len(text) :]
        return False

    def _close(self, body: str, events: list[Event]) -> None:
        call = self._call(body)
        if call is None:
            events.append(self._gap + BEGIN + body + END)
        else:
            if self._plan.parallel or self.num_calls == 0:
                events.append(call)
                self.num_calls += 1
            self._after_call = True
        self._gap = ""

    def _call(self, body: str) -> ParsedCall | None:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self._plan.names:
            return None
        arguments = value.get("arguments")
        if not isinstance(arguments, dict):
            return None
        return ParsedCall(self.num_calls, new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _marker_prefix(text: str) -> int:
    """The length of the longest tail of `text` that begins BEGIN (and is not all of it)."""
    for n in range(min(len(BEGIN) - 1, len(text)), 0, -1):
        if BEGIN.startswith(text[-n:]):
            return n
    return 0


def _merged(events: list[Event]) -> list[Event]:
    """Adjacent texts as one, empty ones dropped."""
    out: list[Event] = []
    for event in events:
        if isinstance(event, str):
            if not event:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += event
                continue
        out.append(event)
    return out
