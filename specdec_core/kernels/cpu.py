"""CPU kernels for bf16 decoding and verification, and the switch that puts them into a built model.

Why: on CPUs without native bf16 instructions, torch's bf16 matmul costs grow linearly with the number of rows,
so verifying k+1 tokens costs k+1 decode steps and speculation cannot pay; and its bf16 attention is slowest
for the single query row of decoding. `gemm.c` streams each weight once for all rows; `attention_bf16.c`
attends in fp32, loading each cached key and value once for all the query rows of its head. Both compute a row
the same way whatever else is in the batch, so verification reproduces plain decoding bit for bit. They are compiled on first use with the system C compiler
for this CPU's vector instructions, AVX-512 or else AVX2 with FMA (`bf16.h`), and cached in a private directory,
checked before every load (`library.py`); where that is impossible (no compiler, neither instruction set, a cache
directory refused) the model keeps torch's code paths.

Like tensor parallelism, this is a transformation of a built model: the model code knows nothing of it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from specdec_core import environment
from specdec_core.hardware import AVX2_FLAGS, AVX512_FLAGS
from specdec_core.kernels import fbgemm_rows, layers_quant, library

log = logging.getLogger(__name__)

_K_MULTIPLE = 32  # gemm.c's KV: in_features must be a multiple (checked against the library when it loads)
_INT8_K_MULTIPLE = 64  # gemm_int8.c's KB
_INT4_GROUP = 32  # gemm_int4.c's G: weights per scale
_INT4_K_MULTIPLE = 64  # in_features: two groups a step
_INT4_PANEL = 8  # gemm_int4.c's PANEL: output rows interleaved in one weight stream

SOURCES = [
    Path(__file__).with_name(name)
    for name in ("gemm.c", "gemm_int8.c", "gemm_int4.c", "attention_bf16.c", "elementwise_bf16.c", "layers_quant.c")
]
HEADERS = [Path(__file__).with_name(name) for name in ("bf16.h", "int8_rows.h")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


def _cpu_flags() -> frozenset[str]:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in info.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def _cpu_runs_kernels() -> bool:
    """The kernels build for AVX-512 (F, BW) or, without it, for AVX2 with FMA."""
    flags = _cpu_flags()
    return AVX512_FLAGS <= flags or AVX2_FLAGS <= flags


def library_spec() -> library.LibrarySpec:
    """The kernels' build: the sources, the flags (with `$SPECDEC_KERNEL_CFLAGS`) and this CPU's features, since
    -march=native builds for the compiling CPU and a library built on one may not run on another."""
    return library.LibrarySpec(
        name="libspecdec_cpu",
        sources=tuple(SOURCES),
        headers=tuple(HEADERS),
        flags=(*FLAGS, *environment.kernel_cflags()),
        libraries=("-lm",),
        context=" ".join(sorted(_cpu_flags())),
    )


def kernel_compiler() -> str | None:
    """The C compiler the kernels are built with (`$CC`, else cc, else gcc); None where there is none."""
    return shutil.which(environment.c_compiler()) or shutil.which("gcc")


@lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """Compile (once per source, compiler and flags) and load the kernels; None when this machine cannot run them."""
    if environment.cpu_kernels_disabled() or not _cpu_runs_kernels():
        return None
    compiler = kernel_compiler()
    if compiler is None:
        log.warning("no C compiler found: CPU bf16 kernels disabled (decoding works, slower)")
        return None
    try:
        lib = library.load(library_spec(), compiler, environment.kernel_dir())
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("CPU bf16 kernels unavailable (%s): using torch's matmul", exc)
        return None
    _declare(lib)
    if lib.specdec_k_multiple() != _K_MULTIPLE:
        raise RuntimeError("gemm.c and cpu.py disagree on the K multiple")
    if lib.specdec_int4_k_multiple() != _INT4_K_MULTIPLE:
        raise RuntimeError("gemm_int4.c and cpu.py disagree on the K multiple")
    if lib.specdec_int4_row_multiple() != _INT4_PANEL or lib.specdec_block_rows() % _INT4_PANEL:
        raise RuntimeError("gemm_int4.c's panels and cpu.py (or gemm.c's blocks of rows) disagree")
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """The C signatures. The kernels that allocate scratch memory return a status, checked on every call."""
    lib.specdec_gemm_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.specdec_gemm_w8a8.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.specdec_gemm_w4a8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.specdec_attention_bf16.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]
    layers_quant.declare(lib)
    for fn in ("specdec_gemm_bf16", "specdec_gemm_w8a8", "specdec_gemm_w4a8", "specdec_attention_bf16",
               "specdec_layers_quant"):
        getattr(lib, fn).restype = ctypes.c_int
        getattr(lib, fn).errcheck = _check_status
    lib.specdec_rms_norm_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    lib.specdec_rope_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    lib.specdec_silu_mul_bf16.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.specdec_exp_f32.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64]
    lib.specdec_rows_span.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
    lib.specdec_rows_finish.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2
    for fn in ("specdec_rms_norm_bf16", "specdec_rope_bf16", "specdec_silu_mul_bf16", "specdec_exp_f32",
               "specdec_rows_span", "specdec_rows_finish"):
        getattr(lib, fn).restype = None
    for fn in ("specdec_block_rows", "specdec_k_multiple", "specdec_has_vnni", "specdec_has_int8",
               "specdec_int4_k_multiple", "specdec_int4_row_multiple",
               "specdec_has_native_bf16", "specdec_has_avx512", "specdec_attention_max_head_dim"):
        getattr(lib, fn).restype = ctypes.c_int


def _check_status(status: int, func, args) -> int:
    """ctypes errcheck: a kernel returns 0, or an errno value (ENOMEM: its scratch memory could not be allocated)."""
    if status == errno.ENOMEM:
        raise MemoryError(f"{func.__name__}: could not allocate its scratch memory")
    if status:
        raise RuntimeError(f"{func.__name__} failed: {os.strerror(status)}")
    return status


def kernel_info() -> dict[str, bool]:
    """Which kernels this machine runs (for benchmark reports: the same code is faster with native bf16)."""
    lib = load_library()
    return {
        "cpu_kernels": lib is not None,
        "avx512": bool(lib is not None and lib.specdec_has_avx512()),
        "native_bf16": bool(lib is not None and lib.specdec_has_native_bf16()),
        "vnni": bool(lib is not None and lib.specdec_has_vnni()),
        "int8": bool(lib is not None and lib.specdec_has_int8()),
    }


class FastCPULinear(nn.Module):
    """A bf16 `nn.Linear` run by the streaming kernel (measured faster than torch's bf16 GEMM at every row count
    we tried, 1 to 128: it is built for few rows, and still reads each weight once per block of rows)."""

    def __init__(self, linear: nn.Linear, lib: ctypes.CDLL) -> None:
        super().__init__()
        _check_shape(linear, lib, _K_MULTIPLE)
        self.weight = linear.weight  # [N, K] bf16, shared with the original module
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._lib = lib
        self._call = _KernelCall(lib.specdec_gemm_bf16, (linear.weight.detach(),), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if x.dtype != torch.bfloat16 or x.requires_grad:
            return nn.functional.linear(x, self.weight, self.bias)
        return self._call(x, self.out_features)


class Int8CPULinear(nn.Module):
    """A linear layer with int8 weights and int8 activations for *draft* models on the CPU (`gemm_int8.c`).

    Weights: symmetric per output row, w ~= scale[n] * q[n, k], q in [-127, 127]; activations are quantized
    per row on each call. Only ever used for drafting, where precision moves the acceptance rate, not the
    output.
    """

    def __init__(self, linear: nn.Linear, lib: ctypes.CDLL) -> None:
        super().__init__()
        _check_shape(linear, lib, _INT8_K_MULTIPLE)
        w = linear.weight.detach().float()  # [N, K]
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [N]
        q = torch.round(w / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8)  # [N, K]
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale.contiguous())
        self.register_buffer("row_sums", q.sum(dim=1, dtype=torch.int32).contiguous())  # [N]
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).contiguous()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._lib = lib
        self._call = _KernelCall(lib.specdec_gemm_w8a8, (self.qweight, self.scale, self.row_sums), self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] bf16 -> [..., N] bf16
        return self._call(x.to(torch.bfloat16), self.out_features)  # a no-op for bf16 x


class Int4CPULinear(nn.Module):
    """A linear layer with 4-bit weights and int8 activations for *draft* models on the CPU (`gemm_int4.c`).

    Weights: symmetric in groups of 32 along k, w ~= scale[n, g] * q[n, k], q in [-7, 7], fp16 scales; packed two
    to a byte with the scales in the same stream (`gemm_int4.c`'s layout). Activations are quantized per row on
    each call. A call of many rows (reading a context, several sequences' steps) runs int8 weights through fbgemm
    instead where torch has it (`fbgemm_rows.py`: bound by multiply-adds, not bytes, such a call ran up to 1.8x
    faster there). Only ever used for drafting, where precision moves the acceptance rate, not the output.
    """

    def __init__(self, linear: nn.Linear, lib: ctypes.CDLL) -> None:
        super().__init__()
        _check_shape(linear, lib, _INT4_K_MULTIPLE)
        q, scale = quantize_int4(linear.weight.detach())
        self.register_buffer("qweight", pack_int4(q, scale))  # [N, K/64 * 36] uint8
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).contiguous()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._lib = lib
        self._call = _KernelCall(lib.specdec_gemm_w4a8, (self.qweight,), self.bias)
        self._rows = fbgemm_rows.Int8Rows(linear, lib) if fbgemm_rows.available() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] bf16 -> [..., N] bf16
        x = x.to(torch.bfloat16)  # a no-op for bf16 x
        if self._rows is not None and x.numel() >= fbgemm_rows.FROM_ROWS * x.shape[-1]:
            return self._rows(x)
        return self.kernel(x)

    @property
    def int8_rows(self) -> bool:
        """Whether calls of `fbgemm_rows.FROM_ROWS` rows or more run on fbgemm (then a row's result depends on how
        many rows share its call)."""
        return self._rows is not None

    def kernel(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] bf16 -> [..., N] bf16
        """The 4-bit kernel, whatever the number of rows (`forward` gives it calls of few rows)."""
        return self._call(x, self.out_features)


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, K] -> ([N, K] int8, [N, K/G] fp16)
    """Symmetric 4-bit quantization in groups of `_INT4_GROUP` along k: w ~= scale[n, g] * q[n, k], q in [-7, 7],
    each scale max|group| / 7 rounded to fp16 (q is rounded against the fp16 scale). A group too small for fp16
    (a scale below its smallest value) or all zero gets q = 0."""
    N, K = w.shape
    groups = w.float().view(N, K // _INT4_GROUP, _INT4_GROUP)  # [N, K/G, G]
    scale = (groups.abs().amax(dim=-1) / 7.0).clamp(max=torch.finfo(torch.float16).max).half()  # [N, K/G]
    zero = scale == 0
    scale = torch.where(zero, torch.ones_like(scale), scale)  # any scale: q = 0 there
    q = torch.round(groups / scale.float().unsqueeze(-1)).clamp(-7, 7)  # [N, K/G, G]
    q = torch.where(zero.unsqueeze(-1), torch.zeros_like(q), q).to(torch.int8)
    return q.view(N, K), scale.contiguous()


def pack_int4(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # [N, K] int8, [N, K/G] fp16 -> [N, K/64*36]
    """`gemm_int4.c`'s layout: rows in panels of 8, a panel's 64 weights of k as a block of 288 bytes: 8 vectors of
    32 bytes (vector j's byte 4r + t holds q[r, 4j + t] + 8 in its low nibble and q[r, 32 + 4j + t] + 8 in its high
    one), then the 8 rows' fp16 scales of the first group and those of the second. Shaped [N, K/64*36] (the bytes
    a row costs); the rows of a panel interleave."""
    N, K = q.shape
    P, H = N // _INT4_PANEL, K // 64
    u = (q.to(torch.int16) + 8).to(torch.uint8).view(P, _INT4_PANEL, H, 2, 8, 4)  # [panel, row, block, group, j, t]
    nibbles = (u[:, :, :, 0] | (u[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # [P, H, j, row, t]
    scales = scale.contiguous().view(P, _INT4_PANEL, H, 2).permute(0, 2, 3, 1).contiguous()  # [P, H, group, row]
    blocks = torch.cat([nibbles.reshape(P, H, -1), scales.view(torch.uint8).reshape(P, H, -1)], dim=-1)
    return blocks.reshape(N, H * 36).contiguous()


def _check_shape(linear: nn.Linear, lib: ctypes.CDLL, k_multiple: int) -> None:
    if linear.in_features % k_multiple:
        raise ValueError(f"in_features {linear.in_features} is not a multiple of {k_multiple}")
    if linear.out_features % lib.specdec_block_rows():
        raise ValueError(f"out_features {linear.out_features} is not a multiple of {lib.specdec_block_rows()}")


class _KernelCall:
    """A gemm kernel bound to its weight tensors: (x, *weights, bias, y, M, N, K, threads) -> y.

    A decode step makes about a hundred of these calls, and looking a module's parameters and buffers up on each
    (nn.Module's attribute lookup) took about 0.75 ms of a draft step of the 0.5B model under a profiler. The
    pointers are read once here; the tensors are held with them, so they stay valid whatever happens to the
    module's attributes."""

    def __init__(self, kernel, weights: tuple[torch.Tensor, ...], bias: torch.Tensor | None) -> None:
        self._kernel = kernel
        self._held = (*weights, bias)  # keeps the memory behind the pointers alive
        self._pointers = tuple(w.data_ptr() for w in weights)
        self._bias = None if bias is None else bias.data_ptr()

    def __call__(self, x: torch.Tensor, out_features: int) -> torch.Tensor:  # bf16 [..., K] -> bf16 [..., N]
        K = x.shape[-1]
        x2 = x.reshape(-1, K).contiguous()  # [M, K]
        y = torch.empty(*x.shape[:-1], out_features, dtype=torch.bfloat16)  # [..., N]
        self._kernel(x2.data_ptr(), *self._pointers, self._bias, y.data_ptr(), x2.shape[0], out_features, K,
                     torch.get_num_threads())
        return y


def quantize_draft_int8(model: nn.Module) -> int:
    """Replace the linear layers of a bf16 CPU *draft* model by int8 ones; return how many. 0 if unavailable
    (no kernels, or AVX-512 kernels on a CPU without VNNI). Where every decoder layer then runs on the kernels, its
    steps run in one call (`layers_quant.py`)."""
    lib = load_library()
    if lib is None or not lib.specdec_has_int8():
        return 0
    swapped = _quantize_linears(model, lambda linear: Int8CPULinear(linear, lib), lib, _INT8_K_MULTIPLE)
    _run_layers_in_one_call(model, lib)
    return swapped


def quantize_draft_int4(model: nn.Module) -> int:
    """Replace the linear layers of a bf16 CPU *draft* model by 4-bit ones; return how many (0 without kernels).
    Where every decoder layer then runs on the kernels, its steps of a few rows run in one call
    (`layers_quant.py`)."""
    lib = load_library()
    if lib is None:
        return 0
    swapped = _quantize_linears(model, lambda linear: Int4CPULinear(linear, lib), lib, _INT4_K_MULTIPLE)
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
    linears = []
    for layer in model.layers:
        if not (type(layer) is DecoderLayer and type(layer.input_layernorm) is FastRMSNorm
                and type(layer.post_attention_layernorm) is FastRMSNorm and type(layer.self_attn) is FusedAttention
                and type(layer.mlp) is FastMLP):
            return
        linears += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    kinds = {type(m) for m in linears}
    bits = {FastCPULinear: 16, Int8CPULinear: 8, Int4CPULinear: 4}.get(kinds.pop()) if len(kinds) == 1 else None
    if bits is not None and len({getattr(m, "int8_rows", False) for m in linears}) == 1:
        model.run_layers = layers_quant.QuantLayers(model, lib, model.attention, model.run_layers, bits)


def _quantize_linears(model: nn.Module, make, lib: ctypes.CDLL, k_multiple: int) -> int:
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


def _as_linear(fast: "FastCPULinear") -> nn.Linear:
    linear = nn.Linear(fast.in_features, fast.out_features, bias=fast.bias is not None, device="meta")
    linear.weight, linear.bias = fast.weight, fast.bias
    return linear


class CPUAttention:
    """Attention backend for `Transformer.attention`: rotary embedding and attention by the C kernels, cache
    writes by torch."""

    needs_tables = False  # no mask, no cos/sin tables: the kernels work from positions

    def __init__(self, lib: ctypes.CDLL, inv_freq: torch.Tensor) -> None:
        self._lib = lib
        self.inv_freq = inv_freq.float().contiguous()  # [hd/2]
        self._forward: tuple[object, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def rows(self, ctx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions [B*T], slots [B] and first positions [B] as the kernels read them (int64, contiguous):
        converted once per forward (`ctx` is the forward's), not once per layer."""
        if self._forward is None or self._forward[0] is not ctx:
            positions = ctx.positions.reshape(-1).to(torch.int64).contiguous()  # [B*T]
            slots = ctx.slots.to(torch.int64).contiguous()  # [B]
            starts = ctx.positions[:, 0].to(torch.int64).contiguous()  # [B]
            self._forward = (ctx, positions, slots, starts)
        return self._forward[1:]

    def __call__(self, q, k, v, ctx, layer: int) -> torch.Tensor:  # q [B, T, H, hd] -> [B, T, H, hd]
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
            q.data_ptr(), kc.data_ptr(), vc.data_ptr(), slots.data_ptr(), starts.data_ptr(), out.data_ptr(),
            B, T, H, kc.shape[1], D, kc.shape[2], D**-0.5, torch.get_num_threads(),
        )
        return out


def use_cpu_kernels(model: nn.Module) -> int:
    """Swap in the CPU kernels where they apply; return how many linear layers were swapped.

    Linear layers: bf16 weights on the CPU, contiguous, in_features a multiple of 16 and out_features a multiple
    of the kernel's block. Attention: a bf16 CPU model whose head dim is a multiple of 16. A no-op (returns 0)
    where the kernels cannot run.
    """
    lib = load_library()
    if lib is None:
        return 0
    swapped = _swap_linears(model, lib)
    args = getattr(model, "args", None)
    param = next(model.parameters())
    if (
        args is not None
        and param.dtype == torch.bfloat16
        and param.device.type == "cpu"
        and args.head_dim % 16 == 0
        and args.head_dim <= lib.specdec_attention_max_head_dim()
    ):
        model.attention = CPUAttention(lib, model.inv_freq)
        _swap_layer_parts(model, lib)
        _run_layers_in_one_call(model, lib)
    return swapped


class FastRMSNorm(nn.Module):
    """RMSNorm in one C call (normalise in fp32, scale in bf16, as the reference rounds)."""

    def __init__(self, norm: nn.Module, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.weight, self.eps, self._lib = norm.weight, float(norm.eps), lib

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        dim = x.shape[-1]
        self._lib.specdec_rms_norm_bf16(x.data_ptr(), self.weight.data_ptr(), y.data_ptr(), x.numel() // dim, dim, self.eps)
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
    """`Attention` with q, k and v projected by one fused linear layer (same results, a third of the calls)."""

    def __init__(self, attn: nn.Module, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.qkv_proj = FastCPULinear(_fuse([attn.q_proj, attn.k_proj, attn.v_proj]), lib)
        self.o_proj = attn.o_proj
        self._split = [self.num_heads * self.head_dim, *[self.num_kv_heads * self.head_dim] * 2]

    def forward(self, x: torch.Tensor, ctx, layer: int) -> torch.Tensor:  # [B, T, D] -> [B, T, D]
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self._split, dim=-1)  # [B, T, H*hd], [B, T, Hkv*hd] x 2
        # Contiguous copies: the rotary kernel rotates q and k in place and assumes dense rows.
        q = q.reshape(B, T, self.num_heads, self.head_dim).contiguous()
        k = k.reshape(B, T, self.num_kv_heads, self.head_dim).contiguous()
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


def _swap_layer_parts(model: nn.Module, lib: ctypes.CDLL) -> None:
    from specdec_core.models.transformer import MLP, Attention, RMSNorm

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is RMSNorm and child.weight.dtype == torch.bfloat16:
                setattr(parent, name, FastRMSNorm(child, lib))
            elif type(child) is MLP and _all_fast(child.gate_proj, child.up_proj):
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


def _eligible(module: nn.Module, block: int, k_multiple: int = _K_MULTIPLE) -> bool:
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


# -- what runs a built model, for logs and reports ------------------------------------------------------------------


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where unknown)."""
    return _cpu_flags()


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
        rows = f" (int8 fbgemm from {fbgemm_rows.FROM_ROWS} rows)" if any(m.int8_rows for m in int4) else ""
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
    if not _cpu_runs_kernels():
        return "neither AVX-512 nor AVX2 with FMA on this CPU"
    if load_library() is None:
        return "the kernels could not be built: no C compiler?"
    return "no layer swapped in: none has a shape the kernels take, or the model was not built by prepare_model"
