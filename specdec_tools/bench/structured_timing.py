"""How `specdec bench structured` times a request: each engine step (one request at a time, so a step is its
prefill or one of its rounds), and inside it the time spent in the grammar's own code.

The grammar's time is taken by wrapping, for the length of the run only (`grammar_clock`), the methods through which
the engine and the drafters reach the grammar: a sequence's `GrammarState` (masks computed, tokens advanced and
rolled back, forced runs looked for) and `PackedMasks.dense` (a round's masks unpacked for the target). The
engine's loop stays free of instrumentation; the wrappers cost about a microsecond per outermost call, a few calls
per token, against masks that cost microseconds to tens of microseconds each. Not counted: setting masked logits
to -inf inside the target's and the draft's forward passes (one torch op per call).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from specdec_core.config import SamplingParams
from specdec_core.engine import SpecEngine
from specdec_core.grammar.bits import PackedMasks
from specdec_core.grammar.state import GrammarState
from specdec_core.outputs import RoundInfo
from specdec_core.request import Request
from specdec_core.structured import FORCED

TIMED = (
    (
        GrammarState,
        ("advance", "rollback", "allowed_mask", "allowed_words", "forced", "is_terminated", "must_end", "can_end"),
    ),
    (PackedMasks, ("dense",)),
)
FORCED_ROUND, DRAFTED_ROUND, PLAIN_ROUND = FORCED, "drafted", "plain"
ROUND_KINDS = (FORCED_ROUND, DRAFTED_ROUND, PLAIN_ROUND)


class GrammarClock:
    """Seconds spent in the grammar's code so far. Mutating: the wrapped methods add to it. Calls made inside a
    timed call (`forced` advances, `draft_masks` reads masks) are counted once, in the outermost."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0

    def wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
                self._depth -= 1

        return timed


@contextmanager
def grammar_clock() -> Iterator[GrammarClock]:
    """A clock on the grammar's methods while the block runs; the methods are as they were after it, whatever
    happens. One thread: the engine runs its loop, its target and its drafters in the caller's."""
    clock = GrammarClock()
    originals = [(cls, name, cls.__dict__[name]) for cls, names in TIMED for name in names]
    try:
        for cls, name, method in originals:
            setattr(cls, name, clock.wrap(method))
        yield clock
    finally:
        for cls, name, method in originals:
            setattr(cls, name, method)


@dataclass(frozen=True)
class RoundRun:
    """One round of one request: the step that ran it, timed whole."""

    kind: str  # FORCED_ROUND: it verified (or committed) tokens the grammar forced; DRAFTED_ROUND: a drafting
    # method's proposal; PLAIN_ROUND: no proposal (k = 0)
    proposed: int
    accepted: int
    tokens: int  # committed in this round
    seconds: float
    grammar_seconds: float

    @classmethod
    def of(cls, info: RoundInfo, tokens: int, seconds: float, grammar_seconds: float) -> RoundRun:
        kind = PLAIN_ROUND if info.method is None else FORCED_ROUND if info.method == FORCED else DRAFTED_ROUND
        return cls(kind, len(info.proposed_token_ids), info.num_accepted, tokens, seconds, grammar_seconds)


@dataclass(frozen=True)
class StructuredRun:
    """One request, generated alone (batch size 1)."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str  # "eos", "stop", "length", ... (`FinishReason`'s values)
    prompt_tokens: int
    seconds: float  # from adding the request to its last token: prefill included
    decode_seconds: float  # after its first token
    grammar_seconds: float  # in the grammar's code, from adding the request to its end (its prefill's mask too)
    rounds: tuple[RoundRun, ...]
    stats_rounds: int  # what the engine counted (`SpecStats`): one per element of `rounds`
    proposed: int
    accepted: int


def run_request(
    engine: SpecEngine,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    k: int | str,
    salt: str,
    clock: GrammarClock,
) -> StructuredRun:
    """Generate one request alone on `engine`; every step yields its one output (its prefill or a round)."""
    tokens: list[int] = []
    text: list[str] = []
    rounds: list[RoundRun] = []
    first = last = None
    start, grammar_start = time.perf_counter(), clock.seconds
    engine.add_request(Request(request_id, tuple(prompt), params, num_speculative_tokens=k, cache_salt=salt))
    while engine.has_work:
        step_start, step_grammar = time.perf_counter(), clock.seconds
        outputs = engine.step()
        seconds, grammar_seconds = time.perf_counter() - step_start, clock.seconds - step_grammar
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(f"request {request_id} failed: {out.error}") from out.error
            tokens += out.new_token_ids
            text.append(out.new_text)
            if out.round is not None:
                rounds.append(RoundRun.of(out.round, len(out.new_token_ids), seconds, grammar_seconds))
            first = first or time.perf_counter()
            last = out
    end = time.perf_counter()
    return StructuredRun(
        tuple(tokens),
        "".join(text),
        last.finish_reason.value,
        last.num_prompt_tokens,
        end - start,
        end - (first or end),
        clock.seconds - grammar_start,
        tuple(rounds),
        last.stats.rounds,
        last.stats.proposed,
        last.stats.accepted,
    )
