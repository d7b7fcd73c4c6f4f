"""The distillation loss: KL(p || q) over the target's top-k ids and one bucket for the rest."""

from __future__ import annotations

import torch

from specdec_core.distill.loss import topk_kl


def _top(target_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = torch.log_softmax(target_logits, dim=-1).topk(k, dim=-1)
    return top.indices, top.values


def test_zero_when_the_draft_is_the_target():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 3  # [N, V]
    ids, logp = _top(logits, 8)
    assert topk_kl(logits.clone(), ids, logp, torch.ones(5)).abs() < 1e-6


def test_zero_when_the_draft_matches_at_the_top_k_only():
    """Outside the top-k only the total mass counts: moving it among the other ids changes nothing."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 40, generator=gen) * 3  # [N, V]
    ids, logp = _top(logits, 6)
    probs = torch.softmax(logits, dim=-1)  # [N, V]
    rest = torch.ones_like(probs).scatter(-1, ids, 0.0)  # [N, V] 1 outside the top-k
    shuffled = rest * torch.rand(probs.shape, generator=gen)
    shuffled = shuffled / shuffled.sum(-1, keepdim=True) * (probs * rest).sum(-1, keepdim=True)  # same rest mass
    draft = (probs * (1 - rest) + shuffled).log()
    assert not torch.allclose(draft.softmax(-1), probs)
    assert topk_kl(draft, ids, logp, torch.ones(4)).abs() < 1e-6


def test_positive_when_the_top_k_differs():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 30, generator=gen) * 3
    ids, logp = _top(logits, 5)
    for scale in (0.1, 1.0):
        draft = logits + scale * torch.randn(logits.shape, generator=gen)
        assert topk_kl(draft, ids, logp, torch.ones(6)) > 1e-4


def test_positive_when_the_draft_keeps_the_ratios_but_not_the_mass():
    """Renormalising over the top-k would miss this: the same ratios among the top-k ids, too little mass on them."""
    logits = torch.tensor([[4.0, 3.0, 0.0, 0.0, 0.0, 0.0]])
    ids, logp = _top(logits, 2)
    draft = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # ids 0 and 1 keep their ratio e : 1
    assert topk_kl(draft, ids, logp, torch.ones(1)) > 0.5


def test_weights_count_positions():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 20, generator=gen)
    ids, logp = _top(logits, 4)
    draft = logits.clone()
    draft[1] += torch.randn(20, generator=gen) * 2  # only position 1 is wrong
    assert topk_kl(draft, ids, logp, torch.tensor([1.0, 0.0])).abs() < 1e-6
    assert topk_kl(draft, ids, logp, torch.tensor([1.0, 4.0])) > topk_kl(draft, ids, logp, torch.tensor([1.0, 1.0]))


def test_gradients_are_finite_when_the_top_k_holds_all_of_p():
    logits = torch.tensor([[5.0, 1.0, -2.0]])
    ids, logp = _top(logits, 3)  # the whole vocabulary: p's rest is 0
    draft = torch.zeros(1, 3, requires_grad=True)
    loss = topk_kl(draft, ids, logp, torch.ones(1))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(draft.grad).all() and draft.grad.abs().sum() > 0
