"""The target's side of a round: a deterministic row verified in a batch with model-drafted rows is judged with
its point masses (acceptance p(x)), exactly as when it is verified alone; a constrained row's masks apply to every
position it samples at."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec_core.config import TokenShaping
from specdec_core.grammar.bits import PackedMasks
from specdec_core.models.loader import load_model
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.sparse_q import SparseQ
from specdec_core.target import LocalTarget, PrefillItem, VerifyItem
from tests.helpers import logits_after, syncs_during

PROMPT = list(range(5, 25))
SAMPLED = TokenShaping(temperature=1.0)


def _started(tiny_target, names):
    target = LocalTarget(ModelRunner(tiny_target.model, RunnerConfig(num_slots=len(names), max_seq_len=128)))
    target.prefill([PrefillItem(name, PROMPT, SAMPLED, 0.5) for name in names])
    return target


def _point_mass_row(name, last, draft):
    # u = 0.5 against p(draft) < 0.5: rejected when q is the point mass it is, accepted if q were taken as 0.
    return VerifyItem(name, last, [draft], None, SAMPLED, torch.tensor([0.5], dtype=torch.float64), 0.3)


def test_a_point_mass_row_next_to_a_model_drafted_row_is_judged_by_its_point_masses(tiny_target):
    logits = logits_after(tiny_target.model, PROMPT)[-1]  # [V]: the distribution after the prompt
    unlikely = int(logits.argmin())  # p(unlikely) is far below the uniform 0.5
    first = int(logits.argmax())
    alone_target = _started(tiny_target, ["alone"])
    mixed_target = _started(tiny_target, ["point", "model"])
    token = first  # the last committed token fed to every row (any token: all rows get the same one)
    (alone,) = alone_target.verify([_point_mass_row("alone", token, unlikely)])
    q = SparseQ.from_dense(torch.nn.functional.one_hot(torch.tensor([first]), logits.shape[-1]).float())  # [1, V]
    model_row = VerifyItem("model", token, [first], q, SAMPLED, torch.tensor([0.1], dtype=torch.float64), 0.3)
    point, _ = mixed_target.verify([_point_mass_row("point", token, unlikely), model_row])
    assert alone.num_accepted == 0
    assert (point.num_accepted, point.token_ids) == (alone.num_accepted, alone.token_ids)


def _packed(rows: list[list[int]], vocab: int) -> PackedMasks:
    """Masks allowing `rows[i]` at position i, packed as a grammar packs them."""
    allowed = np.zeros((len(rows), (vocab + 31) // 32 * 32), dtype=np.uint8)  # [n, 32W]
    for i, tokens in enumerate(rows):
        allowed[i, tokens] = 1
    return PackedMasks(np.packbits(allowed, axis=-1, bitorder="little").view(np.uint32), vocab)  # [n, W]


def test_masks_restrict_the_first_token_and_every_verified_position(tiny_target):
    """Greedy rows: the prefill's token is the best allowed one, not the best; a draft its row's mask refuses is
    rejected even where it is p's argmax, and the recovered token is the best the mask allows."""
    vocab = tiny_target.model.vocab_size
    logits = logits_after(tiny_target.model, PROMPT)[-1]  # [V]
    ranked = logits.argsort(descending=True).tolist()
    target = LocalTarget(ModelRunner(tiny_target.model, RunnerConfig(num_slots=2, max_seq_len=128)))
    (first,) = target.prefill([PrefillItem("s", PROMPT, TokenShaping(), None, allowed=_packed([ranked[2:5]], vocab))])
    assert first.first_token_id == ranked[2]
    after = logits_after(tiny_target.model, PROMPT + [ranked[2]])[-1].argsort(descending=True).tolist()  # [V]
    masks = _packed([after[1:], list(range(vocab))], vocab)  # the draft, p's argmax, refused at position 0
    (outcome,) = target.verify(
        [VerifyItem("s", ranked[2], [after[0]], None, TokenShaping(), None, None, allowed=masks)]
    )
    assert (outcome.num_accepted, outcome.token_ids) == (0, (after[1],))


def test_a_masked_sampled_row_samples_only_allowed_tokens(tiny_target):
    vocab = tiny_target.model.vocab_size
    allowed = [3, 40, 77]
    target = LocalTarget(ModelRunner(tiny_target.model, RunnerConfig(num_slots=8, max_seq_len=128)))
    items = [
        PrefillItem(str(i), PROMPT, SAMPLED, u, allowed=_packed([allowed], vocab))
        for i, u in enumerate([0.0, 0.3, 0.6, 0.999])
    ]
    assert {first.first_token_id for first in target.prefill(items)} <= set(allowed)
    drafts = [[77, 3], [5, 3]]  # the second row's first draft is refused: rejected whatever u, then resampled
    outcomes = target.verify(
        [
            VerifyItem(
                str(i),
                3,
                d,
                None,
                SAMPLED,
                torch.tensor([0.0, 0.0], dtype=torch.float64),
                0.5,
                allowed=_packed([allowed] * 3, vocab),
            )
            for i, d in enumerate(drafts)
        ]
    )
    assert all(set(o.token_ids) <= set(allowed) for o in outcomes)
    assert outcomes[1].num_accepted == 0


def _rows(vocab: int) -> list[VerifyItem]:
    """Greedy and sampled rows mixed, with 0..3 drafts each; each sampled row's uniforms fixed."""
    greedy = TokenShaping()
    uniforms = torch.tensor([0.2, 0.7, 0.4], dtype=torch.float64)
    return [
        VerifyItem("g0", 7, [11, 12, 13], None, greedy, None, None),
        VerifyItem("s0", 7, [11, 12], None, SAMPLED, uniforms[:2], 0.3),
        VerifyItem("g1", 9, [], None, greedy, None, None),
        VerifyItem("s1", 9, [vocab - 1, 4, 5], None, SAMPLED, uniforms, 0.9),
        VerifyItem("g2", 8, [21], None, greedy, None, None),
    ]


def test_a_mixed_batch_gives_each_row_what_it_gets_alone(tiny_target):
    """Greedy and sampled rows are accepted apart and merged on the device: every row's outcome, and its cache
    length after the rollback, equal the row's verified alone."""
    rows = _rows(tiny_target.model.vocab_size)
    names = [row.seq_id for row in rows]
    batched = _started(tiny_target, names)
    together = batched.verify(rows)
    for row, outcome in zip(rows, together):
        alone = _started(tiny_target, [row.seq_id])
        assert alone.verify([row]) == [outcome], row.seq_id
        assert batched.runner.length(batched._slots[row.seq_id]) == alone.runner.length(alone._slots[row.seq_id])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts device-to-host syncs on a CUDA device")
def test_a_verify_waits_for_the_device_as_often_for_five_rows_as_for_one_on_cuda(tiny_dir):
    """No per-row reads: the batch's outcome comes back in one copy, whatever the rows (greedy and sampled)."""
    model = load_model(tiny_dir / "target", dtype="float32").model.to("cuda")
    target = LocalTarget(ModelRunner(model, RunnerConfig(num_slots=8, max_seq_len=128)))
    rows = _rows(model.vocab_size)
    target.prefill([PrefillItem(row.seq_id, PROMPT, SAMPLED, 0.5) for row in rows])
    one = syncs_during(lambda: target.verify(rows[3:4]))
    assert syncs_during(lambda: target.verify(rows[:3] + rows[4:])) == one
