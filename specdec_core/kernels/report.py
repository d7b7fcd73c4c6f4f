"""What runs a built model, for logs and reports: the kernel path in a few words, and whether its rows are
computed batch-invariantly (what greedy speculation's bit-for-bit identity with plain decoding rests on)."""

from __future__ import annotations

import torch
from torch import nn

from specdec_core import environment
from specdec_core.kernels import fbgemm_rows, layers_quant
from specdec_core.kernels.layers import CPUAttention
from specdec_core.kernels.library import cpu_runs_kernels, load_library
from specdec_core.kernels.linear import FastCPULinear, Int4CPULinear, Int8CPULinear


def rows_batch_invariant(model: nn.Module) -> bool:
    """Whether every linear layer and the attention of `model` run on the CPU kernels (bf16, int8, or int4 without
    fbgemm's calls of many rows), which compute each row the same way whatever else is in the call: then a verify
    of k + 1 rows gives each row the logits a one-row decode gives, bit for bit, and greedy speculation reproduces
    plain decoding exactly. torch's own paths promise no such thing (their matmul and attention pick kernels by
    shape). Of this process's model only: split over more than two tensor-parallel ranks, the all-reduce's order of
    summation depends on the rows too."""
    kernel_linears = (FastCPULinear, Int8CPULinear, Int4CPULinear)
    has_torch_linear = any(type(m) is nn.Linear for m in model.modules())
    splits_rows = any(isinstance(m, Int4CPULinear) and m.int8_rows for m in model.modules())
    return (
        isinstance(getattr(model, "attention", None), CPUAttention)
        and not has_torch_linear
        and not splits_rows
        and any(isinstance(m, kernel_linears) for m in model.modules())
    )


def _int8_rows(layer: Int4CPULinear) -> str:
    """Where a 4-bit layer's calls of many rows go, as `kernel_path` says it."""
    start = fbgemm_rows.FROM_ROWS
    if layer.int8_kernel and layer.fbgemm_rows:
        return f" (int8 VNNI from {start} rows, fbgemm from {fbgemm_rows.INT8_KERNEL_MAX_ROWS + 1})"
    if layer.int8_kernel:
        return f" (int8 VNNI from {start} rows)"
    return f" (int8 fbgemm from {start} rows)" if layer.fbgemm_rows else ""


def kernel_path(model: nn.Module) -> str:
    """What runs `model`'s forward, in a few words: the CPU kernels in use ("bf16 AVX-512 (native bf16)", "bf16
    AVX2 (fp32 widening)", "int8 VNNI", "int4 AVX2 (int8 fbgemm from 5 rows), layers in one call"), or "torch
    fallback (why)"."""
    int8 = any(isinstance(m, Int8CPULinear) for m in model.modules())
    int4 = [m for m in model.modules() if isinstance(m, Int4CPULinear)]
    bf16 = any(isinstance(m, FastCPULinear) for m in model.modules())
    attention = isinstance(getattr(model, "attention", None), CPUAttention)
    if not (int8 or int4 or bf16 or attention):
        return f"torch fallback ({_why_torch(model)})"
    lib = load_library()
    native = bool(lib is not None and lib.specdec_has_native_bf16())
    isa = "AVX-512" if lib is not None and lib.specdec_has_avx512() else "AVX2"
    parts = [f"bf16 {isa} ({'native bf16' if native else 'fp32 widening'})"] if bf16 or attention else []
    if int8:
        parts.append("int8 VNNI" if lib is not None and lib.specdec_has_vnni() else f"int8 {isa}")
    if int4:  # written with AVX2 instructions whatever the build
        rows = _int8_rows(int4[0])
        parts.append(f"int4 AVX2{rows}")
    if isinstance(getattr(model, "run_layers", None), layers_quant.QuantLayers):
        parts[-1] += ", layers in one call"
    if any(type(m) is nn.Linear for m in model.modules()):
        parts.append("some linear layers on torch")
    if not attention:
        parts.append("torch attention")
    return " + ".join(parts)


def _why_torch(model: nn.Module) -> str:
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"device {param.device.type}"
    if param.dtype != torch.bfloat16:
        return f"{str(param.dtype).removeprefix('torch.')}: the kernels are bf16"
    if environment.cpu_kernels_disabled():
        return "SPECDEC_DISABLE_CPU_KERNELS is set"
    if not cpu_runs_kernels():
        return "neither AVX-512 nor AVX2 with FMA on this CPU"
    if load_library() is None:
        return "the kernels could not be built: no C compiler?"
    return "no layer swapped in: none has a shape the kernels take, or the model was not built by prepare_model"
