"""N-gram prompt lookup: longest recent match, continuation, incremental index."""

from __future__ import annotations

from specdec_core.config import TokenShaping
from specdec_core.drafters.base import DraftRequest
from specdec_core.drafters.ngram import NgramDrafter


def _propose(drafter: NgramDrafter, tokens: list[int], k: int, seq: str = "s") -> list[int]:
    request = DraftRequest(seq_id=seq, token_ids=tokens, num_tokens=k, shaping=TokenShaping(), uniform=None)
    (proposal,) = drafter.propose([request])
    assert proposal.q is None  # deterministic proposals
    return proposal.token_ids


def test_continues_the_longest_match():
    d = NgramDrafter(max_n=3, min_n=1)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    d.start("s", tokens)
    # Suffix (1, 2, 3) occurred at the start, followed by 4, 5; the shorter (2, 3) match later is ignored.
    assert _propose(d, tokens, 2) == [4, 5]


def test_prefers_the_most_recent_occurrence_of_equal_length():
    d = NgramDrafter(max_n=2, min_n=1)
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    d.start("s", tokens)
    assert _propose(d, tokens, 1) == [2]


def test_no_match_proposes_nothing_and_k_caps_the_proposal():
    d = NgramDrafter(max_n=2, min_n=2)
    d.start("s", [1, 2, 3])
    assert _propose(d, [1, 2, 3], 4) == []
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    d.start("t", tokens)
    assert _propose(d, tokens, 3, seq="t") == [3, 4, 5]


def test_index_follows_committed_tokens():
    d = NgramDrafter(max_n=2, min_n=1)
    tokens = [10, 11, 12]
    d.start("s", tokens)
    assert _propose(d, tokens, 2) == []
    tokens += [13, 10, 11]  # committed later: (10, 11) now recurs, followed by 12, 13
    d.observe("s", len(tokens))
    assert _propose(d, tokens, 2) == [12, 13]
    d.release("s")
    d.release("s")  # idempotent


def test_probabilities_when_asked_are_point_masses():
    d = NgramDrafter(max_n=2, min_n=1)
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    d.start("s", tokens)
    asked = DraftRequest("s", tokens, 3, TokenShaping(), None, return_probs=True)
    not_asked = DraftRequest("s", tokens, 3, TokenShaping(), None)
    (proposal,), (plain,) = d.propose([asked]), d.propose([not_asked])
    assert proposal.token_ids == [3, 4, 5] and proposal.draft_probs == (1.0, 1.0, 1.0)
    assert plain.draft_probs is None


def test_proposals_are_labelled_by_match_length():
    d = NgramDrafter(max_n=3, min_n=1)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    d.start("s", tokens)
    (long,) = d.propose([DraftRequest("s", tokens, 2, TokenShaping(), None)])
    assert long.label == "ngram-3"
    tokens = tokens + [6]
    (short,) = d.propose([DraftRequest("s", tokens, 2, TokenShaping(), None)])
    assert short.token_ids == [] and short.label is None  # 6 never occurred before


def test_a_proposal_prefix_keeps_its_label_and_probabilities():
    import torch

    from specdec_core.drafters.base import Proposal
    from specdec_core.sparse_q import SparseQ

    q = torch.eye(4)[[1, 2, 3]]  # [3, V]
    cut = Proposal([1, 2, 3], SparseQ.from_dense(q), (0.5, 0.25, 0.125), label="x").prefix(2)
    assert cut.token_ids == [1, 2] and torch.equal(cut.q.dense(4), q[:2])
    assert cut.draft_probs == (0.5, 0.25) and cut.label == "x"
