"""The kernels' parts of a decoder layer: attention (rotary embedding and attention in C, cache writes by torch),
RMSNorm, q/k/v and gate/up each fused into one linear layer, and the MLP's activation in one call."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from specdec_core.models.transformer import ForwardContext

from specdec_core.kernels.linear import FastCPULinear


class CPUAttention:
    """Attention backend for `Transformer.attention`: rotary embedding and attention by the C kernels, cache
    writes by torch."""

    needs_tables = False  # no mask, no cos/sin tables: the kernels work from positions

    def __init__(self, lib: ctypes.CDLL, inv_freq: torch.Tensor) -> None:
        self._lib = lib
        self.inv_freq = inv_freq.float().contiguous()  # [hd/2]
        self._forward: tuple[object, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def rows(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions [B*T], slots [B] and first positions [B] as the kernels read them (int64, contiguous):
        converted once per forward (`ctx` is the forward's), not once per layer."""
        if self._forward is None or self._forward[0] is not ctx:
            positions = ctx.positions.reshape(-1).to(torch.int64).contiguous()  # [B*T]
            slots = ctx.slots.to(torch.int64).contiguous()  # [B]
            starts = ctx.positions[:, 0].to(torch.int64).contiguous()  # [B]
            self._forward = (ctx, positions, slots, starts)
        return self._forward[1:]

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, layer: int
    ) -> torch.Tensor:  # q [B, T, H, hd] -> [B, T, H, hd]
        positions, slots, starts = self.rows(ctx)
        for x in (q, k):  # rotated in place: both are fresh outputs of the projections
            self._lib.specdec_rope_bf16(
                x.data_ptr(), positions.data_ptr(), self.inv_freq.data_ptr(), positions.numel(), x.shape[2], x.shape[3]
            )
        ctx.cache.write(layer, ctx.slots, ctx.positions, k, v, ctx.single)
        B, T, H, D = q.shape
        kc, vc = ctx.cache.keys[layer], ctx.cache.values[layer]  # [slots, Hkv, capacity, hd]
        q = q.contiguous()
        out = torch.empty_like(q)
        self._lib.specdec_attention_bf16(
            q.data_ptr(),
            kc.data_ptr(),
            vc.data_ptr(),
            slots.data_ptr(),
            starts.data_ptr(),
            out.data_ptr(),
            B,
            T,
            H,
            kc.shape[1],
            D,
            kc.shape[2],
            D**-0.5,
            torch.get_num_threads(),
        )
        return out


class FastRMSNorm(nn.Module):
    """RMSNorm in one C call (normalise in fp32, scale in bf16, as the reference rounds)."""

    def __init__(self, norm: nn.Module, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.weight, self.eps, self._lib = norm.weight, float(norm.eps), lib

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        dim = x.shape[-1]
        self._lib.specdec_rms_norm_bf16(
            x.data_ptr(), self.weight.data_ptr(), y.data_ptr(), x.numel() // dim, dim, self.eps
        )
        return y


def _fuse(linears: list[nn.Module]) -> nn.Linear:
    """One nn.Linear whose output is the outputs of `linears` side by side: one kernel call (and one pass of
    dispatch) instead of several. Each output row is computed exactly as in its own layer."""
    weight = torch.cat([m.weight.detach() for m in linears])  # [sum N, K]
    biases = [m.bias for m in linears]
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if biases[0] is not None:
        fused.bias = nn.Parameter(torch.cat([b.detach() for b in biases]), requires_grad=False)
    return fused


class FusedAttention(nn.Module):
    """`Attention` with q, k and v projected by one fused linear layer (same results, a third of the calls); its
    per-head q/k norms, where it has them, kept as they are."""

    def __init__(self, attn: nn.Module, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.qkv_proj = FastCPULinear(_fuse([attn.q_proj, attn.k_proj, attn.v_proj]), lib)
        self.o_proj = attn.o_proj
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self._split = [self.num_heads * self.head_dim, *[self.num_kv_heads * self.head_dim] * 2]

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:  # [B, T, D] -> [B, T, D]
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self._split, dim=-1)  # [B, T, H*hd], [B, T, Hkv*hd] x 2
        # Contiguous copies: the rotary kernel rotates q and k in place and assumes dense rows.
        q = q.reshape(B, T, self.num_heads, self.head_dim).contiguous()
        k = k.reshape(B, T, self.num_kv_heads, self.head_dim).contiguous()
        if self.q_norm is not None and self.k_norm is not None:  # fresh dense tensors too
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        out = ctx.attention(q, k, v, ctx, layer)  # [B, T, H, hd]
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class FastMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up in one fused linear and the activation in one C call."""

    def __init__(self, mlp: nn.Module, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.gate_up_proj = FastCPULinear(_fuse([mlp.gate_proj, mlp.up_proj]), lib)
        self.down_proj, self._lib = mlp.down_proj, lib
        self.width = mlp.gate_proj.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        gate_up = self.gate_up_proj(x)  # [..., 2I]: each row's gate then its up
        rows = gate_up.numel() // (2 * self.width)
        y = torch.empty(*x.shape[:-1], self.width, dtype=gate_up.dtype)  # [..., I]
        self._lib.specdec_silu_mul_bf16(gate_up.data_ptr(), y.data_ptr(), rows, self.width, torch.get_num_threads())
        return self.down_proj(y)
