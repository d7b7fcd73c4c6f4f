"""One generation request, said once: built by an API codec or a tool, carried through the server's scheduler into
`SpecEngine.add_request` unchanged. What the engine keeps per request beyond it (randomness, k, text, drafter
state) is the engine's own.

Prompts are checked by one function, `PromptLimits.check`, wherever they are checked: a server checks them at its
edge, before a request waits for anything, and the engine again with its target's limits (an in-process caller has
no edge).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec_core.config import SamplingParams
from specdec_core.errors import InvalidArgument


@dataclass(frozen=True)
class Request:
    """A codec fills what the client sent; a server fills `seq_id` and `prompt_ids` (once it has tokenized the
    prompt) before the engine takes it."""

    seq_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    num_speculative_tokens: int | str | None = None  # a k, or "auto"; None: the engine's default
    speculation_method: str | None = None  # one of the engine's methods, or "none"; None or "auto": any it runs
    cache_salt: str | None = None  # prefix caching: cached prefixes are shared only among requests of one salt
    return_probs: bool = False  # each round's `RoundInfo` carries q and p of the proposed tokens


@dataclass(frozen=True)
class PromptLimits:
    """What a prompt and its output must fit. `max_prompt_tokens` and `max_output_tokens` are a server's own caps
    (None: the context's); `settings` prefixes their names in errors, so a client learns which setting refused it."""

    vocab_size: int
    max_seq_len: int
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    settings: str = ""

    def check_length(self, n: int) -> None:
        """A prompt of `n` tokens fits, with room for one output token. Cheap: a server asks it before tokenizing
        a prompt of token ids, and again after tokenizing text."""
        context = self.max_seq_len - 1
        if self.max_prompt_tokens is not None and self.max_prompt_tokens <= context:
            limit, why = self.max_prompt_tokens, f"{self.settings}max_prompt_tokens"
        else:
            limit, why = context, f"the context of {self.max_seq_len} less one output token"
            if self.max_prompt_tokens is not None or self.settings:
                why += f"; {self.settings}max_prompt_tokens"
        if n > limit:
            raise InvalidArgument("prompt", f"{n} tokens; this server takes at most {limit} ({why})")

    def check(self, prompt_ids: Sequence[int], max_tokens: int) -> tuple[int, ...]:
        """The prompt as a tuple of ints, once it and `max_tokens` fit; else `InvalidArgument` naming the field."""
        prompt = tuple(int(t) for t in prompt_ids)
        if not prompt:
            raise InvalidArgument("prompt", "the prompt is empty")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                "prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        self.check_length(len(prompt))
        if self.max_output_tokens is not None and max_tokens > self.max_output_tokens:
            raise InvalidArgument(
                "max_tokens",
                f"{max_tokens}; this server generates at most "
                f"{self.max_output_tokens} ({self.settings}max_output_tokens)",
            )
        if len(prompt) + max_tokens > self.max_seq_len:
            raise InvalidArgument(
                "max_tokens",
                f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) "
                f"exceeds the context ({self.max_seq_len})",
            )
        return prompt
