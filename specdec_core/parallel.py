"""Tensor parallelism: Megatron-style sharding of a built `Transformer` over the ranks of a process group.

Each rank keeps 1/N of every layer: q/k/v and gate/up are split by output (column parallel: whole heads, whole
MLP channels), o and down by input (row parallel), and the partial outputs of o and down are summed with one
all-reduce each. So a layer costs two all-reduces of [B, T, D] activations, and nothing else crosses ranks.

- KV heads are split like the query heads when there are at least as many as ranks. With fewer, each rank keeps
  the one KV head its query heads read (a replica shared with the neighbouring ranks): GQA groups never straddle
  ranks, so attention stays local.
- Embeddings, norms and the LM head are replicated. They are a small part of the work per token; splitting the
  LM head over the vocabulary would add an all-gather of the logits to every forward, and every rank needs the
  full logits anyway: each rank runs the same acceptance on them, which is what keeps the ranks' KV caches
  rolled back together without any further messages.

Why not torch's DTensor `parallelize_module`: our CPU kernels (`kernels.surgery`) take plain local tensors, and the
KV cache is written by position with local head counts; DTensor's per-op dispatch would bypass the former and
add overhead to every decode step. The sharding here produces plain modules with local shapes and uses
torch.distributed's all-reduce, so everything downstream (kernels, cache, runner) works unchanged.

Apply `shard_model` to a freshly loaded model *before* `kernels.surgery.use_cpu_kernels`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from specdec_core.errors import InvalidArgument
from specdec_core.models.transformer import ModelArgs, Transformer


class RowParallelLinear(nn.Module):
    """A linear layer holding a slice of the input features; the ranks' partial outputs are summed."""

    collective_seconds = 0.0  # wall time in all-reduces, all layers of this process (read by benchmarks)

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        start = time.perf_counter()
        dist.all_reduce(y, group=self.group)
        RowParallelLinear.collective_seconds += time.perf_counter() - start
        return y


def check_shardable(args: ModelArgs, world_size: int) -> None:
    """`InvalidArgument` naming tensor_parallel_size unless the model splits evenly over `world_size` ranks."""
    field = "tensor_parallel_size"
    if world_size < 1:
        raise InvalidArgument(field, f"must be >= 1, got {world_size}")
    if args.num_heads % world_size:
        raise InvalidArgument(field, f"{world_size} does not divide the model's {args.num_heads} attention heads")
    kv = args.num_kv_heads
    if kv >= world_size and kv % world_size:
        raise InvalidArgument(field, f"{world_size} does not divide the model's {kv} key/value heads")
    if kv < world_size and world_size % kv:
        raise InvalidArgument(field, f"{world_size} is not a multiple of the model's {kv} key/value heads")
    if args.intermediate_size % world_size:
        raise InvalidArgument(field, f"{world_size} does not divide the MLP width {args.intermediate_size}")
    if args.moe is not None and world_size > 1:
        raise InvalidArgument(field, "mixture-of-experts models are not sharded: serve them on one rank")


def shard_model(model: Transformer, rank: int, world_size: int, group: dist.ProcessGroup | None = None) -> Transformer:
    """Keep this rank's shard of every layer (in place); returns the model."""
    args = model.args
    check_shardable(args, world_size)
    if world_size == 1:
        return model
    hd = args.head_dim
    heads = args.num_heads // world_size
    kv_heads, kv_first = _kv_share(args.num_kv_heads, rank, world_size)
    inter = args.intermediate_size // world_size
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = _rows(attn.q_proj, rank * heads * hd, heads * hd)
        attn.k_proj = _rows(attn.k_proj, kv_first * hd, kv_heads * hd)
        attn.v_proj = _rows(attn.v_proj, kv_first * hd, kv_heads * hd)
        attn.o_proj = RowParallelLinear(_columns(attn.o_proj, rank * heads * hd, heads * hd), group)
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
        mlp.gate_proj = _rows(mlp.gate_proj, rank * inter, inter)
        mlp.up_proj = _rows(mlp.up_proj, rank * inter, inter)
        mlp.down_proj = RowParallelLinear(_columns(mlp.down_proj, rank * inter, inter), group)
    return model


def _kv_share(num_kv: int, rank: int, world_size: int) -> tuple[int, int]:
    """(KV heads this rank keeps, index of the first)."""
    if num_kv >= world_size:
        local = num_kv // world_size
        return local, rank * local
    return 1, rank // (world_size // num_kv)


def _rows(linear: nn.Linear, start: int, count: int) -> nn.Linear:
    """Output features [start, start + count) of `linear` (column parallel)."""
    out = nn.Linear(linear.in_features, count, bias=linear.bias is not None, device="meta")
    out.weight = nn.Parameter(linear.weight.detach()[start : start + count].clone(), requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias.detach()[start : start + count].clone(), requires_grad=False)
    return out


def _columns(linear: nn.Linear, start: int, count: int) -> nn.Linear:
    """Input features [start, start + count) of `linear` (row parallel; a bias would be added on one rank only)."""
    if linear.bias is not None:
        raise ValueError("row-parallel layers with a bias are not supported")
    out = nn.Linear(count, linear.out_features, bias=False, device="meta")
    out.weight = nn.Parameter(linear.weight.detach()[:, start : start + count].contiguous(), requires_grad=False)
    return out
