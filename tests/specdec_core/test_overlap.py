"""Pre-drafting during verify (`overlap.py`): the branch bookkeeping against every outcome of a round, `auto`'s
choice, and the engine with it on: greedy output identical to plain decoding while branches are used, the draft's
cache after a miss equal to a fresh draft's."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from specdec_core.adaptive import CostModel
from specdec_core.config import SamplingParams, TokenShaping
from specdec_core.drafters.base import Alternative, DraftRequest, Proposal
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.overlap import (
    BLOCK_ROUNDS,
    EXPLORE_EVERY,
    WARMUP_ROUNDS,
    WEIGHED_ROUNDS,
    Overlap,
    branches_of,
    hit,
    predraft_request,
    split_pays,
)
from specdec_core.request import Request
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.sparse_q import SparseQ
from tests.helpers import make_engine, perturbed, run_to_completion

VOCAB = range(3)

# -- the branch and every outcome of a round ------------------------------------------------------------------------


def _outcomes(proposal: list[int]):
    """Every outcome of verifying `proposal`: j drafts accepted, then the target's token t (a replacement where
    j < k, which differs from the draft it replaces; the bonus where j = k)."""
    for j in range(len(proposal) + 1):
        for t in VOCAB:
            if j < len(proposal) and t == proposal[j]:
                continue  # a rejected draft is never its own replacement
            yield j, proposal[:j] + [t]


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_a_branch_is_used_exactly_when_the_round_commits_the_context_it_assumed(k):
    """Brute force: for every committed prefix, proposal, guess, rejection branches and outcome, `hit` gives a
    branch if and only if the committed tokens are its context: the prefix, every draft and the guess for the
    main branch; the prefix, the drafts before the rejected one and the guessed replacement for the others."""
    committed = [7, 8]
    q = SparseQ(torch.arange(9).view(3, 3), torch.full((3, 3), 1 / 3))
    for proposal, guess in itertools.product(itertools.product(VOCAB, repeat=k), VOCAB):
        # A branch for a rejection at each position, guessing the token after the draft there.
        alternatives = tuple(
            Alternative(j, (proposal[j] + 1) % len(VOCAB), Proposal([20 + j, 30 + j], None)) for j in range(k)
        )
        drafted = Proposal([guess, 5, 6], q, (0.9, 0.8, 0.7), alternatives=alternatives)
        branches = branches_of(drafted, len(committed), k)
        assert len(branches) == 1 + k
        for j, tokens in _outcomes(list(proposal)):
            after = committed + tokens
            used = hit(branches, after)  # every outcome: no other may be taken for a hit
            contexts = {0: committed + list(proposal) + [guess]}  # 0: the main branch
            contexts.update(
                {a.position + 1: committed + list(proposal[: a.position]) + [a.token] for a in alternatives}
            )
            matching = [key for key, context in contexts.items() if context == after]
            assert (used is not None) == bool(matching)
            if used is None:
                continue
            if matching == [0]:
                assert j == k  # the main branch: only a round that accepted every draft
                assert used.proposal.token_ids == [5, 6] and used.proposal.draft_probs == (0.8, 0.7)
                assert used.proposal.q.token_ids.tolist() == [[3, 4, 5], [6, 7, 8]]  # q of the drafts after the guess
            else:
                assert matching == [j + 1] and j < k  # a rejection branch: only the outcome it was drafted for
                assert used.proposal.token_ids == [20 + j, 30 + j]


def test_a_pre_draft_of_the_guess_alone_makes_no_branch():
    assert branches_of(Proposal([4], None), 3, 1) == ()


def test_a_pre_draft_request_assumes_the_proposal_after_the_committed_tokens():
    base = DraftRequest("s", [1, 2, 3], 3, TokenShaping(), None)
    request = predraft_request(base, Proposal([9, 8], None), 3)
    assert (request.token_ids, request.num_assumed, request.num_tokens) == ([1, 2, 3, 9, 8], 2, 3)


# -- auto -------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["on", "off"])
def test_on_and_off_are_what_they_say(mode):
    overlap = Overlap(mode)
    for _ in range(3 * EXPLORE_EVERY):
        overlap.observe(True, 1.0, 1)
        assert overlap.choose() is (mode == "on")


@pytest.mark.parametrize("faster", [True, False])
def test_auto_times_both_then_takes_the_faster_and_tries_the_other_ever_more_rarely_while_it_loses(faster):
    overlap = Overlap("auto")
    choices = []
    for _ in range(2 * WARMUP_ROUNDS + 16 * EXPLORE_EVERY):
        choices.append(overlap.choose())
        overlap.observe(choices[-1], (1.0 if choices[-1] is faster else 2.0), 1)  # the faster: 1 s a token
    assert choices[: 2 * WARMUP_ROUNDS] == [False] * WARMUP_ROUNDS + [True] * WARMUP_ROUNDS
    others = [i for i, choice in enumerate(choices) if choice is not faster and i >= 2 * WARMUP_ROUNDS]
    blocks = [others[i : i + BLOCK_ROUNDS] for i in range(0, len(others), BLOCK_ROUNDS)]
    assert len(blocks) >= 3 and all(block == list(range(block[0], block[0] + BLOCK_ROUNDS)) for block in blocks)
    gaps = [b[0] - a[0] for a, b in zip(blocks, blocks[1:])]
    assert all(later >= 2 * earlier - BLOCK_ROUNDS for earlier, later in zip(gaps, gaps[1:]))  # backing off
    assert len(others) < len(choices) / 20


def test_auto_tries_the_other_mode_at_the_first_interval_again_once_it_wins():
    overlap = Overlap("auto")
    for _ in range(2 * WARMUP_ROUNDS + 8 * EXPLORE_EVERY):  # pre-drafting loses a few trials: they grow rare
        mode = overlap.choose()
        overlap.observe(mode, 2.0 if mode else 1.0, 1)
    mode, seen = None, []
    while mode is not True:  # the next trial of pre-drafting finds it faster now
        mode = overlap.choose()
        overlap.observe(mode, 0.5 if mode else 1.0, 1)
    for _ in range(3 * EXPLORE_EVERY):
        seen.append(overlap.choose())
        overlap.observe(seen[-1], 0.5 if seen[-1] else 1.0, 1)
    assert seen.count(True) > 0.8 * len(seen)


def test_auto_follows_a_change_in_which_is_faster():
    overlap = Overlap("auto")
    for _ in range(2 * WARMUP_ROUNDS + 4 * EXPLORE_EVERY):  # pre-drafting pays at first
        mode = overlap.choose()
        overlap.observe(mode, 1.0 if mode else 2.0, 1)
    assert overlap.choose() is True
    for _ in range(6 * EXPLORE_EVERY):  # then it costs (the cores became shared)
        mode = overlap.choose()
        overlap.observe(mode, 3.0 if mode else 2.0, 1)
    assert [overlap.choose() for _ in range(EXPLORE_EVERY - BLOCK_ROUNDS)].count(False) >= EXPLORE_EVERY // 2


def _weighed_rounds(overlap: Overlap, rounds: int, saved: float, extra: float) -> list[bool]:
    """`rounds` rounds of `auto` in which a pre-drafting round's branches save `saved` seconds of drafting the round
    after, and add `extra` to its verify's wait; timed per token, the mode the terms make slower looks twice as
    fast (its rounds happen to commit more tokens), which the weighed terms must override."""
    pays = saved > extra
    choices = []
    for _ in range(rounds):
        overlap.observe_saved(saved)  # this round's drafting, after the last round (ignored unless it pre-drafted)
        mode = overlap.choose()
        choices.append(mode)
        overlap.observe_verify(mode, (1, 5), 0.100 + (extra if mode else 0.0))
        overlap.observe(mode, 0.2, 1 if mode is pays else 2)
    return choices


@pytest.mark.parametrize(("saved", "extra", "expect"), [(0.030, 0.002, True), (0.010, 0.040, False)])
def test_auto_weighs_drafting_saved_against_the_verifys_wait_not_tokens_per_round(saved, extra, expect):
    overlap = Overlap("auto")
    choices = _weighed_rounds(overlap, 2 * WARMUP_ROUNDS + 8 * EXPLORE_EVERY, saved, extra)
    later = choices[2 * WARMUP_ROUNDS + BLOCK_ROUNDS :]
    assert later.count(expect) > 0.9 * len(later)


@pytest.mark.parametrize(("hits", "keep"), [(0.25, True), (0.05, False)])
def test_pre_drafting_stays_unless_it_measurably_costs_more_than_it_saves(hits, keep):
    """A hit saves a 60 ms draft call, a pre-draft adds 16 ms to the verify's wait. At a hit rate of a quarter it
    saves 15 ms on average: less than it costs, but well within what 32 rounds can tell apart, so it stays; at a
    twentieth (3 ms) it measurably costs, and stops."""
    overlap = Overlap("auto")
    overlap.observe_verify(False, (1, 5), 0.100)
    every = round(1 / hits)
    for i in range(WEIGHED_ROUNDS):
        overlap._last = True
        overlap.observe_saved(0.060 if i % every == 0 else 0.0)
        overlap.observe_verify(True, (1, 5), 0.116)
    assert overlap._better() is keep


def test_the_weighed_terms_count_only_what_they_say():
    overlap = Overlap("on")
    overlap.observe_verify(True, (1, 5), 0.3)  # no sequential verify of that shape yet: nothing to weigh
    assert list(overlap._extra) == []
    overlap.observe_verify(False, (1, 5), 0.1)
    overlap.observe_verify(False, (1, 5), 0.2)  # averaged: 0.1 + 0.3 * (0.2 - 0.1)
    overlap.observe_verify(True, (1, 5), 0.3)
    overlap.observe_verify(True, (2, 5), 0.3)  # another bucket: not comparable
    overlap.observe_verify(True, (1, 7), 0.3)  # beyond the widths measured: not comparable
    overlap.observe_verify(False, (1, 9), 0.23)
    overlap.observe_verify(True, (1, 7), 0.3)  # between widths 5 and 9: 0.13 + (0.23 - 0.13) / 2
    assert list(overlap._extra) == [pytest.approx(0.3 - 0.13), pytest.approx(0.3 - 0.18)]
    overlap.observe_saved(0.05)  # no round chosen yet: the last did not pre-draft
    overlap.choose()
    overlap.observe_saved(0.04)
    assert list(overlap._saved) == [0.04]


@pytest.mark.parametrize(
    ("ks", "predrafted", "rows", "saved"),
    [
        ([4], [True], [], 0.050),  # the one row held its branch: the whole call saved
        ([4], [False], [0], 0.0),  # no branch used
        ([4, 4], [True, False], [1], 0.060 - 0.050),  # a call for one row instead of two
        ([4, 0], [True, False], [], 0.050),  # the other row did not draft anyway
    ],
)
def test_the_drafting_saved_is_the_measured_call_less_the_call_made(tiny_target, ks, predrafted, rows, saved):
    engine = make_engine(tiny_target, tiny_target.model, overlap="on")
    engine.costs.observe_draft(1, 4, 0.050)
    engine.costs.observe_draft(2, 4, 0.060)
    assert engine._drafting_saved(ks, predrafted, rows) == pytest.approx(saved)


# -- the engine ------------------------------------------------------------------------------------------------------


def _ids(loaded, text):
    return loaded.tokenizer(text)["input_ids"]


PROMPTS = ["def add(a, b):", "The quick brown fox", "for index, value in enumerate(range(10)):\n    print("]


@pytest.mark.parametrize("agreement", ["always", "sometimes"])
@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_greedy_output_with_pre_drafting_equals_plain_decoding(tiny_target, agreement, k):
    draft = tiny_target.model if agreement == "always" else perturbed(tiny_target.model, 0.05, seed=3)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    requests = [(str(i), _ids(tiny_target, text), params, k) for i, text in enumerate(PROMPTS)]
    expected = run_to_completion(make_engine(tiny_target), [(r, ids, params, 0) for r, ids, _, _ in requests])
    # A draft that always agrees is never rejected: its rows pre-draft the main branch alone, so that every
    # branch counted is one that should be used.
    engine = make_engine(tiny_target, draft, overlap="on", overlap_alternatives=0 if agreement == "always" else 3)
    predrafted = []
    for request_id, ids, p, kk in requests:
        engine.add_request(Request(request_id, tuple(ids), p, kk))
    got: dict[str, list[int]] = {r: [] for r, _, _, _ in requests}
    while engine.has_work:
        for out in engine.step():
            got[out.seq_id] += out.new_token_ids
            if out.round is not None and out.round.proposed_token_ids:
                predrafted.append(out.round.predrafted)
    assert got == {r: expected[r][0] for r in got}
    assert engine.overlap.branches > 0 and engine.overlap.hits > 0
    assert any(predrafted) and (agreement == "always" or not all(predrafted))
    if agreement == "always" and k != "auto":  # every branch is right: every round after the first uses one
        assert engine.overlap.hits >= engine.overlap.branches - 2 * len(PROMPTS)


@pytest.mark.parametrize("k", [3, 6])
def test_rejection_branches_are_used_and_greedy_output_still_equals_plain_decoding(tiny_target, k):
    """A draft that disagrees now and then: rounds that reject a draft find a branch drafted for that rejection
    (the draft's runner-up was the target's token) and verify it at once; the output is plain decoding's."""
    draft = perturbed(tiny_target.model, 0.05, seed=3)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    requests = [(str(i), _ids(tiny_target, text)) for i, text in enumerate(PROMPTS)]
    expected = run_to_completion(make_engine(tiny_target), [(r, ids, params, 0) for r, ids in requests])
    engine = make_engine(tiny_target, draft, num_slots=16, overlap="on")
    for request_id, ids in requests:
        engine.add_request(Request(request_id, tuple(ids), params, k))
    got: dict[str, list[int]] = {r: [] for r, _ in requests}
    while engine.has_work:
        for out in engine.step():
            got[out.seq_id] += out.new_token_ids
    assert got == {r: expected[r][0] for r in got}
    assert engine.overlap.rejection_hits > 0
    assert engine.overlap.hits > engine.overlap.rejection_hits  # the main branch is still used too


