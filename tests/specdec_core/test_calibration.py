"""Calibration on tiny models: it measures every batch size and k the policy would otherwise explore, leaves no
sequence or cache behind, forgets the synthetic acceptance, and stops cleanly where the context is too small."""

from __future__ import annotations

import pytest

from specdec_core.calibration import batch_sizes, calibrate
from specdec_core.config import SamplingParams
from specdec_core.request import Request
from tests.helpers import make_engine, perturbed, run_to_completion


@pytest.mark.parametrize("largest, sizes", [(8, (1, 2, 4, 8)), (6, (1, 2, 4, 6)), (1, (1,)), (0, ())])
def test_batch_sizes_cover_each_cost_bucket_once(largest, sizes):
    assert batch_sizes(largest) == sizes


def _idle(engine, slots):
    runner = engine.target.runner
    assert not engine.has_work and runner.cache.free_slots == slots
    if engine.drafter is not None:
        assert engine.drafter.active_sequences == 0


def test_calibration_measures_what_auto_would_explore_and_leaves_nothing_behind(tiny_target):
    engine = make_engine(tiny_target, perturbed(tiny_target.model, 0.2, seed=3), max_seq_len=512)
    policy = engine.config.policy
    prior = engine.acceptance.rates(4)
    report = calibrate(engine)
    assert report.batch_sizes == (1, 2, 4, 8)
    assert report.rounds == 4 * (policy.explore_up_to + 1) * policy.explore_samples
    for size in report.batch_sizes:
        assert engine.costs.unmeasured_k(size, policy.explore_up_to, policy.explore_samples) is None
        assert engine.costs.verify_cost(size, 1) is not None and engine.costs.draft_cost(size, 1) is not None
    assert engine.costs.catch_up is not None  # the draft starts were timed
    assert engine.acceptance.rates(4) == prior and engine.acceptance_by_label == {}
    _idle(engine, 8)


def test_after_calibration_greedy_output_is_still_plain_decoding(tiny_target):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompt = tiny_target.tokenizer("def add(a, b):")["input_ids"]
    expected = run_to_completion(make_engine(tiny_target), [("r", prompt, params, 0)])["r"][0]
    engine = make_engine(tiny_target, perturbed(tiny_target.model, 0.2, seed=3), max_seq_len=512)
    calibrate(engine, max_batch=2)
    outputs = run_to_completion(engine, [("a", prompt, params, "auto"), ("b", prompt, params, 3)])
    assert outputs["a"][0] == expected and outputs["b"][0] == expected
    _idle(engine, 8)


def test_without_a_drafter_only_plain_rounds_are_measured(tiny_target):
    engine = make_engine(tiny_target)
    report = calibrate(engine, max_batch=4)
    assert report.batch_sizes == (1, 2, 4)
    assert all(set(engine.costs.verify[b]) == {1} for b in (1, 2, 4)) and engine.costs.draft == {}
    _idle(engine, 8)


def test_a_context_too_small_for_every_round_stops_early_and_cleanly(tiny_target):
    engine = make_engine(tiny_target, perturbed(tiny_target.model, 0.2, seed=3), max_seq_len=48)
    report = calibrate(engine)
    assert report.batch_sizes != (1, 2, 4, 8)  # the sequences ran out of room before the largest batch
    _idle(engine, 8)


def test_a_busy_engine_is_not_calibrated(tiny_target):
    engine = make_engine(tiny_target)
    engine.add_request(Request("r", (1, 2, 3), SamplingParams(max_tokens=4)))
    with pytest.raises(RuntimeError, match="idle"):
        calibrate(engine)


def test_set_speculation_changes_a_running_requests_k(tiny_target):
    engine = make_engine(tiny_target, "ngram")
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompt = tiny_target.tokenizer("x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n")["input_ids"] * 2
    engine.add_request(Request("r", tuple(prompt), params, 4))
    engine.step()
    assert engine.set_speculation("r", 0) and not engine.set_speculation("nobody", 0)
    while engine.has_work:
        out = engine.step()
        assert all(o.round is None or o.round.k == 0 for o in out)
