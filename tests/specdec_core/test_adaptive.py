"""Choosing k from acceptance and measured costs, per batch size."""

from __future__ import annotations

import pytest

from specdec_core.adaptive import AcceptanceEstimate, AdaptivePolicy, CostModel, expected_tokens


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def _costs(batch: int, draft: float, verify: dict[int, float]) -> CostModel:
    costs = CostModel()
    costs.observe_draft(batch, 1, draft)
    for tokens, seconds in verify.items():
        costs.observe_verify(batch, tokens, seconds)
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
    costs.observe_verify(16, 1, 0.2)
    costs.observe_verify(16, 5, 0.9)
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


def test_initial_k_until_costs_are_measured():
    assert AdaptivePolicy(initial_k=3).choose(AcceptanceEstimate(), CostModel(), 1) == 3


def test_acceptance_estimate_follows_drift():
    est = _estimate(1.0)
    assert est.alpha > 0.95
    for _ in range(100):
        est.update(4, 0)
    assert est.alpha < 0.1
