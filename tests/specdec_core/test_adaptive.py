"""Choosing k from acceptance and measured costs, per batch size."""

from __future__ import annotations

import pytest

from specdec_core.adaptive import (
    AcceptanceEstimate,
    AdaptivePolicy,
    CostModel,
    FreeProposal,
    RoundChoice,
    expected_tokens_by_position,
)


def _closed_form(alpha: float, k: int) -> float:
    """Leviathan et al.'s E(k) when every draft is accepted with probability alpha."""
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def test_expected_tokens_formula():
    assert expected_tokens_by_position([0.0] * 5, 5) == 1.0
    assert expected_tokens_by_position([1.0] * 3, 3) == 4.0
    assert expected_tokens_by_position([0.5] * 2, 2) == pytest.approx(1 + 0.5 + 0.25)


def _observe(costs: CostModel, batch: int, tokens: int, seconds: float) -> None:
    for _ in range(AdaptivePolicy().explore_samples):  # measured enough times to be trusted
        costs.observe_verify(batch, tokens, seconds)


def _costs(batch: int, draft: float, verify: dict[int, float]) -> CostModel:
    """Costs as measured: verify times interpolated linearly between the given points, for k + 1 = 2..9."""
    costs = CostModel()
    costs.observe_draft(batch, 1, draft)
    points = sorted(verify.items())
    for tokens in range(1, 10):
        (t0, c0), (t1, c1) = points[0], points[-1]
        _observe(costs, batch, tokens, c0 + (c1 - c0) * (tokens - t0) / (t1 - t0))
    return costs


def _estimate(alpha: float) -> AcceptanceEstimate:
    est = AcceptanceEstimate()
    for _ in range(200):  # enough rounds that the prior has decayed away
        accepted = round(alpha * 4)
        est.update(4, accepted)
    return est


def test_high_acceptance_and_cheap_draft_speculates():
    costs = _costs(1, draft=0.01, verify={1: 0.1, 5: 0.11})
    assert AdaptivePolicy(max_k=8).choose(_estimate(1.0), costs, 1) >= 4


def test_low_acceptance_falls_back_to_plain_decoding():
    costs = _costs(1, draft=0.04, verify={1: 0.1, 5: 0.12})
    assert AdaptivePolicy().choose(_estimate(0.0), costs, 1) == 0


def test_load_shrinks_k():
    """At a large batch verification is compute-bound (cost grows with tokens): k drops, even to 0."""
    costs = _costs(1, draft=0.02, verify={1: 0.1, 5: 0.11})
    costs.observe_draft(16, 1, 0.05)
    for tokens in range(1, 10):
        _observe(costs, 16, tokens, 0.2 + 0.175 * (tokens - 1))
    policy, est = AdaptivePolicy(), _estimate(0.75)
    assert policy.choose(est, costs, 1) > policy.choose(est, costs, 16)
    assert policy.choose(est, costs, 16) == 0


def test_probes_again_after_sitting_at_zero():
    costs = _costs(1, draft=0.04, verify={1: 0.1, 5: 0.12})
    est, policy = _estimate(0.0), AdaptivePolicy(probe_every=3)
    for _ in range(3):
        assert policy.choose(est, costs, 1) == 0
        est.update(0, 0)
    assert policy.choose(est, costs, 1) == 1


def test_explores_each_small_k_a_few_times_per_batch_size():
    costs, policy = CostModel(), AdaptivePolicy(explore_up_to=3, explore_samples=2)
    chosen = []
    for _ in range(6):
        k = policy.choose(AcceptanceEstimate(), costs, 1)
        chosen.append(k)
        costs.observe_draft(1, k, 0.01 * k)
        costs.observe_verify(1, k + 1, 0.1)
    assert chosen == [1, 1, 2, 2, 3, 3]
    # A new load level: one plain round first (its cost is what carried costs are scaled by), then, as carried
    # costs say speculation may pay here, it is explored afresh.
    assert policy.choose(AcceptanceEstimate(), costs, 4) == 0
    costs.observe_verify(4, 1, 0.15)
    assert policy.choose(AcceptanceEstimate(), costs, 4) == 1


