"""Constrained generation through the engine on tiny models: greedy speculation equals greedy plain decoding under
each constraint, for every drafting method; outputs belong to their language; the grammar's state follows the
committed output across rejected rounds; forced tokens cost no draft call; bad constraints fail before any work.
(The law at temperature > 0: test_statistical_grammar.py.)"""

from __future__ import annotations

import json
import re

import pytest

from specdec_core.config import SamplingParams
from specdec_core.drafters.base import Proposal
from specdec_core.errors import InvalidArgument
from specdec_core.grammar.constraint import Constraint
from specdec_core.grammar.state import GrammarState
from specdec_core.request import Request
from specdec_core.stopping import FinishReason
from specdec_core.structured import FORCED
from tests.helpers import contrarian, make_engine, one_torch_thread, perturbed, run_to_completion

PROMPTS = ["def add(a, b):", "The quick brown fox", "class Counter:", "x = 1\ny = 2\n"]
UNCONSTRAINED = "for index, value in enumerate(range(10)):\n    print("

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "size", "tags", "pos"],
    "properties": {
        "name": {"enum": ["add", "mean", "count"]},
        "size": {"type": "number", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "pos": {
            "type": "object",
            "additionalProperties": False,
            "required": ["x"],
            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "ok": {"type": "boolean"}},
        },
        "note": {"type": "string", "maxLength": 6},  # optional
    },
    # Compact JSON: by default any whitespace may come between tokens, where a random tiny model loops forever.
    "x-guidance": {"whitespace_flexible": False},
}
REGEX = r"(def|for) [a-z]{1,6}\((x|y)?\)"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def _schema_valid(text: str) -> bool:
    value = json.loads(text)
    keys = {"name", "size", "tags", "pos", "note"}
    return (
        set(value) <= keys
        and {"name", "size", "tags", "pos"} <= set(value)
        and value["name"] in ("add", "mean", "count")
        and 0 <= value["size"] <= 99
        and all(tag in ("a", "b") for tag in value["tags"])
        and len(value["tags"]) <= 3
        and set(value["pos"]) <= {"x", "ok"}
        and -9 <= value["pos"]["x"] <= 9
    )


CONSTRAINTS = {  # kind -> (constraint, is a complete output valid)
    "json_schema": (Constraint("json_schema", json.dumps(SCHEMA)), _schema_valid),
    "regex": (Constraint("regex", REGEX), lambda text: re.fullmatch(REGEX, text) is not None),
    "json_object": (Constraint("json_object"), lambda text: isinstance(json.loads(text), dict)),
}
# method -> (make_engine's draft and hybrid, k): hybrid lets `auto` weigh suffix proposals against the draft model's.
METHODS = {
    "draft_model": (True, False, 3),
    "ngram": ("ngram", False, 3),
    "suffix": ("suffix", False, 3),
    "hybrid": (True, True, "auto"),
}


def _ids(loaded, text):
    return loaded.tokenizer(text)["input_ids"]


def _requests(loaded, constraint, k, tag=""):
    constrained = SamplingParams(max_tokens=80, constraint=constraint)
    requests = [(f"{tag}{i}", _ids(loaded, text), constrained, k) for i, text in enumerate(PROMPTS)]
    return requests + [(f"{tag}free", _ids(loaded, UNCONSTRAINED), SamplingParams(max_tokens=24), k)]


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_greedy_constrained_speculation_equals_constrained_plain_decoding(pair, kind):
    """One batch of constrained requests beside an unconstrained one, for every method; the suffix structure and
    hybrid run the batch twice, so that the second pass gets proposals from the first's outputs."""
    target, draft = pair
    constraint, valid = CONSTRAINTS[kind]
    expected = run_to_completion(make_engine(target), _requests(target, constraint, 0))
    for request_id, (_tokens, text, last) in expected.items():
        if request_id != "free" and last.finish_reason != FinishReason.LENGTH:
            assert last.finish_reason == FinishReason.EOS and valid(text), (request_id, text)
    if kind != "json_object":  # a random model writes any object's strings on and on: it never closes one
        assert any(last.finish_reason == FinishReason.EOS for _, _, last in expected.values())
    for method, (drafter, hybrid, k) in METHODS.items():
        engine = make_engine(target, draft.model if drafter is True else drafter, hybrid=hybrid)
        for tag in ("", "again-"):
            got = run_to_completion(engine, _requests(target, constraint, k, tag))
            proposed = sum(last.stats.proposed for _, _, last in got.values())
            assert proposed > 0, method
            for request_id, (tokens, _text, last) in expected.items():
                assert got[tag + request_id][0] == tokens, (method, tag + request_id)
                assert got[tag + request_id][2].finish_reason == last.finish_reason


