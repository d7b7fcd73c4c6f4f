"""The calls that sample, made directly on the device each on its own, before any engine runs them: in the engine a
sampled prefill that fails ends its requests before any round of theirs, which an exactness check of the greedy
rows would not notice."""

from __future__ import annotations

import torch

from specdec_core.config import TokenShaping
from specdec_core.drafters.base import DraftRequest
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.models.loader import LoadedModel
from specdec_core.runner import ModelRunner
from specdec_core.sparse_q import SparseQ
from specdec_core.target import LocalTarget, PrefillItem, VerifyItem
from specdec_tools.bench.gpu.engines import PROMPTS, RUNNER, SAMPLED
from specdec_tools.bench.gpu.report import Report


def component_calls(report: Report, label: str, loaded: dict[str, LoadedModel]) -> dict[str, str | None]:
    """The target's and the draft model's calls at temperature > 0 made directly on the device, each on its own: in
    the engine a sampled prefill that fails ends its requests before any round of theirs. None: the call ran."""
    target, draft = loaded["target"], loaded["near"]
    greedy, sampled = TokenShaping(), TokenShaping(**SAMPLED)
    ids = target.tokenizer(PROMPTS[0])["input_ids"]
    assert target.model is not None and draft.model is not None  # a LoadedModel always carries its weights
    local = LocalTarget(ModelRunner(target.model, RUNNER))
    drafter = DraftModelDrafter(ModelRunner(draft.model, RUNNER), local.vocab_size)
    q = SparseQ(torch.tensor([[7, 9], [3, 8]]), torch.tensor([[0.5, 0.5], [0.25, 0.75]]))  # [2, 2], drafts 7 and 3
    u = torch.tensor([0.3, 0.6], dtype=torch.float64)  # [2] acceptance uniforms
    calls = {
        "target prefill, greedy rows": lambda: local.prefill([PrefillItem(s, ids, greedy, None) for s in "gs"]),
        "target verify, greedy and sampled rows": lambda: local.verify(
            [
                VerifyItem("g", ids[-1], [7, 3], None, greedy, None, None),
                VerifyItem("s", ids[-1], [7, 3], q, sampled, u, 0.5),
            ]
        ),
        "target verify, sampled rows": lambda: local.verify([VerifyItem("s", ids[-1], [7, 3], q, sampled, u, 0.5)]),
        "target prefill, sampled row": lambda: local.prefill([PrefillItem("x", ids, sampled, 0.5)]),
        "draft model propose, sampled row": lambda: (
            drafter.start("d", ids),
            drafter.propose([DraftRequest("d", ids, 3, sampled, torch.rand(3, dtype=torch.float64))]),
        ),
    }
    out: dict[str, str | None] = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        report.check(f"device {label}: {name}", out[name] is None, out[name] or "")
    return out
