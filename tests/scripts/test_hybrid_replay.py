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


def test_costs_at_the_cpus_limits_never_exceed_the_measured_ones(replay):
    costs = _costs(replay)  # verify 100 + 10 (w - 1) ms, draft 20 + 5 (w - 1) ms
    # 1 GB/s reads 5 MB in 5 ms; 1 GFLOP a token at 100 GFLOP/s is 10 ms: the verify's own slope.
    limited = replay.limit_costs(costs, read_gbs=1.0, fma_gflops=100.0, draft_bytes=5_000_000, target_flops=1e9)
    assert limited.draft(1) == pytest.approx(5.0) and limited.draft(2) == pytest.approx(5.0)
    assert limited.verify(1) == 100.0 and limited.verify(9) == pytest.approx(180.0)
    faster = replay.limit_costs(costs, read_gbs=1.0, fma_gflops=400.0, draft_bytes=50_000_000, target_flops=1e9)
    assert faster.verify(9) == pytest.approx(100.0 + 8 * 2.5)  # the peak's 2.5 ms a token past the first
    assert faster.draft(1) == 20.0 and faster.draft(2) == 25.0  # 50 ms at the read limit: what was measured stands
    assert (faster.round_ms, faster.plain_round_ms) == (costs.round_ms, costs.plain_round_ms)


def test_flops_per_token_count_every_linear_weight_twice(replay):
    from specdec_core.models.transformer import ModelArgs

    args = ModelArgs(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                     head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64)
    qkv, o, mlp = 8 * (2 + 2 * 1) * 4, 2 * 4 * 8, 3 * 8 * 16
    assert replay.flops_per_token(args) == 2.0 * (2 * (qkv + o + mlp) + 100 * 8)