def test_rows_with_and_without_branches_share_rounds(tiny_target):
    """A batch where some rows verify a pre-drafted branch and others their fresh drafts, in the same verify."""
    draft = perturbed(tiny_target.model, 0.05, seed=3)
    engine = make_engine(tiny_target, draft, overlap="on")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for i, text in enumerate(PROMPTS):
        engine.add_request(Request(str(i), tuple(_ids(tiny_target, text)), params, 2))
    mixed = 0
    while engine.has_work:
        kinds = {out.round.predrafted for out in engine.step() if out.round and out.round.proposed_token_ids}
        mixed += kinds == {True, False}
    assert mixed > 0


def _assert_same_cache(used: DraftModelDrafter, fresh: DraftModelDrafter, rtol: float, atol: float) -> None:
    """Sequence "s" holds the same length and the same keys and values in both drafters' caches."""
    slot_used, slot_fresh = used._slots["s"], fresh._slots["s"]
    length = used.runner.length(slot_used)
    assert length == fresh.runner.length(slot_fresh)
    for a, b in zip(
        used.runner.cache.keys + used.runner.cache.values, fresh.runner.cache.keys + fresh.runner.cache.values
    ):
        torch.testing.assert_close(a[slot_used, :, :length], b[slot_fresh, :, :length], rtol=rtol, atol=atol)


