"""Hybrid drafting through the engine: suffix proposals and the draft model's, chosen per request and round,
narrowed by a request's `speculation_method`, each round saying which method proposed, and greedy output equal
to plain decoding whatever the mix. Then `HybridDrafter` alone: proposing, valuing and trimming by label."""

from __future__ import annotations

import pytest

from specdec_core.adaptive import CostModel, FreeProposal
from specdec_core.config import SamplingParams
from specdec_core.drafters.base import DraftRequest, Proposal
from specdec_core.drafters.hybrid import HybridDrafter
from specdec_core.drafters.session import DraftSession, DraftState
from specdec_core.errors import InvalidArgument
from specdec_core.request import Request
from tests.helpers import make_engine

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def _run(engine, requests, k=4):
    """(seq_id, prompt, speculation_method, salt) run in order, one at a time: {seq_id: (tokens, rounds)}, each
    round as (method, proposed, accepted). A fixed k: which method a round takes then depends on the acceptance
    records alone (deterministic at T = 0), not on timings, as `auto`'s choice of k does."""
    out = {}
    for seq_id, prompt, method, salt in requests:
        engine.add_request(Request(seq_id, tuple(prompt), GREEDY, k, cache_salt=salt, speculation_method=method))
        tokens, rounds = [], []
        while engine.has_work:
            for o in engine.step():
                tokens += o.new_token_ids
                if o.round is not None:
                    rounds.append((o.round.method, len(o.round.proposed_token_ids), o.round.num_accepted))
        out[seq_id] = (tokens, rounds)
    return out


def _methods(rounds):
    return {method for method, _, _ in rounds}


@pytest.fixture
def engines(pair):
    target, draft = pair
    return make_engine(target), make_engine(target, draft.model, hybrid=True, max_speculative_tokens=16)


def test_every_speculation_method_gives_plain_decodings_tokens(engines):
    plain, hybrid = engines
    ((expected, _),) = _run(plain, [("r", PROMPT, None, None)]).values()
    assert hybrid.methods == ("suffix", "draft_model")
    # Each method twice with one salt: the second run of a prompt finds the first's output in the global structure.
    runs = [(f"{m}-{i}", PROMPT, m, f"salt-{m}") for m in ("auto", "suffix", "draft_model", "none") for i in (0, 1)]
    results = _run(hybrid, runs)
    for seq_id, (tokens, _) in results.items():
        assert tokens == expected, seq_id
    seen = {m: _methods(results[f"{m}-0"][1] + results[f"{m}-1"][1]) for m in ("auto", "suffix", "draft_model", "none")}
    assert seen["none"] == {None}
    assert seen["suffix"] <= {"suffix", None} and "suffix" in seen["suffix"]
    assert seen["draft_model"] <= {"draft_model", None} and "draft_model" in seen["draft_model"]
    # auto: the repeat is read from the suffix structure (its whole output was seen), the first run drafts
    assert "suffix" in _methods(results["auto-1"][1])


def test_a_repeated_answer_is_proposed_by_suffix_in_long_runs(engines):
    """The second request with the same prompt and salt: suffix proposes the earlier answer in long spans, all
    accepted; the first request had no earlier answer to read."""
    _, hybrid = engines
    results = _run(hybrid, [("a", PROMPT, "auto", "s"), ("b", PROMPT, "auto", "s")], k=8)
    first, second = results["a"][1], results["b"][1]
    assert not any(method == "suffix" and proposed >= 4 for method, proposed, _ in first)
    assert any(method == "suffix" and proposed == accepted >= 4 for method, proposed, accepted in second)


def test_a_method_the_engine_does_not_run_is_refused_naming_the_choices(pair):
    target, draft = pair
    hybrid = make_engine(target, draft.model, hybrid=True)
    with pytest.raises(InvalidArgument) as err:
        hybrid.add_request(Request("r", tuple(PROMPT), GREEDY, speculation_method="ngram"))
    assert err.value.field == "speculation_method"
    assert all(name in err.value.message for name in ("auto", "suffix", "draft_model", "none"))
    ngram = make_engine(target, "ngram")
    with pytest.raises(InvalidArgument, match="speculation_method"):
        ngram.add_request(Request("r", tuple(PROMPT), GREEDY, speculation_method="suffix"))
    plain = make_engine(target)
    with pytest.raises(InvalidArgument, match="speculation_method"):
        plain.add_request(Request("r", tuple(PROMPT), GREEDY, speculation_method="draft_model"))
    plain.add_request(Request("ok", tuple(PROMPT), GREEDY, speculation_method="none"))  # always allowed
    assert not hybrid.has_work and plain.num_waiting == 1


def test_a_failing_free_drafter_costs_its_proposals_not_the_request(engines):
    plain, hybrid = engines
    ((expected, _),) = _run(plain, [("r", PROMPT, None, None)]).values()

    def broken(requests):
        raise RuntimeError("index corrupted")

    hybrid.hybrid.free.propose = broken
    ((tokens, rounds),) = _run(hybrid, [("r", PROMPT, "auto", None)]).values()
    assert tokens == expected
    assert "suffix" not in _methods(rounds) and "draft_model" in _methods(rounds)