def test_a_policy_capped_below_explore_up_to_explores_to_its_cap_and_carries_from_there():
    """max_k 2 (draft.max_speculative_tokens: 2) under explore_up_to 4: k = 1..2 are explored, and a batch size
    explored that far lends its costs to a new one, which is then explored only where they say it may pay."""
    costs, policy = CostModel(), AdaptivePolicy(max_k=2, explore_samples=2)
    assert policy.explore_up_to == 4 and policy.explore_k == 2
    costs.observe_verify(1, 1, 0.1)  # a plain round
    chosen = []
    for _ in range(4):
        k = policy.choose(AcceptanceEstimate(), costs, 1)
        chosen.append(k)
        costs.observe_draft(1, k, 0.01 * k)
        costs.observe_verify(1, k + 1, 0.1 + 0.01 * k)
    assert chosen == [1, 1, 2, 2]
    costs.observe_verify(4, 1, 0.15)  # a plain round at the new batch size
    assert policy.choose(_estimate(0.0), costs, 4) == 0  # carried costs: drafts never accepted cannot pay
    assert policy.choose(_estimate(1.0), costs, 4) == 1  # ... always accepted may: explore


def test_picks_the_k_where_verification_cost_jumps():
    """Verify cost flat up to 3 tokens, then a step (as CPU GEMM row blocking gives): k = 2 wins."""
    costs = CostModel()
    costs.observe_draft(1, 1, 0.03)
    for tokens, seconds in {1: 0.2, 2: 0.21, 3: 0.22, 4: 0.33, 5: 0.34, 6: 0.35}.items():
        _observe(costs, 1, tokens, seconds)
    assert AdaptivePolicy(max_k=5).choose(_estimate(0.75), costs, 1) == 2


def test_acceptance_estimate_follows_drift():
    est = _estimate(1.0)
    assert est.alpha > 0.95 and min(est.rates(4)) > 0.95
    for _ in range(100):
        est.update(4, 0)
    assert est.rates(1)[0] < 0.1
    assert est.expected_tokens(4)[4] < 1.15


def test_expected_tokens_by_position():
    assert expected_tokens_by_position([0.5] * 3, 3) == pytest.approx(_closed_form(0.5, 3))
    assert expected_tokens_by_position([0.5, 1.0, 0.5], 3) == pytest.approx(1 + 0.5 + 0.5 + 0.25)
    assert expected_tokens_by_position([0.9, 0.9], 0) == 1.0


def _copying(rounds: int = 200, k: int = 8) -> AcceptanceEstimate:
    """Rounds as prompt lookup gives them: the first draft is wrong half the time; when it is right, the copied
    span is right to its end."""
    est = AcceptanceEstimate()
    for i in range(rounds):
        est.update(k, 0 if i % 2 else k)
    return est


def test_rates_are_estimated_per_position():
    est = _copying()
    first, *later = est.rates(8)
    assert first == pytest.approx(0.5, abs=0.05)
    assert min(later) > 0.85  # shrunk towards the position before, as few rounds reach them
    assert est.alpha == pytest.approx(8 / 9, abs=0.02)  # pooled: what a single-alpha model would use


def test_long_copied_spans_get_long_proposals():
    """Drafting is free (n-gram) and verifying 9 tokens costs 1.3x one. Per position, k = 8 is worth about
    1 + 0.5 * 8 = 5 tokens a round; one alpha of 0.5 (what the first positions show) would value it at 2 and stop
    at 3 or 4."""
    costs = CostModel()
    for _ in range(AdaptivePolicy().explore_samples):
        for k in range(1, 9):
            costs.observe_draft(1, k, 1e-4)
        for t in range(1, 10):
            costs.observe_verify(1, t, 0.1 * (1 + 0.0375 * (t - 1)))
    assert AdaptivePolicy(max_k=8).choose(_copying(), costs, 1) == 8
    assert AdaptivePolicy(max_k=8).choose(AcceptanceEstimate.starting_at(0.5, weight=1e6), costs, 1) <= 4


def test_a_round_without_proposals_is_not_a_round_at_zero():
    """An n-gram drafter asked for k > 0 may find no match: the request did not choose k = 0, so no probe is due."""
    est = AcceptanceEstimate()
    est.update(0, 0, k=4)
    assert est.rounds_at_zero == 0 and est.trials == []
    est.update(0, 0, k=0)
    assert est.rounds_at_zero == 1


