"""GrammarState: masks against brute force, advance/rollback round trips, forced tokens, the end of the output."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec_core.config import SamplingParams
from specdec_core.errors import GrammarError
from specdec_core.grammar.compiler import CompiledGrammar, GrammarCompiler
from specdec_core.grammar.constraint import Constraint
from specdec_core.grammar.masks import draft_masks
from specdec_core.grammar.state import GrammarState
from specdec_core.stopping import FinishReason
from tests.helpers import make_engine, run_to_completion

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "values"],
    "properties": {
        "name": {"enum": ["return", "import", "values"]},
        "values": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
}

# (constraint, a complete document): prefixes of the document's tokens are the states the tests visit.
CASES = {
    "json_schema": (Constraint("json_schema", json.dumps(SCHEMA)), '{"name": "values", "values": [10, 2]}'),
    "json_object": (Constraint("json_object"), '{"a": [1, {"b": null}], "c": "def"}'),
    "regex": (Constraint("regex", r"(def|for) [a-z]+\(\)"), "def count()"),
    "lark": (Constraint("grammar", 'start: "(" item ("," item)* ")"\nitem: /[0-9]+/ | start\n'), "(1,(20,3),4)"),
    "gbnf": (Constraint("grammar", 'root ::= "print(" [a-z]+ ")"'), "print(self)"),
}


def _state(compiler, tokenizer, case: str) -> tuple[GrammarState, list[int]]:
    constraint, document = CASES[case]
    return GrammarState(compiler.compile(constraint)), tokenizer.encode(document, add_special_tokens=False)


def _brute_force_mask(state: GrammarState) -> torch.Tensor:  # [V] bool
    """Token t is allowed iff advancing by it succeeds (rolled back after each try)."""
    allowed = torch.zeros(state.grammar.vocab_size, dtype=torch.bool)
    for token in range(state.grammar.vocab_size):
        if state.advance([token]):
            allowed[token] = True
            state.rollback(1)
    return allowed


def _library_consumes(state: GrammarState) -> torch.Tensor:  # [V] bool
    """What llguidance's own consume takes from here (eos aside): a superset of its mask, see `advance`."""
    taken = torch.zeros(state.grammar.vocab_size, dtype=torch.bool)
    for token in range(state.grammar.tokenizer_vocab_size):
        taken[token] = state._matcher.deep_copy().try_consume_tokens([token]) == 1
    return taken


@pytest.mark.parametrize("case", CASES)
def test_masks_equal_brute_force(compiler, tokenizer, case):
    """At every prefix of the document and at the complete document (where eos is allowed). After an eos nothing
    advances, yet the mask allows eos: see test_the_document_ends_the_output."""
    state, document = _state(compiler, tokenizer, case)
    not_eos = torch.ones(compiler.vocab_size, dtype=torch.bool)
    not_eos[list(compiler.eos_token_ids)] = False
    for i in range(len(document) + 1):
        mask = state.allowed_mask()  # [V]
        assert torch.equal(mask, _brute_force_mask(state)), f"prefix of {i} tokens"
        assert not (mask & not_eos & ~_library_consumes(state)).any(), "the mask allows what the library refuses"
        assert not mask[state.grammar.tokenizer_vocab_size :].any(), "ids past the tokenizer: the model's padding"
        assert state.num_tokens == i
        state.advance(document[i : i + 1])
    assert mask[list(compiler.eos_token_ids)].all()


@pytest.mark.parametrize("case", CASES)
def test_the_document_ends_the_output(compiler, tokenizer, case):
    state, document = _state(compiler, tokenizer, case)
    eos = compiler.eos_token_ids
    assert not state.can_end() and state.advance([eos[0]]) == 0  # eos is refused before the grammar can end
    assert state.advance(document + [eos[0], document[0]]) == len(document) + 1  # nothing after the eos
    assert state.is_terminated() and state.can_end()
    assert state.allowed_mask().nonzero().flatten().tolist() == sorted(eos)  # only eos, whatever comes
    assert state.advance([document[0]]) == 0 and state.advance([eos[1]]) == 0
    state.rollback(1)
    assert not state.is_terminated() and state.can_end()
    assert set(eos) <= set(state.allowed_mask().nonzero().flatten().tolist())


def test_must_end_when_only_eos_remains(compiler, tokenizer):
    state, document = _state(compiler, tokenizer, "json_schema")
    state.advance(document[:-1])
    assert not state.must_end()
    state.advance(document[-1:])
    assert state.must_end() and state.forced() == []  # two stop tokens allowed: ending is forced, not a token


def test_out_of_vocabulary_ids_are_refused(compiler, tokenizer):
    state, document = _state(compiler, tokenizer, "json_object")
    assert state.advance([compiler.vocab_size - 1]) == 0 and state.advance([-1]) == 0
    assert state.advance(document[:2] + [390] + document[2:]) == 2
    with pytest.raises(ValueError):
        state.rollback(3)


def test_forced_tokens(compiler, tokenizer):
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("{", "}", "x", "y")}
    state = GrammarState(compiler.compile(Constraint("regex", r"\{xy\}")))
    assert state.forced() == [ids["{"], ids["x"], ids["y"], ids["}"]]  # no merge of these bytes: one token each
    assert state.num_tokens == 0  # forced() looks ahead and comes back
    assert state.forced(limit=2) == [ids["{"], ids["x"]]
    state.advance([ids["{"]])
    assert state.forced() == [ids["x"], ids["y"], ids["}"]]


