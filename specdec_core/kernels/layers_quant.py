"""A model's decoder layers in one C call (`layers_quant.c`): a quantized draft's steps, a bf16 target's forwards.

Why: a small draft's step spends a large share of its time dispatching its hundred kernel calls through torch
modules and ctypes, not in them; and a target's forward, called back to back from C, ran faster than through the
modules by more than its time outside the kernels (docs/benchmarks.md). `QuantLayers` replaces the model's loop over
its layers (`Transformer.run_layers`) by one call that runs the same kernels in the same order, so the logits are
bit for bit those of the module-by-module forward; calls the one-call path cannot take (a 4-bit draft's rows that
go to fbgemm, `fbgemm_rows.FROM_ROWS` and more) take the loop. Installed by `use_cpu_kernels` (bf16) and by
`quantize_draft_int4` / `quantize_draft_int8` where every layer has the shape the C code knows (fused q/k/v and
gate/up, every linear bf16, every one 4-bit or every one int8, the CPU norms and attention; not a tensor-parallel
shard, whose row-parallel layers all-reduce), else not at all.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn

from specdec_core.kernels import fbgemm_rows


class Linear(ctypes.Structure):
    _fields_ = [
        ("bits", ctypes.c_int64),
        ("weight", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("row_sums", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("weight8", ctypes.c_void_p),
        ("int8_from", ctypes.c_int64),
    ]


class Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", Linear),
        ("o", Linear),
        ("gate_up", Linear),
        ("down", Linear),
    ]


class Dims(ctypes.Structure):
    _fields_ = [
        ("D", ctypes.c_int64),
        ("H", ctypes.c_int64),
        ("Hkv", ctypes.c_int64),
        ("hd", ctypes.c_int64),
        ("I", ctypes.c_int64),
        ("capacity", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("inv_freq", ctypes.c_void_p),
    ]


def declare(lib: ctypes.CDLL) -> None:
    """`specdec_layers_quant`'s signature: (layers, keys, values, L, dims, x, positions, slots, starts, B, T,
    threads)."""
    lib.specdec_layers_quant.argtypes = (
        [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    )


def _linear(layer: Any, bits: int) -> Linear:
    """A `FastCPULinear` (bits 16: bf16 weights), an `Int4CPULinear` (bits 4: scales packed with the weights; with
    its int8 weights for calls of many rows where it has them) or an `Int8CPULinear` (bits 8) as C reads it."""
    bias = None if layer.bias is None else layer.bias.data_ptr()
    if bits == 16:
        return Linear(16, layer.weight.data_ptr(), None, None, bias, None, 0)
    if bits == 8:
        return Linear(8, layer.qweight.data_ptr(), layer.scale.data_ptr(), layer.row_sums.data_ptr(), bias, None, 0)
    if layer.int8_kernel:
        int8 = (layer.scale8.data_ptr(), layer.row_sums8.data_ptr(), bias, layer.qweight8.data_ptr())
        return Linear(4, layer.qweight.data_ptr(), *int8, fbgemm_rows.FROM_ROWS)
    return Linear(4, layer.qweight.data_ptr(), None, None, bias, None, 0)


def _max_rows(linear: nn.Module) -> int | None:
    """The most rows the one call takes (None: any): rows that fbgemm would take (`Int4CPULinear.forward`) go
    through the loop, so that they get the results the layers' own calls give them."""
    if not getattr(linear, "fbgemm_rows", False):
        return None
    rows: int = linear.kernel_max_rows
    return rows


class QuantLayers:
    """`Transformer.run_layers` for a model whose linears are all bf16 (`bits` 16), all 4-bit (4) or all int8 (8),
    on the CPU kernels: (layers, x [B, T, D], ctx) -> [B, T, D]. `fallback`: the loop, for calls it cannot take."""

    def __init__(self, model: nn.Module, lib: ctypes.CDLL, attention: Any, fallback: Any, bits: int) -> None:
        self._lib, self._attention, self._fallback = lib, attention, fallback
        args, layers = model.args, model.layers
        self._layers = (Layer * len(layers))(*(self._layer(layer, bits) for layer in layers))
        self._inv_freq = attention.inv_freq  # [hd / 2] fp32, held: the C code reads it
        self._shape = (args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim, args.intermediate_size)
        self._eps = float(layers[0].input_layernorm.eps)
        self._held = list(model.buffers()) + list(model.parameters())  # what the pointers point into
        self._max_rows = _max_rows(layers[0].mlp.down_proj)
        self._cache: tuple[Any, Any, Any, Any] | None = None

    @property
    def fallback(self) -> Any:
        """The loop this replaces (what to put back when the model's linears change)."""
        return self._fallback

    @staticmethod
    def _layer(layer: nn.Module, bits: int) -> Layer:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return Layer(
            layer.input_layernorm.weight.data_ptr(),
            layer.post_attention_layernorm.weight.data_ptr(),
            *(_linear(linear, bits) for linear in linears),
        )

    def _cache_pointers(self, cache: Any) -> tuple[Any, Any, Any]:
        """The cache's per-layer key and value pointers and its dims, built once per cache (a KVCache keeps its
        tensors for life). Engines sharing the model with caches of their own rebuild them on each switch."""
        held = self._cache
        if held is None or held[0] is not cache:
            L = len(self._layers)
            keys = (ctypes.c_void_p * L)(*(k.data_ptr() for k in cache.keys))
            values = (ctypes.c_void_p * L)(*(v.data_ptr() for v in cache.values))
            D, H, Hkv, hd, inter = self._shape
            dims = Dims(D, H, Hkv, hd, inter, cache.capacity, self._eps, hd**-0.5, self._inv_freq.data_ptr())
            held = self._cache = (cache, keys, values, dims)
        return held[1:]

    def __call__(self, layers: nn.ModuleList, x: torch.Tensor, ctx: Any) -> torch.Tensor:  # [B, T, D]
        B, T, _ = x.shape
        if (
            ctx.attention is not self._attention
            or x.dtype != torch.bfloat16
            or x.requires_grad
            or (self._max_rows is not None and B * T > self._max_rows)
        ):
            return self._fallback(layers, x, ctx)  # autograd, like torch's own paths, goes through the modules
        positions, slots, starts = self._attention.rows(ctx)
        keys, values, dims = self._cache_pointers(ctx.cache)
        x = x.clone(memory_format=torch.contiguous_format)  # [B, T, D], one dense copy: updated in place
        self._lib.specdec_layers_quant(
            ctypes.addressof(self._layers),
            ctypes.addressof(keys),
            ctypes.addressof(values),
            len(self._layers),
            ctypes.addressof(dims),
            x.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            starts.data_ptr(),
            B,
            T,
            torch.get_num_threads(),
        )
        return x
