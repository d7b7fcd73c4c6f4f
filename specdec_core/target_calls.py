"""What crosses between the engine and the target: the items of a prefill and a verify, their outcomes, and the
failures that end only some rows. Apart from `specdec_core.target` so that `specdec_core.decode_run`, which the
target's protocol names, can build verify items too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec_core.config import TokenShaping
from specdec_core.grammar.bits import PackedMasks
from specdec_core.sparse_q import SparseQ


@dataclass(frozen=True)
class PrefillItem:
    seq_id: str
    prompt_ids: Sequence[int]
    shaping: TokenShaping
    uniform: float | None  # in [0, 1): draws the first token; None when greedy
    cache_salt: str | None = None  # prefix caching: share cached prefixes only with sequences of this salt
    allowed: PackedMasks | None = None  # [1, W]: the tokens its grammar allows first; None: unconstrained


@dataclass(frozen=True)
class Prefilled:
    first_token_id: int
    num_cached_tokens: int  # prompt tokens read from the prefix cache, not computed


@dataclass(frozen=True)
class VerifyItem:
    seq_id: str
    last_token_id: int  # the last committed token (not yet in the target's cache)
    draft_token_ids: Sequence[int]  # 0..k drafts
    q: SparseQ | None  # at len(draft_token_ids) positions: the draft's probabilities; None: point masses
    shaping: TokenShaping
    uniform_accept: torch.Tensor | None  # [len(draft_token_ids)] float64 in [0, 1); None when greedy
    uniform_sample: float | None  # draws the recovered or bonus token; None when greedy
    return_probs: bool = False  # also report p of each draft token (`VerifyOutcome.target_probs`)
    # [len(draft_token_ids) + 1, W]: the tokens its grammar allows at each position (row i masks the logits that
    # judge draft i; the last, the bonus token's); None: unconstrained.
    allowed: PackedMasks | None = None


@dataclass(frozen=True)
class VerifyOutcome:
    token_ids: tuple[int, ...]  # accepted drafts, then the recovered or bonus token
    num_accepted: int
    # p of each draft token when the item asked (see `sampling.token_probs`); None otherwise.
    target_probs: tuple[float, ...] | None = None


class PartialVerifyFailure(Exception):
    """A verify whose rows did not all come back: a target split over replicas lost one of them. The rows in
    `errors` (index -> why) have no outcome and no valid cache; every other row's outcome is in `outcomes`."""

    def __init__(self, outcomes: list[VerifyOutcome | None], errors: dict[int, Exception]) -> None:
        super().__init__(f"{len(errors)} of {len(outcomes)} rows failed: {next(iter(errors.values()), '')}")
        self.outcomes = outcomes
        self.errors = errors


class PartialPrefill(Exception):
    """A prefill that started only some sequences. `results[i]` is None for the others: they hold nothing. Those in
    `errors` (index -> why) failed alone and end; the rest found no room after all (a replica it counted on
    stopped taking new sequences, or others took its slots) and wait for a slot again."""

    def __init__(self, results: list[Prefilled | None], errors: dict[int, Exception] | None = None) -> None:
        self.errors = errors or {}
        waiting = results.count(None) - len(self.errors)
        super().__init__(f"of {len(results)} sequences, {waiting} found no slot and {len(self.errors)} failed")
        self.results = results
