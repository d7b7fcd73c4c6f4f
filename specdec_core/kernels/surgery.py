"""The switch that puts the CPU kernels into a built model: bf16 decoding and verification, and the draft's int8 and
4-bit weights.

Why: on CPUs without native bf16 instructions, torch's bf16 matmul costs grow linearly with the number of rows,
so verifying k+1 tokens costs k+1 decode steps and speculation cannot pay; and its bf16 attention is slowest
for the single query row of decoding. `gemm.c` streams each weight once for all rows; `attention_bf16.c`
attends in fp32, loading each cached key and value once for all the query rows of its head. Both compute a row
the same way whatever else is in the batch, so verification reproduces plain decoding bit for bit. They are
compiled on first use with the system C compiler for this CPU's vector instructions, AVX-512 or else AVX2 with FMA
(`bf16.h`), and cached in a private directory, checked before every load (`library.py`); where that is impossible
(no compiler, neither instruction set, a cache directory refused) the model keeps torch's code paths. The layers
themselves are in `linear.py` and `layers.py`; `report.py` says what runs a built model.

Like tensor parallelism, this is a transformation of a built model: the model code knows nothing of it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import nn

from specdec_core.kernels import layers_quant
from specdec_core.kernels.layers import CPUAttention, FastMLP, FastRMSNorm, FusedAttention
from specdec_core.kernels.library import INT4_K_MULTIPLE, INT8_K_MULTIPLE, K_MULTIPLE, load_library
from specdec_core.kernels.linear import FastCPULinear, Int4CPULinear, Int8CPULinear


def use_cpu_kernels(model: nn.Module) -> int:
    """Swap in the CPU kernels where they apply; return how many linear layers were swapped.

    Linear layers: bf16 weights on the CPU, contiguous, in_features a multiple of 16 and out_features a multiple
    of the kernel's block. Attention (and with it the fused norms, q/k/v and MLP): a bf16 CPU model whose head dim
    is a multiple of 16 and whose attention is plain (`ModelArgs.plain_attention`: no sliding window, the usual
    scale). Elsewhere the linear layers alone: Gemma 3's windowed attention, (1 + weight) norms,
    GeGLU and sandwich norms stay on torch's code paths. A no-op (returns 0) where the kernels cannot run.
    """
    lib = load_library()
    if lib is None:
        return 0
    swapped = _swap_linears(model, lib)
    args = getattr(model, "args", None)
    param = next(model.parameters())
    if (
        args is not None
        and args.plain_attention
        and param.dtype == torch.bfloat16
        and param.device.type == "cpu"
        and args.head_dim % 16 == 0
        and args.head_dim <= lib.specdec_attention_max_head_dim()
    ):
        model.attention = CPUAttention(lib, model.inv_freq)
        _swap_layer_parts(model, lib)
        _run_layers_in_one_call(model, lib)
    return swapped


def quantize_draft_int8(model: nn.Module) -> int:
    """Replace the linear layers of a bf16 CPU *draft* model by int8 ones; return how many. 0 if unavailable
    (no kernels, or AVX-512 kernels on a CPU without VNNI). Where every decoder layer then runs on the kernels, its
    steps run in one call (`layers_quant.py`)."""
    lib = load_library()
    if lib is None or not lib.specdec_has_int8():
        return 0
    swapped = _quantize_linears(model, lambda linear: Int8CPULinear(linear, lib), lib, INT8_K_MULTIPLE)
    _run_layers_in_one_call(model, lib)
    return swapped


def quantize_draft_int4(model: nn.Module) -> int:
    """Replace the linear layers of a bf16 CPU *draft* model by 4-bit ones; return how many (0 without kernels).
    Where every decoder layer then runs on the kernels, its steps of a few rows run in one call
    (`layers_quant.py`)."""
    lib = load_library()
    if lib is None:
        return 0
    swapped = _quantize_linears(model, lambda linear: Int4CPULinear(linear, lib), lib, INT4_K_MULTIPLE)
    _run_layers_in_one_call(model, lib)
    return swapped


def _run_layers_in_one_call(model: nn.Module, lib: ctypes.CDLL) -> None:
    """Where every decoder layer is what `layers_quant.c` computes (the CPU norms and attention, q/k/v and gate/up
    fused, every linear of one kind: bf16, 4-bit or int8, all with fbgemm rows or none), its forwards run in one
    call. Called again after the linears change (a draft quantized after its bf16 kernels): a one call built over
    the old ones is put back to the loop first."""
    from specdec_core.models.transformer import DecoderLayer, run_in_turn

    if isinstance(getattr(model, "run_layers", None), layers_quant.QuantLayers):
        model.run_layers = model.run_layers.fallback
    if not isinstance(getattr(model, "attention", None), CPUAttention) or model.run_layers is not run_in_turn:
        return
    linears: list[nn.Module] = []
    for layer in model.layers:
        if not (
            type(layer) is DecoderLayer
            and type(layer.input_layernorm) is FastRMSNorm
            and type(layer.post_attention_layernorm) is FastRMSNorm
            and type(layer.self_attn) is FusedAttention
            and layer.self_attn.q_norm is None  # the one call has no per-head q/k norm
            and type(layer.mlp) is FastMLP  # nor experts
        ):
            return
        linears += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    kinds = {type(m) for m in linears}
    bits = {FastCPULinear: 16, Int8CPULinear: 8, Int4CPULinear: 4}.get(kinds.pop()) if len(kinds) == 1 else None
    if bits is not None and len({getattr(m, "int8_rows", False) for m in linears}) == 1:
        model.run_layers = layers_quant.QuantLayers(model, lib, model.attention, model.run_layers, bits)


def _quantize_linears(
    model: nn.Module, make: Callable[[nn.Linear], nn.Module], lib: ctypes.CDLL, k_multiple: int
) -> int:
    block = lib.specdec_block_rows()
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FastCPULinear):
                child = _as_linear(child)
            if _eligible(child, block, k_multiple):
                setattr(parent, name, make(child))
                swapped += 1
    return swapped


def _as_linear(fast: FastCPULinear) -> nn.Linear:
    linear = nn.Linear(fast.in_features, fast.out_features, bias=fast.bias is not None, device="meta")
    linear.weight, linear.bias = fast.weight, fast.bias
    return linear


def _swap_layer_parts(model: nn.Module, lib: ctypes.CDLL) -> None:
    """Norms first (the per-head q/k norms among them), so that a fused attention takes over the kernel norms. An MoE
    block keeps its torch routing; each expert is an `MLP` and is swapped like any other."""
    from specdec_core.models.transformer import MLP, Attention, RMSNorm

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is RMSNorm and child.weight.dtype == torch.bfloat16:
                setattr(parent, name, FastRMSNorm(child, lib))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is MLP and _all_fast(child.gate_proj, child.up_proj):
                setattr(parent, name, FastMLP(child, lib))
            elif type(child) is Attention and _all_fast(child.q_proj, child.k_proj, child.v_proj):
                setattr(parent, name, FusedAttention(child, lib))


def _all_fast(*linears: nn.Module) -> bool:
    """Fusable: every part already runs on the kernel (eligible bf16 weights)."""
    return all(isinstance(m, FastCPULinear) for m in linears)


def _swap_linears(model: nn.Module, lib: ctypes.CDLL) -> int:
    block = lib.specdec_block_rows()
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _eligible(child, block):
                setattr(parent, name, FastCPULinear(child, lib))
                swapped += 1
    return swapped


def _eligible(module: nn.Module, block: int, k_multiple: int = K_MULTIPLE) -> bool:
    if type(module) is not nn.Linear:
        return False
    w = module.weight
    return (
        w.dtype == torch.bfloat16
        and w.device.type == "cpu"
        and w.is_contiguous()
        and module.in_features % k_multiple == 0
        and module.out_features % block == 0
    )
