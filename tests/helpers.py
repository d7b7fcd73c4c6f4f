"""Helpers shared by tests: model variants that make a draft agree always, sometimes or never."""

from __future__ import annotations

import copy

import torch


def perturbed(model: torch.nn.Module, scale: float, seed: int = 0) -> torch.nn.Module:
    """A copy of `model` with Gaussian noise on every weight: a draft that agrees with it only sometimes."""
    clone = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in clone.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale * param.std().clamp(min=1e-3))
    return clone


def contrarian(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose LM head is negated: its argmax is the target's argmin, so greedy drafts are never right."""
    clone = copy.deepcopy(model)
    clone.lm_head.weight = torch.nn.Parameter(-model.lm_head.weight.detach().clone(), requires_grad=False)
    return clone