def _run_checking_grammar(engine, requests):
    """`run_to_completion`, checking after every step that each running sequence's grammar has taken exactly its
    committed output (never a draft) and the round's masks were rolled back."""
    for request_id, prompt, params, k in requests:
        engine.add_request(Request(request_id, tuple(prompt), params, k))
    outputs, rounds = {r[0]: [] for r in requests}, 0
    while engine.has_work:
        for out in engine.step():
            outputs[out.seq_id] += out.new_token_ids
            rounds += out.round is not None and out.round.num_accepted < len(out.round.proposed_token_ids)
        for seq in engine._running.values():
            assert seq.grammar.num_tokens == len(seq.tokens) - seq.num_prompt
    return outputs, rounds


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_grammar_follows_the_committed_output_across_rejected_rounds(tiny_target, temperature):
    """A contrarian draft (greedy: its argmax is the target's argmin) is wrong nearly every round; at T = 1 a
    strongly perturbed one. Each output, replayed through a fresh state, is taken whole: it is in the grammar."""
    draft = contrarian(tiny_target.model) if temperature == 0 else perturbed(tiny_target.model, 1.0, seed=5)
    constraint = CONSTRAINTS["json_schema"][0]
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=60, constraint=constraint)
    requests = [(str(i), _ids(tiny_target, text), params, 4) for i, text in enumerate(PROMPTS)]
    outputs, rejected_rounds = _run_checking_grammar(make_engine(tiny_target, draft), requests)
    assert rejected_rounds >= 10
    grammar = make_engine(tiny_target).compile(constraint)
    for tokens in outputs.values():
        assert GrammarState(grammar).advance(tokens) == len(tokens)


