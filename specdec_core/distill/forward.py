"""A whole-sequence forward with no KV cache: what training and scoring need, through the served model's own code.

The model's attention backend is swappable (`Transformer.attention`); `CausalAttention` attends over the new tokens
themselves instead of a cache, so the same modules, norms and rotary tables that serve the draft are the ones
trained. Gradients flow through it (the cache's in-place writes would not allow that).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specdec_core.models.transformer import ForwardContext, Transformer, rotate_half


class CausalAttention:
    """Causal attention among the T tokens of each row; reads and writes no cache."""

    needs_tables = True  # the rotary tables, and the causal mask (by position) the model builds from them

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, layer: int
    ) -> torch.Tensor:
        # q [B, T, H, hd], k and v [B, T, Hkv, hd] -> [B, T, H, hd]
        assert ctx.cos is not None and ctx.sin is not None  # needs_tables: the model built the rotary tables
        q = q * ctx.cos + rotate_half(q) * ctx.sin
        k = k * ctx.cos + rotate_half(k) * ctx.sin
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=ctx.mask,
            enable_gqa=q.shape[2] != k.shape[2],
        )  # [B, H, T, hd]
        return out.transpose(1, 2)


def use_causal_attention(model: Transformer) -> Transformer:
    """Make `model` run whole sequences without a cache (mutates it; a model used so is not served). Refused for a
    model whose attention is not plain (a sliding window, another scale: Gemma 3), which `CausalAttention` would
    compute wrongly."""
    if not model.args.plain_attention:
        raise ValueError("distillation runs models with plain causal attention only (no sliding window, usual scale)")
    model.attention = CausalAttention()
    return model


def logits_at(model: torch.nn.Module, rows: Sequence[Sequence[int]], picks: Sequence[Sequence[int]]) -> torch.Tensor:
    """Logits after token `picks[b][j]` of row b, for every (b, j), in that order: [sum of len(picks[b]), V].

    `model` is a `Transformer` using `CausalAttention` (or a module wrapping one, as peft's does). Rows are padded
    at the end; a padded token sits after every real one, so the causal mask keeps it out of their logits.
    """
    B, T, N = len(rows), max(map(len, rows)), max(map(len, picks))
    tokens = torch.zeros(B, T, dtype=torch.long)  # [B, T]
    index = torch.zeros(B, N, dtype=torch.long)  # [B, N]
    valid = torch.zeros(B, N, dtype=torch.bool)  # [B, N]
    for b, (row, pick) in enumerate(zip(rows, picks)):
        tokens[b, : len(row)] = torch.tensor(row)
        index[b, : len(pick)] = torch.tensor(pick)
        valid[b, : len(pick)] = True
    device = next(model.parameters()).device
    positions = torch.arange(T, device=device).expand(B, T)  # [B, T]
    logits = model(tokens.to(device), positions, None, None, T, None, index.to(device))  # [B, N, V]
    return logits[valid.to(device)]  # [sum N_b, V]
