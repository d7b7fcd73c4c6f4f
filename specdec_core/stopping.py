"""Deciding where an output ends: max_tokens, eos, stop strings, the context limit.

Tokens are committed one at a time, in order, whether they came from plain decoding or from a round of
speculation. So a stop met inside a run of accepted draft tokens ends the output exactly where plain decoding
would have: the tokens after it are never committed.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from specdec_core.config import SamplingParams


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens or the context limit
    EOS = "eos"
    STOP = "stop"  # a stop string
    CANCELLED = "cancelled"
    ERROR = "error"


class IncrementalDetokenizer:
    """Text of the output so far, decoded a few tokens at a time.

    Decodes only the window since the last emitted text, so the cost per token does not grow with the output.
    A multi-byte character split across tokens decodes to U+FFFD until complete: text is held back until then.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the decode window (kept one step back so merges at the edge are right)
        self._read = 0  # tokens whose text has been emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the newly complete text (possibly empty)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta


@dataclass
class StopChecker:
    """Commits tokens one by one and says when the output is finished. Mutates its own state only."""

    params: SamplingParams
    eos_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    max_total_tokens: int  # the context limit: prompt + output
    num_prompt_tokens: int
    num_output: int = 0
    text_end: int | None = None  # where the visible text ends once a stop string matched
    finish_reason: FinishReason | None = None

    @property
    def text(self) -> str:
        full = self.detokenizer.text
        return full if self.text_end is None else full[: self.text_end]

    @property
    def stable_text(self) -> str:
        """Text safe to stream now: a tail that could be the start of a stop string is held back."""
        full = self.text
        if self.finish_reason is not None or not self.params.stop:
            return full
        for size in range(min(len(full), max(len(s) for s in self.params.stop) - 1), 0, -1):
            if any(stop.startswith(full[-size:]) for stop in self.params.stop):
                return full[:-size]
        return full

    def commit(self, tokens: Iterable[int]) -> list[int]:
        """Commit tokens in order until one finishes the output; return those committed."""
        committed: list[int] = []
        for token in tokens:
            if self.finish_reason is not None:
                break
            committed.append(token)
            self.num_output += 1
            self.finish_reason = self._check(token)
        return committed

    def _check(self, token: int) -> FinishReason | None:
        if not self.params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.EOS
        old_len = len(self.detokenizer.text)
        delta = self.detokenizer.push(token)
        if delta and self.params.stop and self._match_stop(old_len):
            return FinishReason.STOP
        if self.num_output >= self.params.max_tokens:
            return FinishReason.LENGTH
        if self.num_prompt_tokens + self.num_output >= self.max_total_tokens:
            return FinishReason.LENGTH
        return None

    def _match_stop(self, old_len: int) -> bool:
        text = self.detokenizer.text
        longest = max(len(s) for s in self.params.stop)
        window_start = max(0, old_len - longest + 1)
        hits = [i for s in self.params.stop if (i := text.find(s, window_start)) != -1]
        if not hits:
            return False
        self.text_end = min(hits)
        return True