@pytest.mark.parametrize("alternatives", [0, 3])
def test_the_drafts_cache_after_a_missed_branch_equals_a_fresh_drafts(tiny_target, alternatives):
    """A pre-draft assumes the drafts under verification (and, asked, drafts branches for rejections of them); a
    rejection commits something no branch guessed, and a plain round more after it. The draft's next proposal, and
    every cached position it reads, are then those of a draft that never pre-drafted; the branches' slots are
    freed."""
    draft = perturbed(tiny_target.model, 0.05, seed=3)
    context = _ids(tiny_target, "def add(a, b):")

    def drafter():
        runner = ModelRunner(draft, RunnerConfig(num_slots=5, max_seq_len=128))
        return DraftModelDrafter(runner, 400, alternative_min_chance=0.0)

    greedy = TokenShaping()
    used = drafter()
    used._recording = True  # as after its first pre-draft that asked for alternatives
    used.start("s", context)
    (proposal,) = used.propose([DraftRequest("s", context, 3, greedy, None)])
    base = DraftRequest("s", context, 3, greedy, None)
    (pre,) = used.propose([replace(predraft_request(base, proposal, 3), num_alternatives=alternatives)])
    assert len(pre.token_ids) == 3 and len(pre.alternatives) == alternatives
    guessed = {a.token for a in pre.alternatives if a.position == 1}
    rejected = next(t for t in range(400) if t != proposal.token_ids[1] and t not in guessed)
    # The second draft rejected, then a round without drafts committed one more token: the draft hears of both now.
    committed = context + proposal.token_ids[:1] + [rejected, 11]
    used.observe("s", len(committed))
    (after_miss,) = used.propose([DraftRequest("s", committed, 4, greedy, None)])

    fresh = drafter()
    fresh.start("s", committed)
    (expected,) = fresh.propose([DraftRequest("s", committed, 4, greedy, None)])
    assert after_miss.token_ids == expected.token_ids
    assert used.runner.cache.free_slots == 4  # the sequence's own slot alone
    _assert_same_cache(used, fresh, rtol=1e-5, atol=1e-6)


