"""What the engine hands back: per step, one `RequestOutput` per sequence that moved, with its round (`RoundInfo`)
and its running totals (`SpecStats`). Frozen: a caller may keep them across steps."""

from __future__ import annotations

from dataclasses import dataclass

from specdec_core.stopping import FinishReason


@dataclass(frozen=True)
class SpecStats:
    rounds: int = 0
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def after(self, proposed: int, accepted: int) -> SpecStats:
        """These totals after one more round that proposed and accepted so many."""
        return SpecStats(self.rounds + 1, self.proposed + proposed, self.accepted + accepted)


@dataclass(frozen=True)
class RoundInfo:
    """What happened to one sequence in one round: the data a trace span or proposal log needs."""

    k: int
    proposed_token_ids: tuple[int, ...]
    num_accepted: int
    bonus: bool  # all drafts accepted: the extra token came from p at the position after them
    # For requests added with return_probs: q and p of each proposed token (see `sampling.token_probs`).
    draft_probs: tuple[float, ...] | None = None
    target_probs: tuple[float, ...] | None = None
    method: str | None = None  # the drafting method whose proposal was verified; None: no draft was asked for
    seconds: float = 0.0  # the round's wall time, drafting and verifying (shared by every row of its batch)
    predrafted: bool = False  # the proposal verified was pre-drafted during the last round's verify (`overlap.py`)
    branched: bool = False  # a branch for the next round was pre-drafted during this round's verify
    # The proposal verified was drafted while the other group of its split batch was verified (`overlap.py`)
    split: bool = False


@dataclass(frozen=True)
class RequestOutput:
    """One sequence's progress after a step: the tokens committed in it and, at the end, why it stopped."""

    seq_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    stats: SpecStats
    num_cached_tokens: int = 0  # of the prompt, the tokens the target read from its prefix cache
    round: RoundInfo | None = None
    error: Exception | None = None  # why a request ended with FinishReason.ERROR

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
