"""The draft-model drafter: a sequence that fell behind catches up without disturbing the rest of its batch."""

from __future__ import annotations

import torch

from specdec_core.config import TokenShaping
from specdec_core.drafters.base import DraftRequest
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.runner import ModelRunner, RunnerConfig

MAX_SEQ_LEN = 128


def _drafter(model) -> DraftModelDrafter:
    runner = ModelRunner(model, RunnerConfig(num_slots=4, max_seq_len=MAX_SEQ_LEN))
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