def test_a_rejection_branch_holds_a_fresh_drafts_proposal_and_cache_for_its_outcome(tiny_target):
    """A pre-draft covering rejection outcomes: each branch's drafts are what a draft that never pre-drafted
    proposes on that outcome's context, and once that outcome is committed the next call drafts on the branch's
    cache (its positions are not read again) exactly as a fresh draft would; the other branches' slots are freed."""
    draft = perturbed(tiny_target.model, 0.3, seed=5)
    context = _ids(tiny_target, "def add(a, b):")
    greedy = TokenShaping()

    def drafter():
        # A tiny random model's q is flat: every outcome is unlikely, so the floor is lifted to cover some.
        runner = ModelRunner(draft, RunnerConfig(num_slots=6, max_seq_len=128))
        return DraftModelDrafter(runner, 400, alternative_min_chance=0.0)

    used = drafter()
    used._recording = True  # as after its first pre-draft that asked for alternatives
    used.start("s", context)
    (proposal,) = used.propose([DraftRequest("s", context, 4, greedy, None)])
    base = DraftRequest("s", context, 4, greedy, None)
    (pre,) = used.propose([replace(predraft_request(base, proposal, 4), num_alternatives=3)])
    assert pre.alternatives and len(pre.alternatives) <= 3
    for alternative in pre.alternatives:
        at = len(context) + alternative.position
        outcome = context + proposal.token_ids[: alternative.position] + [alternative.token]
        assert alternative.token != proposal.token_ids[alternative.position]
        fresh = drafter()
        fresh.start("s", outcome)
        (expected,) = fresh.propose([DraftRequest("s", outcome, len(alternative.proposal.token_ids), greedy, None)])
        assert alternative.proposal.token_ids == expected.token_ids
        assert at < len(context) + len(proposal.token_ids)

    alternative = pre.alternatives[-1]
    outcome = context + proposal.token_ids[: alternative.position] + [alternative.token]
    committed = outcome + alternative.proposal.token_ids[:1] + [3]  # its first draft accepted, then a replacement
    before = used.runner.computed_tokens
    (after,) = used.propose([DraftRequest("s", committed, 3, greedy, None)])
    assert used.runner.computed_tokens - before == 3  # 3 steps of one token, the first reading the replacement
    assert used.runner.cache.free_slots == 5  # the sequence's one slot: the old and the other branches freed
    fresh = drafter()
    fresh.start("s", committed)
    (expected,) = fresh.propose([DraftRequest("s", committed, 3, greedy, None)])
    assert after.token_ids == expected.token_ids
    # The branch's positions were computed as rows of a batch of branches: equal to a fresh draft's to rounding.
    _assert_same_cache(used, fresh, rtol=1e-4, atol=1e-5)


