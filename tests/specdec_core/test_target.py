"""The target's side of a round: a deterministic row verified in a batch with model-drafted rows is judged with
its point masses (acceptance p(x)), exactly as when it is verified alone."""

from __future__ import annotations

import torch

from specdec_core.config import TokenShaping
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.sparse_q import SparseQ
from specdec_core.target import LocalTarget, PrefillItem, VerifyItem
from tests.helpers import logits_after

PROMPT = list(range(5, 25))
SAMPLED = TokenShaping(temperature=1.0)


def _started(tiny_target, names):
    target = LocalTarget(ModelRunner(tiny_target.model, RunnerConfig(num_slots=4, max_seq_len=128)))
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