class _CountingDrafter:
    """Wraps a drafter and counts its calls."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.proposals = inner, inner.name, 0

    def start(self, seq_id, prompt_ids, cache_salt=None):
        return self.inner.start(seq_id, prompt_ids, cache_salt)

    def cached(self, seq_id, token_ids, cache_salt=None):
        return self.inner.cached(seq_id, token_ids, cache_salt)

    def propose(self, requests):
        self.proposals += len(requests)
        return self.inner.propose(requests)

    def observe(self, seq_id, num_committed):
        self.inner.observe(seq_id, num_committed)

    def release(self, seq_id):
        self.inner.release(seq_id)


class _CountingTarget:
    def __init__(self, inner) -> None:
        self.inner, self.verified = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def verify(self, items):
        self.verified += [list(item.draft_token_ids) for item in items]
        return self.inner.verify(items)


def _counted(loaded, draft):
    """An engine whose drafter (`draft`: a Transformer, or a drafter object) and target count their calls."""
    engine = make_engine(loaded, draft if not hasattr(draft, "propose") else None)
    engine.drafter = _CountingDrafter(draft if hasattr(draft, "propose") else engine.drafter)
    engine.target = _CountingTarget(engine.target)
    return engine


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_tokens_are_verified_without_a_draft_call(pair, temperature):
    """After the first character (the prefill's sample) every token is forced up to the last choice: rounds verify
    forced tokens (k of them, then the bonus position samples the choice), and the forced eos is committed with
    no forward pass. The draft model is never asked."""
    target, draft = pair
    tokenizer = target.tokenizer
    constraint = Constraint("regex", r"[ab] the quick brown fox=[xy]")
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=32, constraint=constraint)
    prompt = _ids(target, PROMPTS[0])
    ((expected, _, _),) = run_to_completion(make_engine(target), [("r", prompt, params, 0)]).values()
    engine = _counted(target, draft.model)
    engine.add_request(Request("r", tuple(prompt), params, 3))
    tokens, rounds = [], []
    while engine.has_work:
        for out in engine.step():
            tokens += out.new_token_ids
            rounds += [out.round] if out.round is not None else []
    assert tokens == expected and re.fullmatch(r"[ab] the quick brown fox=[xy]", tokenizer.decode(tokens[:-1]))
    assert engine.drafter.proposals == 0
    assert all(r.method == FORCED and r.num_accepted == len(r.proposed_token_ids) for r in rounds)
    assert len(engine.target.verified) == len(rounds) - 1  # the last round: the forced eos, no forward pass
    assert all(0 < len(drafts) <= 3 for drafts in engine.target.verified)
    assert rounds[-1].proposed_token_ids == (tokens[-1],) and tokens[-1] in target.eos_token_ids


def test_plain_decoding_stays_token_by_token(pair):
    """k = 0 asks for no speculation: forced tokens are decoded one per round like any other."""
    target, draft = pair
    params = SamplingParams(max_tokens=32, constraint=Constraint("regex", r"[ab] the quick brown fox"))
    engine = _counted(target, draft.model)
    ((tokens, _, last),) = run_to_completion(engine, [("r", _ids(target, PROMPTS[0]), params, 0)]).values()
    assert last.finish_reason == FinishReason.EOS
    assert all(drafts == [] for drafts in engine.target.verified) and len(engine.target.verified) == len(tokens) - 1


class _FixedDrafter:
    """Proposes the same point-mass tokens every round: a deterministic drafter that ignores the grammar."""

    name = "fixed"

    def __init__(self, tokens) -> None:
        self.tokens = tokens

    def start(self, seq_id, prompt_ids, cache_salt=None):
        return 0

    def cached(self, seq_id, token_ids, cache_salt=None):
        return 0

    def propose(self, requests):
        return [Proposal(self.tokens[: r.num_tokens], None) for r in requests]

    def observe(self, seq_id, num_committed):
        pass

    def release(self, seq_id):
        pass


def test_point_mass_proposals_are_cut_where_they_leave_the_grammar(tiny_target):
    """ "ab!" proposed after "a" under `a[ab]+`: "a" and "b" are verified, "!" never reaches the target."""
    a, b, bang = tiny_target.tokenizer.convert_tokens_to_ids(["a", "b", "!"])
    params = SamplingParams(max_tokens=6, constraint=Constraint("regex", "a[ab]+"))
    ((expected, _, _),) = run_to_completion(make_engine(tiny_target), [("r", [a], params, 0)]).values()
    engine = _counted(tiny_target, _FixedDrafter([a, b, bang]))
    engine.add_request(Request("r", (a,), params, 3))
    tokens = []
    while engine.has_work:
        for out in engine.step():
            tokens += out.new_token_ids
    assert tokens == expected
    assert engine.target.verified and all(bang not in drafts for drafts in engine.target.verified)
    assert [a, b] in engine.target.verified


def test_a_grammar_ends_the_output_and_max_tokens_cuts_it(tiny_target):
    prompt = _ids(tiny_target, PROMPTS[0])
    done = SamplingParams(max_tokens=16, constraint=Constraint("regex", "ab"))
    cut = SamplingParams(max_tokens=5, constraint=CONSTRAINTS["json_schema"][0])
    got = run_to_completion(make_engine(tiny_target, "ngram"), [("done", prompt, done, 3), ("cut", prompt, cut, 3)])
    tokens, text, last = got["done"]
    assert (text, last.finish_reason) == ("ab", FinishReason.EOS) and tokens[-1] in tiny_target.eos_token_ids
    tokens, text, last = got["cut"]
    assert last.finish_reason == FinishReason.LENGTH and len(tokens) == 5 and text.startswith('{"')


@pytest.mark.parametrize(
    "constraint,field",
    [
        (Constraint("regex", "(unclosed"), "regex"),
        (Constraint("json_schema", "{not json"), "json_schema"),
        (Constraint("json_schema", json.dumps({"type": "object", "not": {"required": ["a"]}})), "json_schema"),
        (Constraint("grammar", "start: missing_rule"), "grammar"),
    ],
)
def test_a_bad_constraint_fails_before_any_work(tiny_target, constraint, field):
    engine = make_engine(tiny_target, "ngram")
    with pytest.raises(InvalidArgument) as caught:
        engine.add_request(Request("r", tuple(_ids(tiny_target, PROMPTS[0])), SamplingParams(constraint=constraint)))
    assert caught.value.field == field
    assert not engine.has_work


def test_ignore_eos_with_a_constraint_is_refused():
    with pytest.raises(InvalidArgument) as caught:
        SamplingParams(ignore_eos=True, constraint=Constraint("json_object"))
    assert caught.value.field == "ignore_eos"