def test_a_confirmed_branch_is_not_read_again(tiny_target):
    """A hit leaves the branch's positions in the draft's cache: the next pre-draft reads one token, not the
    branch again."""
    engine = make_engine(tiny_target, tiny_target.model, overlap="on", overlap_alternatives=0)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request(Request("r", tuple(_ids(tiny_target, "def add(a, b):")), params, 3))
    runner = engine.drafter.runner
    computed = []
    while engine.has_work:
        before = runner.computed_tokens
        outs = engine.step()
        if any(o.round is not None and o.round.predrafted for o in outs):
            computed.append(runner.computed_tokens - before)
    # A used branch of 3 drafts: the next pre-draft reads the last draft and drafts the guess and 3 more (4
    # positions written); reading the branch again would write 3 more.
    assert computed and max(computed) <= 4, computed


@pytest.mark.parametrize(
    ("verify_s", "draft_1_s", "draft_8_s", "steps"),
    [
        (0.130, 0.020, 0.125, 8),  # a CPU core of its own: 15 ms a draft step, 8 fit in a 130 ms verify
        (0.005, 0.003, 0.021, 2),  # a GPU draft step about half a verify: the guess and one draft at least
    ],
)
def test_a_pre_draft_is_as_long_as_the_measured_verify_has_time_for(tiny_target, verify_s, draft_1_s, draft_8_s, steps):
    engine = make_engine(tiny_target, tiny_target.model, overlap="on")
    assert engine._steps_within_verify(1, 6) == engine.config.max_speculative_tokens + 1  # nothing measured yet
    engine.costs.observe_verify(1, 6, verify_s)
    engine.costs.observe_draft(1, 1, draft_1_s)
    engine.costs.observe_draft(1, 8, draft_8_s)
    assert engine._steps_within_verify(1, 6) == steps


