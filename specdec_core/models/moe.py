"""A sparse mixture-of-experts MLP block (Qwen3-MoE, Mixtral): a linear router picks `top_k` experts per token, and
the token's output is the routing-weighted sum of those experts' SwiGLU MLPs.

The experts are ordinary MLP modules, one per expert, named as the Hub checkpoints name them
(`experts.{i}.gate_proj` ...), so the CPU kernels replace each expert's linears like any other MLP's and a row's
output never depends on which other rows share the call. The forward groups the batch's rows by expert: one call per
expert that some row chose, never a loop over tokens.

What differs between families is `MoEArgs` (read from the config by `families.py`); what must stay true to match the
reference implementations: softmax over all experts in fp32, then top-k, then (optionally) renormalise; each
token's expert outputs are summed in expert order, in the model dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MoEArgs:
    """The experts of a sparse model; part of `ModelArgs` (None there for a dense model)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's MLP width
    layers: tuple[int, ...]  # decoder layers whose MLP is sparse; the others keep the dense MLP
    renormalize: bool  # the top-k probabilities are divided by their sum (Mixtral always; Qwen3-MoE by config)
    # Qwen3-MoE rounds the routing weights to the model dtype before scaling the experts' outputs; Mixtral scales in
    # fp32 and rounds the product.
    weights_in_model_dtype: bool


def route(
    logits: torch.Tensor,  # [N, E] router logits, model dtype
    args: MoEArgs,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [N, k], experts [N, k]
    """Each token's experts and their weights: softmax over all experts in fp32, top-k, renormalised if asked."""
    probs = torch.softmax(logits.float(), dim=-1)  # [N, E]
    weights, experts = probs.topk(args.top_k, dim=-1)  # [N, k] each
    if args.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if args.weights_in_model_dtype:
        weights = weights.to(logits.dtype)
    return weights, experts


class SparseMoE(nn.Module):
    """`gate` (the router, hidden -> experts) and `experts` (one MLP each); (x [..., D]) -> [..., D]."""

    def __init__(self, args: MoEArgs, hidden_size: int, experts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(hidden_size, args.num_experts, bias=False)
        self.experts = nn.ModuleList(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        weights, chosen = route(self.gate(flat), self.args)  # [N, k] each
        k = chosen.shape[1]
        picks = chosen.flatten()  # [N*k] expert of each (token, slot)
        order = picks.argsort(stable=True)  # [N*k] (token, slot) pairs grouped by expert, ascending
        rows = order // k  # [N*k] token of each pair, in that order
        scale = weights.flatten()[order].unsqueeze(-1)  # [N*k, 1]
        out = torch.zeros_like(flat)  # [N, D]
        start = 0
        # Experts in ascending order, each adding into its tokens' rows: a token's sum runs in expert order whatever
        # else is in the batch (each index_add_ writes a row at most once, so its result is deterministic).
        for expert, count in enumerate(torch.bincount(picks, minlength=len(self.experts)).tolist()):
            if count == 0:
                continue
            take = rows[start : start + count]  # [n]
            y = self.experts[expert](flat[take]) * scale[start : start + count]  # [n, D]
            out.index_add_(0, take, y.to(out.dtype))
            start += count
        return out.view_as(x)


def experts_touched(logits: torch.Tensor, args: MoEArgs) -> int:
    """How many distinct experts the rows of `logits` [N, E] route to: what a forward over those rows reads."""
    _, chosen = route(logits, args)
    return int(chosen.unique().numel())


def split_fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors with experts fused per layer, as transformers >= 5 holds them in memory (and saves them
    with `save_original_format=False`, or hands them over from a GGUF file), split into the per-expert tensors of
    the Hub checkpoints: `...experts.gate_up_proj` [E, 2I, D] (gate rows first) and `...experts.down_proj` [E, D, I]
    become `...experts.{e}.gate_proj.weight` / `up_proj.weight` / `down_proj.weight`. Other names pass unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition("experts.")
        if prefix and leaf == "gate_up_proj":
            for e, fused in enumerate(tensor):  # fused [2I, D]
                gate, up = fused.chunk(2, dim=0)  # [I, D] each
                out[f"{prefix}experts.{e}.gate_proj.weight"] = gate
                out[f"{prefix}experts.{e}.up_proj.weight"] = up
        elif prefix and leaf == "down_proj":
            for e, down in enumerate(tensor):  # [D, I]
                out[f"{prefix}experts.{e}.down_proj.weight"] = down
        else:
            out[name] = tensor
    return out