@pytest.mark.parametrize("case", CASES)
def test_forced_is_the_chain_of_single_allowed_tokens(compiler, tokenizer, case):
    state, document = _state(compiler, tokenizer, case)
    for i in range(len(document)):
        chain, probe = [], GrammarState(state.grammar)
        probe.advance(document[:i])
        while len(chain) < 32 and not probe.is_terminated():
            allowed = probe.allowed_mask().nonzero().flatten().tolist()
            if len(allowed) != 1:
                break
            chain.append(allowed[0])
            probe.advance(allowed)
        assert state.forced() == chain
        state.advance(document[i : i + 1])


# -- round trips ---------------------------------------------------------------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(["valid", "random", "rollback"]), st.integers(0, 2**20)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(sorted(CASES)), ops=OPS)
def test_advance_and_rollback_round_trip(compiler, tokenizer, case, ops):
    """Random walks of valid tokens, random tokens (mostly refused) and rollbacks: after every step the state
    answers as a fresh state advanced through the same tokens does, and advance took exactly the allowed token."""
    state, _ = _state(compiler, tokenizer, case)
    tokens: list[int] = []
    for op, seed in ops:
        mask = state.allowed_mask()  # [V]
        if op == "rollback":
            n = seed % (len(tokens) + 1)
            state.rollback(n)
            del tokens[len(tokens) - n :]
        else:
            allowed = mask.nonzero().flatten().tolist()
            token = allowed[seed % len(allowed)] if op == "valid" else seed % compiler.vocab_size
            ended = state.is_terminated()  # its mask offers eos for renormalising, but nothing advances
            taken = state.advance([token])
            assert taken == (0 if ended else int(mask[token])) and (op == "random" or ended or taken == 1)
            tokens += [token] * taken
        fresh = GrammarState(state.grammar)
        assert fresh.advance(tokens) == len(tokens) == state.num_tokens
        assert torch.equal(state.allowed_mask(), fresh.allowed_mask())
        assert (state.can_end(), state.is_terminated()) == (fresh.can_end(), fresh.is_terminated())


class _Counting:
    """The llguidance matcher with its mask computations counted."""

    def __init__(self, matcher) -> None:
        self.matcher, self.masks = matcher, 0

    def unsafe_compute_mask_ptr(self, *args):
        self.masks += 1
        return self.matcher.unsafe_compute_mask_ptr(*args)

    def __getattr__(self, name):
        return getattr(self.matcher, name)


def test_each_position_mask_is_computed_once(compiler, tokenizer):
    """The drafting side, the verifying side and the commit all read one mask per position."""
    state, document = _state(compiler, tokenizer, "json_object")  # '{"a": ...': any key after '{"'
    state._matcher = counting = _Counting(state._matcher)
    first = draft_masks(state, document[:4])  # drafting: positions 0..4
    assert counting.masks == 5 and first.num_valid == 4
    again = draft_masks(state, document[:4])  # verifying the same drafts
    assert counting.masks == 5 and torch.equal(first.allowed, again.allowed)
    state.advance(document[:2])  # commit two drafts, then a recovered token that differs from the third draft
    other = next(t for t in state.allowed_mask().nonzero().flatten().tolist() if t != document[2])
    state.advance([other])
    assert counting.masks == 5
    state.allowed_mask()  # a new position: computed
    assert counting.masks == 6


def _errored(compiler, tokenizer) -> CompiledGrammar:
    """The regex `ab+` compiled, its pristine matcher fed a token the grammar refuses: llguidance's error state, in
    which its own mask allows the eos tokens alone."""
    compiled = compiler.compile(Constraint("regex", "ab+"))
    matcher = compiled.matcher.deep_copy()
    assert not matcher.consume_token(tokenizer.convert_tokens_to_ids("z")) and matcher.is_error()
    return dataclasses.replace(compiled, matcher=matcher)


def test_a_grammar_engine_error_is_raised_naming_the_constraint_not_masked_to_eos(compiler, tokenizer):
    state = GrammarState(_errored(compiler, tokenizer))
    for read in (state.allowed_words, state.allowed_mask, state.must_end, state.can_end, state.forced):
        with pytest.raises(GrammarError, match=r"^regex constraint: .*doesn't satisfy the grammar") as caught:
            read()
        assert caught.value.kind == "regex" and len(str(caught.value)) < 600  # not the matcher's whole dump


def test_a_grammar_engine_error_after_some_tokens_is_raised(compiler, tokenizer):
    state = GrammarState(compiler.compile(Constraint("regex", "ab+")))
    assert state.advance(tokenizer.encode("ab", add_special_tokens=False)) == 2
    state._matcher.consume_token(tokenizer.convert_tokens_to_ids("z"))  # the engine's bug: a token it never allowed
    with pytest.raises(GrammarError, match="after 2 tokens"):
        state.allowed_words()


def test_a_grammar_engine_error_ends_that_request_with_an_error_not_a_stop(tiny_target):
    """Through the engine, whose stop tokens the grammar ends on: the request's output reports FinishReason.ERROR and
    the grammar's error, where an eos-only mask would have ended it as a normal stop."""
    engine = make_engine(tiny_target)
    target_compiler = GrammarCompiler(tiny_target.tokenizer, engine.target.vocab_size, sorted(engine.eos_token_ids))
    broken = _errored(target_compiler, tiny_target.tokenizer)
    engine.compile = lambda constraint: broken  # the engine's compiler hands the request a matcher in error
    params = SamplingParams(max_tokens=8, constraint=broken.constraint)
    results = run_to_completion(engine, [("broken", [5, 6, 7], params, 0)])
    tokens, _, last = results["broken"]
    assert last.finish_reason == FinishReason.ERROR and isinstance(last.error, GrammarError)
    assert tokens == []  # no eos was committed as if the output were complete
    assert engine.target.free_slots == engine.target.runner.cache.num_slots