# -- a batch split in two groups --------------------------------------------------------------------------------------


def _costs(verify_s: dict[int, float], draft_s: dict[int, float], k: int = 3) -> CostModel:
    """Costs measured at k: a verify of k + 1 tokens and a draft call of k, per batch size."""
    costs = CostModel()
    for b, seconds in verify_s.items():
        costs.observe_verify(b, k + 1, seconds)
        costs.observe_verify(b, 1, seconds / 2)  # a second width: the model extrapolates only from two
    for b, seconds in draft_s.items():
        costs.observe_draft(b, k, seconds)
    return costs


@pytest.mark.parametrize(
    ("verify_s", "draft_s", "hit_rate", "pays"),
    [
        # A GPU: a verify of 2 rows costs what one of 4 does, drafting is cheap: two verifies lose to one.
        ({2: 0.010, 4: 0.011}, {2: 0.004, 4: 0.005}, 0.0, False),
        # A CPU core each: the verify grows with the rows, drafting 2 rows costs most of a 2-row verify.
        ({2: 0.200, 4: 0.380}, {2: 0.150, 4: 0.260}, 0.0, True),
        # The same, but pre-drafting's branches hit so often that the whole batch barely waits for the draft.
        ({2: 0.200, 4: 0.380}, {2: 0.150, 4: 0.260}, 0.95, False),
    ],
)
def test_a_batch_is_split_where_the_measured_costs_say_it_pays(verify_s, draft_s, hit_rate, pays):
    assert split_pays(_costs(verify_s, draft_s), 4, 3, hit_rate) is pays


