"""scripts/hybrid_replay.py without a model: cost curves, the drafting rules' stops, and the replay's rounds and
costs against rounds counted by hand."""

from __future__ import annotations

import pytest

from tests.scripts import scripts_loaded


@pytest.fixture(scope="module")
def replay():
    with scripts_loaded("tree_verify_gain", "draft_tree_gain", "hybrid_ceiling", "hybrid_replay") as modules:
        yield modules[-1]


def test_cost_curve_interpolates_and_extends_the_last_segment(replay):
    curve = replay.cost_curve({"1": 100.0, "5": 140.0, "9": 220.0})
    assert curve(1) == 100.0 and curve(3) == 120.0 and curve(7) == 180.0
    assert curve(13) == 300.0  # 20 ms a token, as between 5 and 9


def test_the_threshold_rule_stops_after_a_doubtful_draft_and_the_cumulative_one_on_the_product(replay):
    drafts = replay.Drafts(right=[True] * 6, confidence=[0.9, 0.8, 0.4, 0.9, 0.9, 0.9])
    assert replay.chain(drafts, 1, 8, cumulative=False) == 3  # the draft at 0.4 is made, then no more
    assert replay.chain(drafts, 1, 2, cumulative=False) == 2  # the limit
    assert replay.chain(drafts, 1, 8, cumulative=True) == 3  # 0.9 * 0.8 * 0.4 < 0.5
    sure = replay.Drafts(right=[True] * 6, confidence=[0.9, 0.9, 0.9, 0.9, 0.9, 0.9])
    assert replay.chain(sure, 1, 16, cumulative=True) == 6  # the output's end: 0.9 ** 6 = 0.53 stays above
    assert replay.chain(sure, 1, 16, cumulative=False) == 6
    assert replay.chain(sure, 4, 16, cumulative=False) == 3  # from output position 4, three drafts are left


def _costs(replay):
    return replay.Costs(verify=lambda w: 100.0 + 10.0 * (w - 1), draft=lambda w: 20.0 + 5.0 * (w - 1),
                        round_ms=7.0, plain_round_ms=3.0)


def test_a_draft_chain_round_by_hand(replay):
    # Output of 8 tokens: 7 after prefill's. Drafts right except at output position 3, all confident.
    drafts = replay.Drafts(right=[True, True, False, True, True, True, True], confidence=[1.0] * 7)
    no_offers = [[[] for _ in range(8)]]
    tally = replay.replay([drafts], no_offers, _costs(replay), limit=4, cumulative=False, suffix=False)
    # p = 1: 4 drafts, 2 accepted (the third is wrong) -> 3 tokens; p = 4: 4 drafts all right -> 4 tokens (7 in all).
    round_ms = (25.0 + 3 * 20.0) + 140.0 + 7.0  # first step reads two tokens; verify of 5
    assert (tally.tokens, tally.rounds, tally.suffix_rounds) == (7, 2, 0)
    assert tally.ms == pytest.approx(2 * round_ms)


def test_hybrid_takes_suffix_from_three_tokens_and_plain_rounds_cost_less(replay):
    drafts = replay.Drafts(right=[False] * 5, confidence=[0.1] * 5)
    offers = [[[], [1, 2, 3, 3], [], [], [], []]]  # at p = 1: 4 tokens, the first 3 right
    tally = replay.replay([drafts], offers, _costs(replay), limit=4, cumulative=False, suffix=True)
    # p = 1: suffix, 3 accepted + 1 -> 4 tokens (verify of 5); p = 5: a draft of 1 (doubtful), rejected -> 1 token.
    assert (tally.tokens, tally.rounds, tally.suffix_rounds) == (5, 2, 1)
    assert tally.ms == pytest.approx((140.0 + 7.0) + (25.0 + 110.0 + 7.0))
    short = [[[], [1, 2], [], [], [], []]]  # two tokens: below the rule's three, the draft model drafts
    tally = replay.replay([drafts], short, _costs(replay), limit=4, cumulative=False, suffix=True)
    assert tally.suffix_rounds == 0 and tally.rounds == 5
