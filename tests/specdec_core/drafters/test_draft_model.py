"""The draft-model drafter: a sequence that fell behind catches up without disturbing the rest of its batch; q
stays sparse and changes no draw."""

from __future__ import annotations

import torch

from specdec_core.config import TokenShaping
from specdec_core.drafters.base import DraftRequest
from specdec_core.drafters.draft_model import Q_SUPPORT, DraftModelDrafter, _truncate
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.sampling import sample_from

MAX_SEQ_LEN = 128


def _drafter(model, prefix_caching: bool = False) -> DraftModelDrafter:
    runner = ModelRunner(model, RunnerConfig(num_slots=4, max_seq_len=MAX_SEQ_LEN, prefix_caching=prefix_caching))
    return DraftModelDrafter(runner, runner.vocab_size)


def _request(seq_id: str, tokens: list[int], k: int = 3) -> DraftRequest:
    return DraftRequest(seq_id=seq_id, token_ids=tokens, num_tokens=k, shaping=TokenShaping(), uniform=None)


def test_a_stale_row_beside_a_long_one_drafts_as_each_would_alone(tiny_target):
    """Row "long" is near the end of its context; row "stale" has 60 unread tokens (it sat at k = 0). Padded
    together, "stale"'s feed would push "long"'s padding past its cache slot; read alone first, it does not,
    and each row drafts exactly what a freshly started drafter drafts for it."""
    vocab = tiny_target.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    long = torch.randint(0, vocab, (MAX_SEQ_LEN - 8,), generator=gen).tolist()
    stale = torch.randint(0, vocab, (70,), generator=gen).tolist()
    drafter = _drafter(tiny_target.model)
    drafter.start("long", long)
    drafter.start("stale", stale[:10])  # then 60 tokens committed while it did not draft
    together = drafter.propose([_request("long", long), _request("stale", stale)])
    for seq_id, tokens, proposal in [("long", long, together[0]), ("stale", stale, together[1])]:
        fresh = _drafter(tiny_target.model)
        fresh.start(seq_id, tokens)
        (alone,) = fresh.propose([_request(seq_id, tokens)])
        assert proposal.token_ids == alone.token_ids, seq_id
    assert drafter.runner.length(drafter._slots["stale"]) == len(stale) + 2  # read it all, plus two drafts


def test_a_sparse_row_draws_what_its_dense_row_draws():
    """The drafter samples from q's sparse rows: ids ascending, the same uniform draws the same token as the dense
    row would, so q's sparseness changes no output."""
    gen = torch.Generator().manual_seed(0)
    dense = torch.softmax(torch.randn(64, 400, generator=gen) * 3, dim=-1)  # [S, V]
    q = _truncate(dense, 16)  # [S, 16]
    uniform = torch.rand(64, generator=gen, dtype=torch.float64)
    at = sample_from(q.probs, uniform).unsqueeze(-1)  # [S, 1]
    assert torch.equal(q.token_ids.gather(-1, at).squeeze(-1), sample_from(q.dense(400), uniform))


def test_sampled_proposals_carry_a_sparse_q_the_drafts_come_from(tiny_target):
    vocab = tiny_target.model.vocab_size
    drafter = _drafter(tiny_target.model)
    drafter.start("s", [5, 6, 7])
    request = DraftRequest("s", [5, 6, 7], 4, TokenShaping(temperature=1.0), torch.rand(4, dtype=torch.float64))
    (proposal,) = drafter.propose([request])
    assert proposal.q.token_ids.shape == (4, Q_SUPPORT) < (4, vocab)
    dense = proposal.q.dense(vocab)  # [k, V]
    assert torch.allclose(dense.sum(dim=-1), torch.ones(4))
    assert all(dense[i, t] > 0 for i, t in enumerate(proposal.token_ids))


def test_a_start_reads_only_what_its_prefix_cache_lacks_and_drafts_the_same(tiny_target):
    tokens = list(range(5, 45))
    drafter = _drafter(tiny_target.model, prefix_caching=True)
    assert drafter.start("a", tokens[:30]) == 0
    drafter.release("a")  # its 29 tokens stay cached (the last one is read by a propose)
    assert drafter.start("b", tokens, cache_salt="other") == 0
    drafter.release("b")
    before = drafter.runner.computed_tokens
    assert drafter.start("c", tokens) == 29
    assert drafter.runner.computed_tokens - before == len(tokens) - 1 - 29
    (got,) = drafter.propose([_request("c", tokens, k=4)])
    fresh = _drafter(tiny_target.model)
    assert fresh.start("c", tokens) == 0
    (want,) = fresh.propose([_request("c", tokens, k=4)])
    assert got.token_ids == want.token_ids
