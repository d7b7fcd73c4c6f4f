"""Unpacking bitmasks (`bits.py`), and a round's masks (`draft_masks`)."""

from __future__ import annotations

import json

import numpy as np
import torch

from specdec_core.grammar.bits import has, only_token, popcount, set_bit, unpack_bitmask
from specdec_core.grammar.constraint import Constraint
from specdec_core.grammar.masks import draft_masks
from specdec_core.grammar.state import GrammarState


def test_bits_match_bit_arithmetic():
    words = np.random.default_rng(0).integers(0, 2**32, (2, 5), dtype=np.uint32)  # [2, W]
    words[0, 1] = 2**32 - 1  # every bit, the top one too
    for n in (200, 160, 150, 33):  # past 32 * W: zeros (the model's padding ids)
        got = unpack_bitmask(words, n)  # [2, n]
        want = torch.tensor(
            [[t < 160 and (int(words[r, t // 32]) >> (t % 32)) & 1 for t in range(n)] for r in range(2)]
        ).bool()
        assert got.dtype == torch.bool and torch.equal(got, want)
    row = words[0].copy()
    assert popcount(row) == int(unpack_bitmask(row, 160).sum())
    for token in (0, 31, 63, 159):
        set_bit(row, token, False)
        assert not has(row, token)
        set_bit(row, token, True)
        assert has(row, token)
    one = np.zeros(5, dtype=np.uint32)
    set_bit(one, 127, True)
    assert popcount(one) == 1 and only_token(one) == 127


def _state_and_document(compiler, tokenizer):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
        "required": ["a"],
        "additionalProperties": False,
    }
    state = GrammarState(compiler.compile(Constraint("json_schema", json.dumps(schema))))
    return state, tokenizer.encode('{"a": [1, 22]}', add_special_tokens=False)


def test_draft_masks_are_the_masks_along_the_drafts(compiler, tokenizer):
    state, document = _state_and_document(compiler, tokenizer)
    state.advance(document[:2])
    before = state.allowed_mask()
    drafts = document[2:6]
    got = draft_masks(state, drafts)
    assert got.num_valid == 4 and got.allowed.shape == (5, compiler.vocab_size)
    assert state.num_tokens == 2 and torch.equal(state.allowed_mask(), before)  # left where it was
    walker = GrammarState(state.grammar)
    walker.advance(document[:2])
    for i in range(5):
        assert torch.equal(got.allowed[i], walker.allowed_mask())
        walker.advance(drafts[i : i + 1])


def test_draft_masks_cut_the_proposal_where_it_leaves_the_grammar(compiler, tokenizer):
    state, document = _state_and_document(compiler, tokenizer)
    letter = tokenizer.convert_tokens_to_ids("x")  # never allowed after '{"a": ['
    at = document.index(tokenizer.convert_tokens_to_ids("[")) + 1
    got = draft_masks(state, document[:at] + [letter] + document[at:])
    assert got.num_valid == at and got.allowed.shape == (at + 1, compiler.vocab_size)
    assert not got.allowed[at, letter]
    assert state.num_tokens == 0


def test_draft_masks_stop_after_eos(compiler, tokenizer):
    state, document = _state_and_document(compiler, tokenizer)
    eos = compiler.eos_token_ids[0]
    got = draft_masks(state, document + [eos, document[0]])
    assert got.num_valid == len(document) + 1
    assert got.allowed[-1].nonzero().flatten().tolist() == sorted(compiler.eos_token_ids)  # after the end: only eos
    assert state.num_tokens == 0 and not state.is_terminated()
