"""A failure is the row's it belongs to: one row's grammar, commit or free drafter failing ends (or costs
proposals of) that row alone; every other row's tokens, stream and caches are as if it had not happened."""

from __future__ import annotations

import pytest

from specdec_core.config import SamplingParams
from specdec_core.grammar.constraint import Constraint
from specdec_core.grammar.state import GrammarState
from specdec_core.request import Request
from specdec_core.stopping import FinishReason
from tests.helpers import make_engine, one_torch_thread, run_to_completion

PROMPTS = ["def add(a, b):", "The quick brown fox", "class Counter:"]
PARAMS = SamplingParams(max_tokens=30, ignore_eos=True)
REGEX = Constraint("regex", r"[a-z ]{20,40}")  # no early end: the fault is reached


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


class _BreaksAfter(GrammarState):
    """A grammar whose `method` raises once the output holds `after` tokens: the fault of one row's grammar."""

    def __init__(self, grammar, method: str, after: int) -> None:
        super().__init__(grammar)
        self._method, self._after = method, after

    def _check(self, method: str) -> None:
        if method == self._method and self.num_tokens >= self._after:
            raise RuntimeError(f"injected {method} fault")

    def advance(self, token_ids):
        self._check("advance")
        return super().advance(token_ids)

    def forced(self, limit=64):
        self._check("forced")
        return super().forced(limit)

    def allowed_words(self):
        self._check("allowed_words")
        return super().allowed_words()


def _ids(loaded, text):
    return tuple(loaded.tokenizer(text)["input_ids"])


def _alone(loaded, draft, request):
    engine = make_engine(loaded, draft)
    engine.add_request(request)
    tokens = []
    while engine.has_work:
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def _run(engine):
    """Step to the end: each request's tokens, text and last output."""
    results = {}
    while engine.has_work:
        for out in engine.step():
            tokens, text, _ = results.get(out.seq_id, ([], "", None))
            results[out.seq_id] = (tokens + list(out.new_token_ids), text + out.new_text, out)
    return results


@pytest.mark.parametrize(
    "method,after,draft",
    [
        ("advance", 3, None),
        ("advance", 3, "model"),
        ("forced", 2, "model"),  # only a speculating row asks what its grammar forces
        ("allowed_words", 0, None),  # its prefill's masks
        ("allowed_words", 1, None),
        ("allowed_words", 1, "model"),
    ],
)
def test_one_rows_grammar_failing_ends_that_row_alone(tiny_target, method, after, draft):
    """Rows beside the failing one (one constrained by a working grammar, two free) return exactly what they
    return alone, and end normally; the failing row ends with its error; no cache slot is left held."""
    draft_model = tiny_target.model if draft == "model" else None
    engine = make_engine(tiny_target, draft_model)
    good = [
        Request("free0", _ids(tiny_target, PROMPTS[0]), PARAMS, 3),
        Request("free1", _ids(tiny_target, PROMPTS[1]), PARAMS, "auto"),
        Request("constrained", _ids(tiny_target, PROMPTS[2]), SamplingParams(max_tokens=30, constraint=REGEX), 3),
    ]
    broken = Request("broken", _ids(tiny_target, PROMPTS[2]), SamplingParams(max_tokens=30, constraint=REGEX), 3)
    for request in [good[0], broken, *good[1:]]:
        engine.add_request(request)
    seq = next(s for s in engine._waiting if s.seq_id == "broken")
    seq.grammar = _BreaksAfter(seq.grammar.grammar, method, after)

    results = _run(engine)

    for request in good:
        tokens, _, last = results[request.seq_id]
        assert tokens == _alone(tiny_target, draft_model, request)
        assert last.error is None and last.finish_reason != FinishReason.ERROR
    _, _, last = results["broken"]
    assert last.finish_reason == FinishReason.ERROR and f"injected {method} fault" in str(last.error)
    assert engine.target.free_slots == engine.target.runner.cache.num_slots  # every row's slot freed
    if engine.drafter is not None:
        assert engine.drafter.active_sequences == 0


class _ObserveFails:
    """A free drafter whose `observe` raises for one sequence: a bug in one row's lookup structure."""

    def __init__(self, inner, seq_id: str) -> None:
        self.inner, self.seq_id, self.name = inner, seq_id, inner.name

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def observe(self, seq_id, num_committed):
        if seq_id == self.seq_id:
            raise RuntimeError("injected observe fault")
        self.inner.observe(seq_id, num_committed)


def test_a_free_drafter_failing_for_one_row_costs_its_proposals_only(tiny_target):
    """The row goes on without free proposals, to the same tokens (greedy), and no other row notices."""
    engine = make_engine(tiny_target, tiny_target.model, hybrid=True)
    engine.hybrid.free = _ObserveFails(engine.hybrid.free, "r1")
    requests = [(f"r{i}", _ids(tiny_target, text), PARAMS, "auto") for i, text in enumerate(PROMPTS)]

    results = run_to_completion(engine, requests)

    for request_id, prompt, params, _ in requests:
        tokens, _, last = results[request_id]
        assert tokens == _alone(tiny_target, None, Request(request_id, prompt, params, 0))
        assert last.error is None and last.finish_reason == FinishReason.LENGTH