def test_a_fixed_draft_call_cost_is_not_charged_to_small_k_alone():
    """A draft call costs a fixed part (reading last round's tokens) plus a step per draft. Priced per step from
    k = 1 calls, k = 4 would look four times dearer than it is; measured per k, the larger k wins."""
    costs = CostModel()
    for k in (4, 3, 2, 1):  # k = 1 last: a per-step price would now be that of a k = 1 call
        for _ in range(AdaptivePolicy().explore_samples):
            costs.observe_draft(4, k, 0.2 + 0.02 * k)  # fixed 200 ms, 20 ms a step
    for tokens, seconds in {1: 0.30, 2: 0.32, 3: 0.34, 4: 0.36, 5: 0.38}.items():
        _observe(costs, 4, tokens, seconds)
    assert costs.draft_cost(4, 6) == pytest.approx(0.2 + 0.02 * 6)  # extrapolated along the measured line
    assert AdaptivePolicy(max_k=4).choose(_estimate(0.9), costs, 4) == 4


def test_new_requests_start_from_recent_acceptance(tiny_target):
    from specdec_core.config import SamplingParams
    from specdec_core.request import Request
    from tests.helpers import make_engine

    engine = make_engine(tiny_target, tiny_target.model)  # a draft that is the target: every draft is accepted
    engine.add_request(Request("first", tuple(range(5, 15)), SamplingParams(max_tokens=40, ignore_eos=True), 4))
    while engine.has_work:
        engine.step()
    assert engine.acceptance.alpha > 0.9
    engine.add_request(Request("next", tuple(range(20, 30)), SamplingParams(max_tokens=4, ignore_eos=True), "auto"))
    assert engine._waiting[0].estimate.rates(4) == pytest.approx(engine.acceptance.rates(4))


def _measured_at_8() -> CostModel:
    """Costs as measured for the 1.5B/0.5B pair on a 2-core CPU at 8 sequences (ms): a draft call of k tokens and a
    verify of t tokens per row."""
    costs = CostModel()
    for _ in range(AdaptivePolicy().explore_samples):
        for k, ms in {1: 47, 2: 91, 3: 120, 4: 136, 5: 178, 6: 174, 8: 224}.items():
            costs.observe_draft(8, k, ms / 1000)
        for t, ms in {1: 163, 2: 271, 3: 373, 4: 445, 5: 530, 6: 623, 7: 688, 9: 964}.items():
            costs.observe_verify(8, t, ms / 1000)
    return costs


def test_one_k_for_the_batch_whose_rows_all_pay_for_the_longest():
    """One request that agrees always beside seven that never do: alone it would speculate, but its k would make the
    other seven pay for draft steps and verify positions that give them nothing."""
    costs, policy = _measured_at_8(), AdaptivePolicy()
    assert policy.choose(_estimate(1.0), costs, 8) > 0
    rows = [(_estimate(1.0), None)] + [(_estimate(0.0), None)] * 7
    assert policy.choose_batch(rows, costs, 8) == 0
    assert policy.choose_batch([(_estimate(1.0), None)] * 8, costs, 8) > 0


def test_a_gain_within_the_margin_is_not_taken():
    costs = _measured_at_8()
    rows = [(AcceptanceEstimate.starting_at(0.92, weight=1000), None)] * 8  # k = 6 about 4.5% better by the model
    assert AdaptivePolicy(margin=0.0, margin_per_sequence=0.0).choose_batch(rows, costs, 8) > 0
    assert AdaptivePolicy(margin=0.05, margin_per_sequence=0.0).choose_batch(rows, costs, 8) == 0


def test_the_gain_required_grows_with_the_batch():
    """A predicted 12% gain (k = 1, free draft and verify, acceptance 0.12) is taken alone, not among 8."""
    policy = AdaptivePolicy(max_k=1, explore_up_to=1)
    assert policy.required_gain(1) == pytest.approx(0.05) and policy.required_gain(8) == pytest.approx(0.19)
    assert policy.required_gain(64) == policy.max_margin
    costs = CostModel()
    for batch in (1, 8):
        costs.observe_draft(batch, 1, 1e-9)
        for tokens in (1, 2):
            _observe(costs, batch, tokens, 0.1)
    rows = [(AcceptanceEstimate.starting_at(0.12, weight=1e6), None)]
    assert policy.choose_batch(rows, costs, 1) == 1
    assert policy.choose_batch(rows * 8, costs, 8) == 0


def test_probes_back_off_while_they_keep_finding_zero():
    costs = _costs(1, draft=0.04, verify={1: 0.1, 5: 0.12})
    est, policy = _estimate(0.0), AdaptivePolicy(probe_every=2)
    waits = []
    for _ in range(3):
        wait = 0
        while policy.choose(est, costs, 1) == 0:
            est.update(0, 0)
            wait += 1
        waits.append(wait)
        est.update(1, 0)  # the probe: one draft, rejected
    assert waits == [2, 4, 8]