# -- HybridDrafter alone -----------------------------------------------------------------------------------------


class _Free:
    """A free drafter proposing `tokens` for each request (cut to its num_tokens), labelled; `fail` names calls
    that raise."""

    name = "suffix"

    def __init__(self, tokens=(1, 2, 3, 4), fail=()) -> None:
        self.tokens, self.fail, self.calls = list(tokens), set(fail), []

    def start(self, seq_id, prompt_ids, cache_salt=None):
        self.calls.append(("start", seq_id))
        if "start" in self.fail and seq_id == "bad":
            raise RuntimeError("cannot index")
        return 0

    def propose(self, requests):
        self.calls.append(("propose", [r.seq_id for r in requests]))
        if "propose" in self.fail:
            raise RuntimeError("index corrupted")
        return [Proposal(self.tokens[: r.num_tokens], None, label="span") for r in requests]

    def release(self, seq_id):
        self.calls.append(("release", seq_id))


def _row(seq_id, k=4):
    return DraftSession(seq_id, None), DraftRequest(seq_id, [7, 8], k, SamplingParams().shaping, None)


def test_the_hybrid_drafter_starts_each_row_and_proposes_for_those_it_holds():
    free = _Free(fail=("start",))
    rows = [_row("a"), _row("bad"), _row("c", k=2)]
    found = HybridDrafter(free).propose(rows)
    assert [None if p is None else p.token_ids for p in found] == [[1, 2, 3, 4], None, [1, 2]]
    assert free.calls == [("start", "a"), ("start", "bad"), ("start", "c"), ("propose", ["a", "c"])]
    assert [s.free for s, _ in rows] == [DraftState.ACTIVE, DraftState.FAILED, DraftState.ACTIVE]


def test_a_failed_lookup_stops_the_free_drafter_for_its_rows():
    free = _Free(fail=("propose",))
    rows = [_row("a"), _row("b")]
    assert HybridDrafter(free).propose(rows) == [None, None]
    assert all(s.free is DraftState.FAILED for s, _ in rows)
    assert free.calls[-2:] == [("release", "a"), ("release", "b")]
    assert HybridDrafter(None).propose(rows) == [None, None]


def test_an_untried_label_is_valued_as_always_right_then_by_its_record():
    hybrid = HybridDrafter(None)
    proposal = Proposal([1, 2, 3], None, label="span")
    assert hybrid.free_value(proposal) == FreeProposal(4.0, 3)
    for _ in range(5):
        hybrid.label_estimate("span").update(3, 0)  # never right
    value = hybrid.free_value(proposal)
    assert value.length == 3 and value.expected_tokens < 1.5
    assert hybrid.free_value(Proposal([1], None)) == FreeProposal(2.0, 1)  # no label: no record


def test_a_labelled_proposal_is_trimmed_to_what_its_record_makes_worth_verifying():
    hybrid, costs = HybridDrafter(None), CostModel()
    proposal = Proposal([1, 2, 3, 4], None, label="span")
    assert hybrid.trim(proposal, 1, costs) is proposal  # no record: untouched
    for _ in range(20):
        hybrid.label_estimate("span").update(4, 1)  # its first token right, the second never
    assert hybrid.trim(proposal, 1, costs) is proposal  # no verify measured: nothing to weigh
    costs.verify = {1: {t: 1.0 + 0.1 * t for t in range(1, 6)}}
    assert hybrid.trim(proposal, 1, costs).token_ids == [1]
    assert hybrid.trim(Proposal([1, 2], None), 1, costs).token_ids == [1, 2]  # unlabelled: untouched
    for _ in range(60):
        hybrid.label_estimate("span").update(4, 4)  # now right to its end
    assert hybrid.trim(proposal, 1, costs).token_ids == [1, 2, 3, 4]


def test_a_label_is_valued_by_its_record_only_from_two_trials_at_its_first_position():
    hybrid = HybridDrafter(None)
    proposal = Proposal([1, 2, 3], None, label="span")
    for _ in range(2):  # decayed trials at position 1: 1.0, then 1.99
        hybrid.label_estimate("span").update(3, 0)
        assert hybrid.free_value(proposal) == FreeProposal(4.0, 3)  # still explored
    hybrid.label_estimate("span").update(3, 0)  # 2.97 trials: the record speaks
    assert hybrid.free_value(proposal).expected_tokens < 4.0


def test_a_trim_that_gains_nothing_by_length_keeps_the_shortest_proposal():
    hybrid, costs = HybridDrafter(None), CostModel()
    proposal = Proposal([1, 2, 3, 4], None, label="span")
    hybrid.label_estimate("span").update(4, 2)
    gains = hybrid.acceptance_by_label["span"].expected_tokens(4)
    costs.verify = {1: {t + 1: gains[t] for t in range(5)}}  # every length commits as many tokens per second
    assert hybrid.trim(proposal, 1, costs).token_ids == [1]
