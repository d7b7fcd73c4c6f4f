"""Which rejection outcomes of a proposal under verification a pre-draft covers (`overlap.py`).

While the target verifies drafts d_0 .. d_{m-1}, the draft can prepare the next round for more than the outcome
where every draft is accepted: for a rejection at position j, the target commits d_0 .. d_{j-1} and then a token of
its own in place of d_j. For greedy rows the draft's best guess for that token is its runner-up at j (its top
choice was d_j itself), and by its own probabilities the outcome's chance is

    P(j) = q(d_0) · … · q(d_{j-1}) · q(runner-up at j)

(every earlier draft accepted, then the target picking the runner-up). The likeliest few, above a floor, are
drafted as extra rows of the pre-draft's forwards (`DraftModelDrafter`), each on a copy of the sequence's cache
up to position j. Which outcomes are covered depends on the draft's own tokens and probabilities only, and a branch
is used only when the committed tokens are exactly its context, so the output is unchanged whatever is chosen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# An outcome the draft gives less than this chance is not drafted: its rows would cost every step of the pre-draft
# for a hit that rarely comes.
MIN_CHANCE = 0.05


@dataclass(frozen=True)
class StepRecord:
    """What the draft thought at one drafted position: the token it picked (its top choice), that token's q, its
    runner-up and the runner-up's q (the plain softmax: greedy rows)."""

    token: int
    prob: float
    runner_up: int
    runner_up_prob: float


@dataclass(frozen=True)
class Rejection:
    """An outcome to cover: the draft at `position` rejected and `token` committed there, with the draft's
    estimate of its chance."""

    position: int
    token: int
    chance: float


def likeliest_rejections(
    assumed: Sequence[int], records: Sequence[StepRecord | None], count: int, min_chance: float = MIN_CHANCE
) -> list[Rejection]:
    """Up to `count` rejection outcomes of the drafts `assumed`, likeliest first, each at least `min_chance`.
    `records[j]`: what the draft thought where it drafted `assumed[j]` (None where it did not, or no longer
    knows); positions from the first without a matching record on are not covered (their chance is unknown)."""
    found: list[Rejection] = []
    reach = 1.0  # the chance that every draft before this position is accepted
    for j, (token, record) in enumerate(zip(assumed, records)):
        if record is None or record.token != token:
            break
        found.append(Rejection(j, record.runner_up, reach * record.runner_up_prob))
        reach *= record.prob
    found.sort(key=lambda r: -r.chance)
    return [r for r in found[: max(0, count)] if r.chance >= min_chance]
