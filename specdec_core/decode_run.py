"""Runs of plain steps: the target decodes rows at k = 0 step after step by itself, and the engine reads the steps.

A round at k = 0 is one token per row; when the engine drives every such round the target waits for it between
tokens (over an RPC boundary: a round trip per token, and the engine's process competing for the cores the target
computes on). A run hands the target every row's uniforms and limits up front, and the target takes steps until
each row has ended or the run is stopped; the engine commits each step's tokens as they arrive and stops the run
when it must cut in (a request to admit, a row that speculates again).

A step is exactly a k = 0 verify of the rows still decoding, with the uniform its row would have drawn for that
round (`SequenceState.run_uniforms` draws them in the per-round order), so the tokens are those per-round decoding
gives. The target ends a row after one of its stop tokens or its `max_steps`; a row whose session was released
(the engine's own stop strings, a cancel) ends there too, at the next step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specdec_core.config import TokenShaping
from specdec_core.errors import InvalidArgument
from specdec_core.target_calls import PartialVerifyFailure, VerifyItem, VerifyOutcome

RUN_STEPS = 128  # the longest run: a stopped run's unused uniforms are drawn again, so a run stays bounded


@dataclass(frozen=True)
class DecodeItem:
    seq_id: str
    last_token_id: int  # the last committed token (not yet in the target's cache)
    shaping: TokenShaping
    uniforms: tuple[float, ...] | None  # [max_steps] in [0, 1): step i draws with uniforms[i]; None when greedy
    max_steps: int  # the most tokens the row may commit in this run (>= 1)
    stop_token_ids: frozenset[int]  # the row ends after committing one of these

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise InvalidArgument("items.max_steps", f"{self.max_steps}: a run takes at least one step")
        if self.uniforms is not None and len(self.uniforms) != self.max_steps:
            raise InvalidArgument("items.uniforms", f"{len(self.uniforms)} uniforms for {self.max_steps} steps")
        if self.shaping.greedy != (self.uniforms is None):
            raise InvalidArgument("items.uniforms", "a sampled row needs its uniforms, a greedy row has none")


# Per item: its token this step; None once it has ended; the error that ended it, at the step its call failed (a
# target split over replicas lost the one holding it: the other rows go on).
Step = list[int | Exception | None]


class DecodeRun(Protocol):
    """A run under way: its steps in order (iteration ends with the run), and `stop` from any thread."""

    def __iter__(self) -> Iterator[Step]: ...

    def stop(self) -> None:
        """End the run after the step under way (idempotent)."""


class StepwiseRun:
    """A run by one k = 0 `verify` a step over the rows still decoding: the local target's, and the target worker's
    (which takes each step under its lock). `holds(seq_id)`: whether the session is still there."""

    def __init__(
        self,
        verify: Callable[[Sequence[VerifyItem]], list[VerifyOutcome]],
        items: Sequence[DecodeItem],
        holds: Callable[[str], bool],
    ) -> None:
        self._verify = verify
        self._holds = holds
        self.items = list(items)
        self._last = [item.last_token_id for item in self.items]
        self._taken = [0] * len(self.items)
        self._ended = [False] * len(self.items)
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def __iter__(self) -> Iterator[Step]:
        while (step := self.step()) is not None:
            yield step

    def step(self) -> Step | None:
        """One step for the rows still decoding; None once every row has ended or the run was stopped."""
        if self._stopped.is_set():
            return None
        for i, item in enumerate(self.items):
            if not self._ended[i] and not self._holds(item.seq_id):
                self._ended[i] = True
        rows = [i for i, ended in enumerate(self._ended) if not ended]
        if not rows:
            return None
        tokens: Step = [None] * len(self.items)
        try:
            outcomes: list[VerifyOutcome | None] = list(self._verify([self._verify_item(i) for i in rows]))
        except PartialVerifyFailure as exc:
            outcomes = exc.outcomes
            for j, error in exc.errors.items():
                tokens[rows[j]], self._ended[rows[j]] = error, True
        for i, outcome in zip(rows, outcomes):
            if outcome is None:
                continue
            token = tokens[i] = self._last[i] = outcome.token_ids[0]
            self._taken[i] += 1
            item = self.items[i]
            self._ended[i] = token in item.stop_token_ids or self._taken[i] >= item.max_steps
        return tokens

    def _verify_item(self, i: int) -> VerifyItem:
        item = self.items[i]
        uniform = None if item.uniforms is None else item.uniforms[self._taken[i]]
        return VerifyItem(
            seq_id=item.seq_id,
            last_token_id=self._last[i],
            draft_token_ids=(),
            q=None,
            shaping=item.shaping,
            uniform_accept=None if uniform is None else torch.empty(0, dtype=torch.float64),
            uniform_sample=uniform,
        )
