"""Training data: which positions are taught, from completions and from proposal-log rejections, and the target's
top-k there."""

from __future__ import annotations

import torch

from specdec_core.distill.data import completion_sequence, rejection_sequences, score
from specdec_core.distill.forward import use_causal_attention
from specdec_core.models.loader import load_model
from tests.helpers import logits_after


def test_a_completion_is_taught_at_every_position_that_predicts_it():
    s = completion_sequence([1, 2, 3], [7, 8])
    assert s.token_ids == (1, 2, 3, 7, 8)
    assert s.positions == (2, 3)  # after 3 comes 7, after 7 comes 8
    assert s.weight == 1.0


def test_rejections_from_a_log_are_taught_where_the_first_proposal_failed():
    records = [
        {"proposed": [5, 6, 7], "accepted": 1, "context": [1, 2, 3]},  # 6 was rejected after 1 2 3 5
        {"proposed": [5, 6], "accepted": 2, "context": [1, 2]},  # all accepted: nothing to teach
        {"proposed": [9, 9], "accepted": 0},  # no context (the log's default): cannot say where
        {"proposed": [4], "accepted": 0, "context": [8, 8]},
    ]
    sequences = rejection_sequences(records, weight=4.0)
    assert [(s.token_ids, s.positions, s.weight) for s in sequences] == [
        ((1, 2, 3, 5), (3,), 4.0),
        ((8, 8), (1,), 4.0),
    ]


def test_scores_are_the_targets_top_k_among_the_shared_ids(tiny_dir):
    model = load_model(tiny_dir / "target", dtype="float32").model  # 400 rows; say the draft has 384
    sequence = completion_sequence(list(range(10, 20)), [30, 31, 32])
    expected = torch.log_softmax(logits_after(model, list(sequence.token_ids)), dim=-1)  # [T, 400]
    [example] = score(use_causal_attention(model), [sequence], top_k=5, shared_vocab=384)
    want = expected[list(sequence.positions)][:, :384].topk(5, dim=-1)
    assert torch.equal(example.top_ids, want.indices)
    torch.testing.assert_close(example.top_logprobs, want.values, rtol=1e-5, atol=1e-5)
    assert int(example.top_ids.max()) < 384
    assert example.weights.tolist() == [1.0, 1.0, 1.0]