def test_a_batch_size_is_not_explored_where_carried_costs_say_speculation_cannot_pay():
    """Bucket 4 explored: verify grows steeply with tokens. At 8 only plain decoding was measured (twice as dear):
    carried over, the costs say no, so k stays 0 instead of exploring (which would start a draft for every row)."""
    policy = AdaptivePolicy()
    costs = CostModel()
    for _ in range(policy.explore_samples):
        for k in range(1, 5):
            costs.observe_draft(4, k, 0.05 * k)
        for t in range(1, 6):
            costs.observe_verify(4, t, 0.1 * t)
    costs.observe_verify(8, 1, 0.2)
    rows = [(_estimate(0.75), None)] * 8
    assert costs.unmeasured_k(8, 4, 3) == 1  # unexplored
    assert costs.carried_to(8, 4, 3).verify_cost(8, 3) == pytest.approx(0.6)
    assert policy.choose_batch(rows, costs, 8) == 0


def test_a_batch_size_is_explored_where_carried_costs_say_speculation_may_pay():
    policy = AdaptivePolicy()
    costs = _costs(4, draft=0.005, verify={1: 0.1, 5: 0.11})
    costs.observe_verify(8, 1, 0.2)
    assert policy.choose_batch([(_estimate(0.9), None)] * 8, costs, 8) == 1  # exploring k = 1 first


def test_a_batch_probes_only_when_every_adaptive_row_is_due():
    costs = _costs(1, draft=0.04, verify={1: 0.1, 5: 0.12})
    policy = AdaptivePolicy(probe_every=3)
    old, new = _estimate(0.0), _estimate(0.0)
    for _ in range(3):
        old.update(0, 0)
    assert policy.choose_batch([(old, None)], costs, 1) == 1
    assert policy.choose_batch([(old, None), (new, None)], costs, 1) == 0  # the new row is not due yet
    for _ in range(3):
        new.update(0, 0)
    assert policy.choose_batch([(old, None), (new, None)], costs, 1) == 1


def test_costs_are_carried_by_the_tokens_a_verify_processes():
    """At 1 sequence, verifying up to 4 tokens costs as much as 1 and 5 cost twice that (the kernel's row blocking).
    At 4 sequences, 2 tokens a row are 8 tokens in all: past the step, not the flat part."""
    policy = AdaptivePolicy()
    costs = CostModel()
    for _ in range(policy.explore_samples):
        costs.observe_draft(1, 1, 0.01)
        for t in range(1, 6):
            costs.observe_verify(1, t, 0.1 if t <= 4 else 0.2)
    costs.observe_verify(4, 1, 0.1)  # 4 tokens in all: on the flat part, as at 1 sequence
    carried = costs.carried_to(4, policy.explore_up_to, policy.explore_samples)
    assert carried.verify_cost(4, 1) == pytest.approx(0.1)
    assert carried.verify_cost(4, 2) > 0.2  # 8 tokens in all, extrapolated past the step


def test_no_probe_where_even_perfect_drafts_would_not_pay():
    costs = _costs(8, draft=0.5, verify={1: 0.1, 5: 0.5})
    policy = AdaptivePolicy(probe_every=2)
    est = _estimate(0.0)
    for _ in range(10):
        est.update(0, 0)
    assert policy.choose_batch([(est, None)] * 8, costs, 8) == 0
    cheap = _costs(8, draft=0.001, verify={1: 0.1, 5: 0.11})
    assert policy.choose_batch([(est, None)] * 8, cheap, 8) == 1  # here it could pay: probe


def test_no_probe_where_only_a_much_better_acceptance_than_the_rows_have_would_pay():
    """Rows at acceptance 0.8 where speculation pays only near 1.0 (at 0.9, halfway to 1, it does not): probing
    would buy every row a catch-up and a wider verify to learn nothing that could change k."""
    policy = AdaptivePolicy(max_k=4, probe_every=2, margin=0.0, margin_per_sequence=0.0)
    costs = _costs(8, draft=0.045, verify={1: 0.1, 5: 0.3})
    assert policy.choose_batch([(AcceptanceEstimate.starting_at(1.0, weight=1e6), None)] * 8, costs, 8) > 0
    assert policy.choose_batch([(AcceptanceEstimate.starting_at(0.9, weight=1e6), None)] * 8, costs, 8) == 0
    est = AcceptanceEstimate.starting_at(0.8, weight=1e6)
    for _ in range(10):
        est.update(0, 0, 0)
    assert policy.choose_batch([(est, None)] * 8, costs, 8) == 0


