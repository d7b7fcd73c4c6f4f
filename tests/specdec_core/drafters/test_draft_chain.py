"""Greedy drafting as one chain on the device (`draft_chain.py`) proposes what the step loop proposes, and leaves
every slot (its length, what the prefix cache offers from it) as the loop leaves it, round after round."""

from __future__ import annotations

import random

import pytest
import torch

from specdec_core.config import TokenShaping
from specdec_core.cuda_graphs import GraphConfig
from specdec_core.drafters.base import DraftRequest
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.models.loader import load_model
from specdec_core.runner import ModelRunner, RunnerConfig
from tests.helpers import syncs_during

MAX_SEQ_LEN = 96


def _drafter(model, chain: bool | None, threshold: float, prefix_caching: bool, graphs: bool) -> DraftModelDrafter:
    config = RunnerConfig(
        num_slots=4,
        max_seq_len=MAX_SEQ_LEN,
        prefix_caching=prefix_caching,
        cuda_graphs=GraphConfig(4, (1, 2, 4, 8)) if graphs else None,
    )
    runner = ModelRunner(model, config)
    return DraftModelDrafter(runner, runner.vocab_size, confidence_threshold=threshold, chain_on_device=chain)


def _state(drafter: DraftModelDrafter, names: list[str]) -> list[tuple]:
    runner = drafter.runner
    slots = [drafter._slots[name] for name in names]
    held = [runner.prefix.tokens(slot) if runner.prefix is not None else None for slot in slots]
    return [(runner.length(slot), drafter._fed.get(name), tokens) for name, slot, tokens in zip(names, slots, held)]


@pytest.mark.parametrize(
    ("threshold", "prefix_caching", "graphs"), [(0.0, False, False), (0.05, True, False), (0.05, False, True)]
)
def test_the_chain_proposes_and_leaves_what_the_loop_does(tiny_target, threshold, prefix_caching, graphs):
    vocab = tiny_target.model.vocab_size
    rng = random.Random(7)
    names = ["a", "b", "c"]
    committed = {name: [rng.randrange(vocab) for _ in range(8 + 5 * i)] for i, name in enumerate(names)}
    loop, chain = (_drafter(tiny_target.model, c, threshold, prefix_caching, graphs) for c in (False, True))
    for drafter in (loop, chain):
        for name in names:
            drafter.start(name, committed[name])
    for round_ in range(6):
        requests = [
            DraftRequest(name, list(committed[name]), rng.choice([0, 1, 3, 5]), TokenShaping(), None, name == "b")
            for name in names
        ]
        expected, got = loop.propose(requests), chain.propose(requests)
        for name, e, g in zip(names, expected, got):
            assert g.token_ids == e.token_ids, (round_, name)
            assert g.q is None and e.q is None
            assert g.draft_probs == (None if e.draft_probs is None else pytest.approx(e.draft_probs, abs=1e-6))
        assert _state(chain, names) == _state(loop, names), round_
        for name, proposal in zip(names, expected):  # the target keeps some drafts, then adds its own token
            kept = rng.randint(0, len(proposal.token_ids))
            committed[name] += proposal.token_ids[:kept] + [rng.randrange(vocab)]
    if graphs:
        assert chain.runner.graph_counters().replays > 0


def test_rows_near_their_length_limit_draft_by_the_loop(tiny_target):
    """A short row would run the longest row's steps past its own limit: such a call drafts by the loop."""
    drafter = _drafter(tiny_target.model, True, 0.0, False, False)
    long_row = list(range(10, 10 + MAX_SEQ_LEN - 3))
    drafter.start("near", long_row)
    drafter.start("far", [1, 2, 3])
    requests = [
        DraftRequest("near", long_row, 2, TokenShaping(), None),
        DraftRequest("far", [1, 2, 3], 5, TokenShaping(), None),
    ]
    assert not drafter._chains(requests, [0, 1])
    assert drafter._chains(requests[1:], [0])
    near, far = drafter.propose(requests)
    assert (len(near.token_ids), len(far.token_ids)) == (2, 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts device-to-host syncs on a CUDA device")
def test_a_chain_waits_for_the_device_as_often_for_six_drafts_as_for_one_on_cuda(tiny_dir):
    model = load_model(tiny_dir / "target", dtype="float32").model.to("cuda")
    drafter = _drafter(model, None, 0.3, False, False)
    assert drafter.chain_on_device  # the default on a CUDA runner
    drafter.start("s", [1, 2, 3, 4])
    one = syncs_during(lambda: drafter.propose([DraftRequest("s", [1, 2, 3, 4], 1, TokenShaping(), None)]))
    six = syncs_during(lambda: drafter.propose([DraftRequest("s", [1, 2, 3, 4], 6, TokenShaping(), None)]))
    assert six == one
