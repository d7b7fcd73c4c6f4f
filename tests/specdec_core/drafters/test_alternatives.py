"""Which rejection outcomes a pre-draft covers (`drafters/alternatives.py`), against the outcomes enumerated."""

from __future__ import annotations

import itertools
import math

import pytest

from specdec_core.drafters.alternatives import StepRecord, likeliest_rejections


def _enumerated(records: list[StepRecord]) -> dict[int, float]:
    """Every outcome of verifying the drafts under the draft's own law (the target accepts position j with q of the
    draft there, else takes the runner-up with its q): the chance that position j is rejected for the runner-up,
    summed over the paths that reach it."""
    chances: dict[int, float] = {}
    m = len(records)
    for accepted in itertools.product([True, False], repeat=m):
        j = next((i for i, a in enumerate(accepted) if not a), None)
        if j is None or any(not a for a in accepted[j + 1 :]):
            continue  # after the first rejection nothing more is verified: count each path once
        path = math.prod(r.prob for r in records[:j]) * records[j].runner_up_prob
        chances[j] = chances.get(j, 0.0) + path
    return chances


@pytest.mark.parametrize("count", [0, 1, 2, 4])
@pytest.mark.parametrize("probs", [(0.9, 0.6, 0.95, 0.5), (0.5, 0.5, 0.5, 0.5), (0.99, 0.99, 0.3, 0.99)])
def test_the_likeliest_outcomes_above_the_floor_in_order(count, probs):
    records = [StepRecord(10 + j, p, 20 + j, (1 - p) * 0.7) for j, p in enumerate(probs)]
    assumed = [10 + j for j in range(len(probs))]
    expected = _enumerated(records)
    got = likeliest_rejections(assumed, records, count, min_chance=0.05)
    ranked = sorted(expected, key=lambda j: -expected[j])[:count]
    assert [r.position for r in got] == [j for j in ranked if expected[j] >= 0.05]
    for r in got:
        assert r.token == 20 + r.position and r.chance == pytest.approx(expected[r.position])


def test_positions_from_the_first_unknown_or_foreign_draft_on_are_not_covered():
    records = [StepRecord(1, 0.5, 2, 0.4), None, StepRecord(5, 0.5, 6, 0.4)]
    assert [r.position for r in likeliest_rejections([1, 3, 5], records, 3, 0.0)] == [0]
    records = [StepRecord(1, 0.5, 2, 0.4), StepRecord(9, 0.5, 4, 0.4), StepRecord(5, 0.5, 6, 0.4)]
    assert [r.position for r in likeliest_rejections([1, 3, 5], records, 3, 0.0)] == [0]  # 3 is not what it drafted
