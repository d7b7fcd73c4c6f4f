"""Runs of plain steps: the same tokens as round-by-round plain decoding, cut in on, stopped, and failed row by row."""

from __future__ import annotations

import pytest

from specdec_core import engine as engine_module
from specdec_core.config import SamplingParams, TokenShaping
from specdec_core.decode_run import DecodeItem, StepwiseRun
from specdec_core.errors import InvalidArgument
from specdec_core.request import Request
from specdec_core.stopping import FinishReason
from specdec_core.target import PartialVerifyFailure, VerifyOutcome
from tests.helpers import drive, make_engine

PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):\n    print("]


def _ids(loaded, text):
    return tuple(loaded.tokenizer(text)["input_ids"])


class _CountingRuns:
    """Counts the runs the engine starts on its target."""

    def __init__(self, engine):
        self.runs = 0
        decode = engine.target.decode

        def counted(items):
            self.runs += 1
            return decode(items)

        engine.target.decode = counted


def _arrivals(loaded, temperature):
    params = [
        SamplingParams(temperature=temperature, seed=1, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=temperature, seed=2, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=temperature, seed=3, max_tokens=25, ignore_eos=True),
    ]
    # The third arrives mid-run: the run is cut to admit it, and its rows' draws are rewound.
    return [
        (at, Request(f"r{i}", _ids(loaded, p), sp, 0)) for i, (at, p, sp) in enumerate(zip((0, 0, 4), PROMPTS, params))
    ]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_runs_give_the_tokens_of_round_by_round_decoding(tiny_target, monkeypatch, temperature):
    monkeypatch.setattr(engine_module, "RUN_STEPS", 5)  # rows also cross from one run into the next
    expected = drive(make_engine(tiny_target, plain_runs=False), _arrivals(tiny_target, temperature))
    engine = make_engine(tiny_target)
    counter = _CountingRuns(engine)
    got = drive(engine, _arrivals(tiny_target, temperature))
    assert {r: tokens for r, (tokens, _) in got.items()} == {r: tokens for r, (tokens, _) in expected.items()}
    assert all(out.finish_reason == FinishReason.LENGTH for _, out in got.values())
    assert 3 < counter.runs < 30, counter.runs  # runs, each of several steps
    assert engine.target.free_slots == engine.target.runner.cache.num_slots


def test_a_row_that_ends_here_mid_run_leaves_the_others_exact_and_frees_its_cache(tiny_target):
    """A stop string (found by the engine, not the target) and a cancel end rows while the run goes on."""
    ids = _ids(tiny_target, PROMPTS[0])
    plain = drive(
        make_engine(tiny_target, plain_runs=False),
        [(0, Request("x", ids, SamplingParams(max_tokens=40, ignore_eos=True), 0))],
    )
    text = tiny_target.tokenizer.decode(plain["x"][0][:6])
    stop = text[-3:] if len(text.strip()) >= 3 else text
    arrivals = [
        (0, Request("stops", ids, SamplingParams(max_tokens=40, stop=(stop,), ignore_eos=True), 0)),
        (0, Request("cancelled", ids, SamplingParams(max_tokens=40, ignore_eos=True), 0)),
        (0, Request("goes_on", _ids(tiny_target, PROMPTS[1]), SamplingParams(max_tokens=40, ignore_eos=True), 0)),
    ]
    expected = drive(make_engine(tiny_target, plain_runs=False), arrivals)

    cancelled = []

    def cancel(engine, step):
        if step == 4:
            cancelled.append(engine.abort("cancelled"))

    engine = make_engine(tiny_target)
    got = drive(engine, arrivals, cancel)
    assert got["stops"][1].finish_reason == FinishReason.STOP and got["stops"][0] == expected["stops"][0]
    assert got["goes_on"][0] == expected["goes_on"][0]
    assert cancelled[0].finish_reason == FinishReason.CANCELLED and len(got["cancelled"][0]) < 40
    assert engine.target.free_slots == engine.target.runner.cache.num_slots


def test_a_row_that_speculates_again_cuts_the_run_and_stays_exact(tiny_target):
    ids = _ids(tiny_target, PROMPTS[2])
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = drive(make_engine(tiny_target, plain_runs=False), [(0, Request("r", ids, params, 0))])

    def speculate(engine, step):
        if step == 3:
            assert engine.set_speculation("r", 3)

    engine = make_engine(tiny_target, tiny_target.model)
    rounds = []
    got = drive(engine, [(0, Request("r", ids, params, 0))], speculate)
    assert got["r"][0] == expected["r"][0]
    engine2 = make_engine(tiny_target, tiny_target.model)
    engine2.add_request(Request("r", ids, params, 0))
    for step in range(40):
        if step == 3:
            engine2.set_speculation("r", 3)
        rounds += [out.round.k for out in engine2.step() if out.round is not None]
        if not engine2.has_work:
            break
    assert rounds[:2] == [0, 0] and 3 in rounds  # plain run steps, then speculative rounds


def test_eos_ends_a_row_in_the_run_where_plain_decoding_ends(tiny_target):
    eos = next(iter(tiny_target.eos_token_ids))
    ids = _ids(tiny_target, PROMPTS[1])
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    free = drive(make_engine(tiny_target, plain_runs=False), [(0, Request("r", ids, params, 0))])["r"][0]
    # An engine whose eos is a token the output reaches: the run must end the row there, as the engine does.
    stop_at = free[10]
    engine = make_engine(tiny_target)
    engine.eos_token_ids = frozenset({stop_at, eos})
    got = drive(engine, [(0, Request("r", ids, SamplingParams(max_tokens=60), 0))])["r"]
    assert got[0] == free[: free.index(stop_at) + 1]
    assert got[1].finish_reason == FinishReason.EOS


def _outcome(token):
    return VerifyOutcome((token,), 0)


def test_a_row_whose_call_failed_ends_alone_and_the_others_go_on():
    calls = []

    def verify(items):
        calls.append([item.seq_id for item in items])
        if len(calls) == 2:
            raise PartialVerifyFailure([_outcome(7), None], {1: RuntimeError("replica lost")})
        return [_outcome(5) for _ in items]

    greedy = TokenShaping()
    items = [DecodeItem(s, 1, greedy, None, 4, frozenset()) for s in ("a", "b")]
    run = StepwiseRun(verify, items, holds=lambda seq_id: True)
    steps = list(run)
    assert steps[0] == [5, 5]
    assert steps[1][0] == 7 and isinstance(steps[1][1], RuntimeError)
    assert [s[1] for s in steps[2:]] == [None, None] and [s[0] for s in steps[2:]] == [5, 5]
    assert calls[2:] == [["a"], ["a"]]


def test_a_stopped_run_takes_no_further_step():
    run = StepwiseRun(
        lambda items: [_outcome(5) for _ in items],
        [DecodeItem("a", 1, TokenShaping(), None, 9, frozenset())],
        lambda s: True,
    )
    assert run.step() == [5]
    run.stop()
    assert run.step() is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_steps": 0, "uniforms": None}, "items.max_steps"),
        ({"max_steps": 2, "uniforms": (0.5,), "shaping": TokenShaping(temperature=1.0)}, "items.uniforms"),
        ({"max_steps": 1, "uniforms": (0.5,)}, "items.uniforms"),  # greedy rows draw nothing
        ({"max_steps": 1, "uniforms": None, "shaping": TokenShaping(temperature=1.0)}, "items.uniforms"),
    ],
)
def test_bad_run_items_name_the_field(kwargs, field):
    shaping = kwargs.pop("shaping", TokenShaping())
    with pytest.raises(InvalidArgument) as raised:
        DecodeItem("a", 1, shaping, stop_token_ids=frozenset(), **kwargs)
    assert raised.value.field == field
