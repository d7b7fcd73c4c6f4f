"""Speculative sampling under a grammar is exact: with p and q both masked by the tokens the grammar allows after
each prefix (and renormalised), one round's output has exactly the masked target's law.

The exact enumeration of `test_rejection.py` does the counting (toy vocabulary of 3, K = 2 drafts); here the toy
models are masked first, through `processed_probs(..., allowed=)` as the engine masks logits. The masks are
functions of the prefix: hand-written ones that force a token or forbid the draft's favourite, then the masks of a
real compiled grammar on the tiny tokenizer, restricted to three of its tokens.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from specdec_core.grammar.constraint import Constraint
from specdec_core.grammar.state import GrammarState
from specdec_core.rejection import rejection_sample
from specdec_core.sampling import processed_probs
from tests.specdec_core.test_rejection import (
    V,
    _deterministic_drafter,
    _model_drafter,
    _Proposal,
    _round_distributions,
    _target_law,
    _total_variation,
    _toy_model,
)

Table = dict[tuple[int, ...], torch.Tensor]  # prefix -> [V] distribution


def _masked(model: Table, allowed, temperature: float = 1.0, top_k: int = 0) -> Table:
    """The model's law under the grammar: its logits masked by `allowed(prefix)`, then shaped, renormalised."""
    out = {}
    for prefix, probs in model.items():
        mask = torch.zeros(1, V, dtype=torch.bool)  # [1, V]
        mask[0, sorted(allowed(prefix))] = True
        out[prefix] = processed_probs(
            probs.log().unsqueeze(0),
            torch.tensor([temperature], dtype=torch.float64),
            torch.tensor([top_k]),
            torch.tensor([1.0], dtype=torch.float64),
            mask,
        )[0]
    return out


def _forcing(prefix: tuple[int, ...]) -> set[int]:
    """One allowed token after the first (which one depends on it), two after the second, all at the start."""
    if len(prefix) == 1:
        return {(prefix[0] + 1) % V}
    if len(prefix) == 2:
        return {prefix[1], (prefix[1] + 2) % V}
    return set(range(V))


def _forbidding(q_model: Table):
    """Everything but the draft's favourite token after each prefix."""
    return lambda prefix: set(range(V)) - {int(q_model[prefix].argmax())}


# Odd seeds: the toy models give every token some probability, so no allowed set has only zero-probability tokens
# (a real model's logits are finite: the masked law always exists).
SEEDS = [1, 3, 5]
SHAPING = [(1.0, 0), (0.7, 2)]  # (temperature, top_k), applied after the mask


def _laws(seed: int, mask_kind: str, temperature: float, top_k: int):
    p_raw, q_raw = _toy_model(seed, 1.5), _toy_model(seed + 100, 1.5)
    allowed = _forcing if mask_kind == "forcing" else _forbidding(q_raw)
    p, q = (_masked(model, allowed, temperature, top_k) for model in (p_raw, q_raw))
    return p_raw, q_raw, allowed, p, q


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mask_kind", ["forcing", "forbidding"])
@pytest.mark.parametrize("temperature,top_k", SHAPING)
def test_masked_speculation_is_exactly_the_masked_target(seed, mask_kind, temperature, top_k):
    """A draft model sampling from masked q, and a deterministic drafter following masked q's greedy path."""
    *_, p, q = _laws(seed, mask_kind, temperature, top_k)
    target = _target_law(p)
    for drafter in (_model_drafter(q), _deterministic_drafter(q)):
        (law,) = _round_distributions(rejection_sample, p, [drafter])
        assert _total_variation(law, target) < 1e-12


def test_forced_positions_are_free_drafts():
    """Where one token is allowed, masked p and q both put all their mass on it: its draft is always accepted."""
    *_, p, q = _laws(1, "forcing", 1.0, 0)
    for prefix in itertools.product(range(V), repeat=1):
        (token,) = _forcing(prefix)
        assert p[prefix][token].item() == q[prefix][token].item() == 1.0


