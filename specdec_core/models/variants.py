"""Layer variants beside the Llama layout, each chosen by a `ModelArgs` feature (Gemma 3 uses all of them).

- `UnitOffsetRMSNorm`: RMSNorm scaling by (1 + weight), normalised *and scaled* in float32, rounded once at the end
  (Llama's norm rounds before scaling); its weights are stored centred on 0.
- `GatedMLP`: down(act(gate(x)) * up(x)) with another activation than SiLU (GeGLU: gelu, tanh approximation).
- `SandwichDecoderLayer`: besides the norm before attention, a norm on the attention's output, one before the MLP
  and one on the MLP's output (Gemma's names: post_attention_layernorm is the *output* norm here, not the MLP's
  input norm as in Llama).
- `softcap`: cap * tanh(x / cap), of the final logits where a config sets it.

Each is its own class, not the Llama module with a flag: the CPU kernels swap the Llama modules by exact type
(`kernels.surgery`), so these stay on torch's code paths rather than being computed as something else.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
}


class UnitOffsetRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        self.act = ACTIVATIONS[activation]
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class SandwichDecoderLayer(nn.Module):
    """x + post_attn(attn(in(x))), then + post_ff(mlp(pre_ff(x))); `norm()` builds each of the four norms."""

    def __init__(self, index: int, attn: nn.Module, mlp: nn.Module, norm: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.index = index
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(self, x: torch.Tensor, ctx: Any) -> torch.Tensor:  # [B, T, D] -> [B, T, D]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ctx, self.index))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), in x's dtype; -inf (a masked or cut logit) stays -inf."""
    return (torch.tanh(x / cap) * cap).masked_fill(x == float("-inf"), float("-inf"))


def scaled_embedding(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`x` times `scale` rounded to x's dtype first, as Gemma does (sqrt(3072) becomes 55.5 in bf16)."""
    return x * torch.tensor(scale, dtype=torch.float32).to(x.dtype).item()