def test_catch_up_cost_is_learnt_per_token_from_reads_long_enough_to_time():
    costs = CostModel()
    assert costs.catch_up_cost(100) == 0.0  # unmeasured: starting costs nothing yet
    costs.observe_catch_up(4, 1.0)  # too short to tell a per-token cost from a per-call one
    assert costs.catch_up is None
    costs.observe_catch_up(100, 0.5)
    assert costs.catch_up_cost(40) == pytest.approx(0.2)


def test_a_catch_up_pays_only_over_enough_remaining_tokens():
    """Speculation that would emit ~2.7x the tokens per second is still not worth a draft prefill of 2 s with 20
    tokens left (it would save ~1.3 s of 2 s), and is worth it with 500 tokens left."""
    costs = _costs(1, draft=0.01, verify={1: 0.1, 5: 0.11})
    policy, est = AdaptivePolicy(max_k=4), _estimate(0.9)
    assert policy.choose(est, costs, 1) > 0
    assert policy.choose(est, costs, 1, catch_up_s=2.0, horizon=20) == 0
    assert policy.choose(est, costs, 1, catch_up_s=2.0, horizon=500) > 0


# -- hybrid drafting: free proposals weighed against the draft model's ----------------------------------------------


def _hybrid_costs(draft: float) -> CostModel:
    """One sequence; verify nearly free up to 17 tokens (0.1 s, +1% a token), a draft call `draft` s a step."""
    costs = CostModel()
    for k in range(1, 17):
        costs.observe_draft(1, k, draft * k)
    for tokens in range(1, 18):
        _observe(costs, 1, tokens, 0.1 * (1 + 0.01 * (tokens - 1)))
    return costs


def test_a_long_confident_free_proposal_beats_the_draft_model():
    """12 tokens expected from a free 16-token proposal against at most ~5 from the model's drafts, which also
    cost a draft call: the free proposal, with no drafting."""
    policy = AdaptivePolicy(max_k=16)
    choice = policy.choose_round([(_estimate(0.8), None)], _hybrid_costs(0.04), 1, free=[FreeProposal(12.0, 16)])
    assert choice.free
    assert policy.takes_free(_estimate(0.8).expected_tokens(16), choice.k, FreeProposal(12.0, 16))


def test_a_weak_free_proposal_loses_to_a_good_draft_model():
    policy = AdaptivePolicy(max_k=16)
    rows, offer = [(_estimate(1.0), None)], FreeProposal(1.3, 2)
    choice = policy.choose_round(rows, _hybrid_costs(0.01), 1, free=[offer])
    assert choice.k >= 4
    assert not policy.takes_free(rows[0][0].expected_tokens(16), choice.k, offer)  # this row drafts


def test_with_a_dear_draft_model_a_modest_free_proposal_is_still_taken():
    """The draft model would not pay (a step costs as much as a verify, acceptance 0.5), but a free proposal
    expected to add 0.6 tokens for a nearly free verify does: k = 0 with the free proposal, not plain decoding."""
    choice = AdaptivePolicy(max_k=16).choose_round(
        [(_estimate(0.5), None)], _hybrid_costs(0.1), 1, free=[FreeProposal(1.6, 3)]
    )
    assert choice == RoundChoice(0, True)


def test_neither_pays_plain_decoding():
    """Neither a poor free proposal nor poor drafts beat plain decoding by the margin: neither is verified."""
    choice = AdaptivePolicy(max_k=16).choose_round(
        [(_estimate(0.0), None)], _hybrid_costs(0.1), 1, free=[FreeProposal(1.01, 4)]
    )
    assert choice == RoundChoice(0, False)


def test_a_free_proposal_is_weighed_per_row():
    """Two rows: one with a long free proposal, one without. With cheap draft steps the second drafts with the
    model (k > 0), and the first takes its free proposal rather than the model's k."""
    policy = AdaptivePolicy(max_k=16)
    costs = _hybrid_costs(0.01)
    for k in range(1, 17):
        costs.observe_draft(2, k, 0.002 * k)
    for tokens in range(1, 18):
        _observe(costs, 2, tokens, 0.1 * (1 + 0.01 * (tokens - 1)))
    est = _estimate(0.75)
    offers = [FreeProposal(14.0, 16), None]
    choice = policy.choose_round([(est, None), (est, None)], costs, 2, free=offers)
    expected = est.expected_tokens(16)
    assert choice.k > 0 and choice.free
    assert policy.takes_free(expected, choice.k, offers[0]) and not policy.takes_free(expected, choice.k, offers[1])