def test_no_split_while_a_cost_is_unmeasured_or_for_one_row():
    assert split_pays(_costs({4: 0.38}, {4: 0.26}), 4, 3, 0.0) is False  # nothing at 2 rows
    assert split_pays(_costs({1: 0.1, 2: 0.2}, {1: 0.1, 2: 0.2}), 1, 3, 0.0) is False
    assert split_pays(_costs({2: 0.2, 4: 0.38}, {2: 0.15, 4: 0.26}), 4, 0, 0.0) is False  # no drafts


@pytest.mark.parametrize("k", [2, "auto"])
def test_split_batches_take_turns_and_greedy_output_still_equals_plain_decoding(tiny_target, k):
    """Two groups taking turns: each round verifies one group with the proposals drafted while the other was
    verified; the output is plain decoding's, and the rounds after the first use those proposals."""
    draft = perturbed(tiny_target.model, 0.05, seed=3)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    texts = [*PROMPTS, "import numpy as np\n"]
    requests = [(str(i), _ids(tiny_target, text)) for i, text in enumerate(texts)]
    expected = run_to_completion(make_engine(tiny_target), [(r, ids, params, 0) for r, ids in requests])
    engine = make_engine(tiny_target, draft, overlap="on", split_batches=True)
    for request_id, ids in requests:
        engine.add_request(Request(request_id, tuple(ids), params, k))
    got: dict[str, list[int]] = {r: [] for r, _ in requests}
    sizes, predrafted = [], []
    while engine.has_work:
        outs = engine.step()
        for out in outs:
            got[out.seq_id] += out.new_token_ids
        rounds = [o.round for o in outs if o.round is not None]
        if rounds:
            sizes.append(len(rounds))
        predrafted += [r.split for r in rounds if r.proposed_token_ids]
        assert not any(r.predrafted for r in rounds)  # no branches guessed: each group's next round is drafted
    assert got == {r: expected[r][0] for r in got}
    assert engine.overlap.split_rounds > 0 and max(sizes) <= 2  # half of the 4 rows a round
    assert sum(predrafted) > len(predrafted) / 2


def test_a_start_takes_the_slots_of_branches_and_the_branched_sequence_drafts_on(tiny_target):
    """Branches hold slots only until something needs them: they count as free, a start drops them, and the
    sequence they branched drafts on as a fresh draft would."""
    draft = perturbed(tiny_target.model, 0.05, seed=3)
    context = _ids(tiny_target, "def add(a, b):")
    greedy = TokenShaping()

    def drafter(num_slots):
        runner = ModelRunner(draft, RunnerConfig(num_slots=num_slots, max_seq_len=128))
        return DraftModelDrafter(runner, 400, alternative_min_chance=0.0)

    used = drafter(4)
    used._recording = True  # as after its first pre-draft that asked for alternatives
    used.start("s", context)
    (proposal,) = used.propose([DraftRequest("s", context, 3, greedy, None)])
    base = DraftRequest("s", context, 3, greedy, None)
    (pre,) = used.propose([replace(predraft_request(base, proposal, 3), num_alternatives=3)])
    assert len(pre.alternatives) == 3 and used.runner.cache.free_slots == 0 and used.free_slots == 3
    used.start("t", context)  # needs a slot: the branches give theirs up
    assert used.free_slots == used.runner.cache.free_slots == 2
    committed = context + proposal.token_ids + [pre.token_ids[0]]  # every draft accepted, the bonus as guessed
    (after,) = used.propose([DraftRequest("s", committed, 2, greedy, None)])
    fresh = drafter(1)
    fresh.start("s", committed)
    (expected,) = fresh.propose([DraftRequest("s", committed, 2, greedy, None)])
    assert after.token_ids == expected.token_ids