def _cut_where_grammar_ends(proposals: list[_Proposal], allowed) -> list[_Proposal]:
    """What `draft_masks` does to a proposal: keep the drafts up to the first one the grammar refuses."""
    out = []
    for proposal in proposals:
        n = 0
        while n < len(proposal.drafts) and proposal.drafts[n] in allowed(proposal.drafts[:n]):
            n += 1
        out.append(_Proposal(proposal.drafts[:n], proposal.prob, proposal.q[:n], proposal.point_mass))
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_enumeration_catches_an_unmasked_draft_cut_at_the_grammar(seed):
    """The check has the power to fail: drafts sampled from the *unmasked* q, cut where they leave the grammar,
    turn the cut position into a bonus sampled from p where the residual norm(max(0, p - q)) was due."""
    _, q_raw, allowed, p, _ = _laws(seed, "forbidding", 1.0, 0)
    (law,) = _round_distributions(rejection_sample, p, [_cut_where_grammar_ends(_model_drafter(q_raw), allowed)])
    assert _total_variation(law, _target_law(p)) > 1e-3


def test_the_cut_is_harmless_at_a_forced_position():
    """Where the grammar forces a token, masked p is a point mass and so is the residual: the same cut is exact
    (the forcing mask's only cuts are at its forced position), which is why the bias needs two allowed tokens."""
    _, q_raw, allowed, p, _ = _laws(1, "forcing", 1.0, 0)
    (law,) = _round_distributions(rejection_sample, p, [_cut_where_grammar_ends(_model_drafter(q_raw), allowed)])
    assert _total_variation(law, _target_law(p)) < 1e-12


def test_unmasked_q_left_uncut_is_still_exact():
    """Why the cut is the bug, not the unmasked q: verified with the q it was drawn from, a draft outside the grammar
    is rejected (p = 0 there) and the residual recovers the right token. Exact, only slower."""
    _, q_raw, _, p, _ = _laws(3, "forbidding", 1.0, 0)
    (law,) = _round_distributions(rejection_sample, p, [_model_drafter(q_raw)])
    assert _total_variation(law, _target_law(p)) < 1e-12


def test_cutting_a_point_mass_proposal_is_exact():
    """A deterministic drafter's proposal cut at the grammar is exact: a point mass's residual on a token p gives
    nothing to is p itself, which is what the bonus position samples."""
    _, q_raw, allowed, p, _ = _laws(5, "forbidding", 1.0, 0)
    cut = _cut_where_grammar_ends(_deterministic_drafter(q_raw), allowed)
    (law,) = _round_distributions(rejection_sample, p, [cut])
    assert _total_variation(law, _target_law(p)) < 1e-12


# -- a real grammar ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grammar_allowed(compiler, tokenizer):
    """The masks of the regex `a[ab]b?` restricted to the tokens a, b and eos (indices 0, 1, 2 of the toy vocabulary):
    `a` forced first, then a or b, then b or the end, and after a complete match only the end."""
    ids = tokenizer.convert_tokens_to_ids(["a", "b"]) + [compiler.eos_token_ids[0]]
    grammar = compiler.compile(Constraint("regex", "a[ab]b?"))

    def allowed(prefix: tuple[int, ...]) -> set[int]:
        state = GrammarState(grammar)
        if state.advance([ids[i] for i in prefix]) < len(prefix):
            return set(range(V))  # a prefix outside the grammar has probability 0: any law will do
        mask = state.allowed_mask()  # [V_model]
        return {i for i, token in enumerate(ids) if mask[token]}

    return allowed


def test_real_grammar_masks_force_and_end(grammar_allowed):
    assert grammar_allowed(()) == {0}
    assert grammar_allowed((0,)) == {0, 1}
    assert grammar_allowed((0, 0)) == grammar_allowed((0, 1)) == {1, 2}
    assert grammar_allowed((0, 1, 1)) == grammar_allowed((0, 0, 2)) == {2}  # complete / terminated: only eos


@pytest.mark.parametrize("seed", [1, 3])
def test_real_grammar_speculation_is_exact(grammar_allowed, seed):
    p = _masked(_toy_model(seed, 1.5), grammar_allowed)
    q = _masked(_toy_model(seed + 100, 1.5), grammar_allowed)
    for drafter in (_model_drafter(q), _deterministic_drafter(q)):
        (law,) = _round_distributions(rejection_sample, p, [drafter])
        assert _total_variation(law, _target_law(p)) < 1e-12