def _drive(
    policy: AdaptivePolicy,
    costs: CostModel,
    est: AcceptanceEstimate,
    rounds: int,
    true_draft: float,
    true_verify: float,
) -> list[int]:
    """`rounds` rounds at batch size 1: the k chosen each round, each round's costs observed at their true values
    (a draft call of k steps k * true_draft; a verify of t tokens true_verify * (1 + 0.05 * (t - 1)))."""
    chosen = []
    for _ in range(rounds):
        k = policy.choose_round([(est, None)], costs, 1).k
        if k:
            costs.observe_draft(1, k, true_draft * k)
        costs.observe_verify(1, k + 1, true_verify * (1 + 0.05 * (k + 1 - 1)))
        chosen.append(k)
    return chosen


def test_costs_measured_in_a_slow_moment_are_measured_again_and_k_recovers():
    """Calibration ran while the machine was three times slower for k >= 2 (as when another process took the
    cores): k = 1 looks best, and only k = 1 is measured from then on. Without a second look the larger k would
    never be tried again; once their costs are stale they are measured again, replaced, and k goes back up."""
    policy, costs, est = AdaptivePolicy(max_k=4), CostModel(stale_after=64), _estimate(0.9)
    for _ in range(policy.explore_samples):
        for k in range(1, 5):
            slow = 1.0 if k == 1 else 3.0
            costs.observe_draft(1, k, 0.02 * k * slow)
            costs.observe_verify(1, k + 1, 0.1 * (1 + 0.05 * k) * slow)
        costs.observe_verify(1, 1, 0.1)
    chosen = _drive(policy, costs, est, 60, 0.02, 0.1)
    assert set(chosen) == {1}  # fresh enough: judged by what was measured
    chosen = _drive(policy, costs, est, 200, 0.02, 0.1)
    assert {2, 3, 4} <= set(chosen[:20])  # each stale k measured once
    assert chosen[-100:].count(4) > 90  # the true costs make k = 4 best; a refresh every 64 rounds per k


def test_a_stale_cost_is_replaced_not_averaged():
    costs = CostModel(stale_after=4)
    costs.observe_draft(1, 2, 0.3)
    costs.observe_draft(1, 2, 0.1)
    assert costs.draft[1][2] == pytest.approx(0.3 + 0.2 * (0.1 - 0.3))  # fresh: averaged
    for _ in range(5):
        costs.observe_verify(1, 1, 0.1)
    assert costs.stale_k(1, 4) == 2
    costs.observe_draft(1, 2, 0.1)
    assert costs.draft[1][2] == 0.1 and costs.stale_k(1, 4) is None


def test_a_verify_cost_is_not_assumed_from_one_measured_width():
    """One width measured says nothing of how cost grows with width: flat for a dense model's memory-bound verify,
    steep for a mixture of experts' (every extra row may read other experts). From two widths on, the slope of
    the measured ones extends the table."""
    costs = CostModel()
    costs.observe_verify(1, 1, 0.1)
    assert costs.verify_cost(1, 1) == 0.1 and costs.verify_cost(1, 3) is None
    costs.observe_verify(1, 2, 0.18)  # a second width: 80% more
    assert costs.verify_cost(1, 4) == pytest.approx(0.34)


def test_a_verify_that_grows_steeply_with_width_gets_short_proposals():
    """The same acceptance and draft cost; a dense-like verify (3% a token) against a mixture-of-experts-like one
    (each extra token reads about half an expert set more): auto's k follows the measured widths."""
    flat = _costs(1, draft=0.005, verify={1: 0.1, 9: 0.124})
    steep = _costs(1, draft=0.005, verify={1: 0.1, 9: 0.5})
    policy, estimate = AdaptivePolicy(max_k=8), AcceptanceEstimate.starting_at(0.8, weight=1e6)
    assert policy.choose(estimate, flat, 1) == 6
    assert policy.choose(estimate, steep, 1) == 2


def test_a_batch_explored_at_one_width_measures_plain_decoding_before_judging():
    """max_k 1 explores k = 1 only (verify width 2): with no plain round measured, one is run, then k is judged."""
    costs, policy = CostModel(), AdaptivePolicy(max_k=1)
    costs.observe_draft(1, 1, 0.001)
    _observe(costs, 1, 2, 0.11)
    assert policy.choose(_estimate(0.9), costs, 1) == 0
    costs.observe_verify(1, 1, 0.1)
    assert policy.choose(_estimate(0.9), costs, 1) == 1
