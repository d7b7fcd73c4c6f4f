"""The kernels' linear layers: bf16 (`gemm.c`), and for draft models int8 (`gemm_int8.c`) and 4-bit weights
(`gemm_int4.c`), with the 4-bit quantization and packing. Each computes a row the same way whatever else is in its
call (but `Int4CPULinear`'s calls of many rows on fbgemm), so verification reproduces plain decoding bit for bit.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn

from specdec_core import environment
from specdec_core.kernels import fbgemm_rows
from specdec_core.kernels.library import INT4_GROUP, INT4_K_MULTIPLE, INT4_PANEL, INT8_K_MULTIPLE, K_MULTIPLE


class FastCPULinear(nn.Module):
    """A bf16 `nn.Linear` run by the streaming kernel (measured faster than torch's bf16 GEMM at every row count
    we tried, 1 to 128: it is built for few rows, and still reads each weight once per block of rows)."""

    def __init__(self, linear: nn.Linear, lib: ctypes.CDLL) -> None:
        super().__init__()
        _check_shape(linear, lib, K_MULTIPLE)
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
        _check_shape(linear, lib, INT8_K_MULTIPLE)
        q, scale, row_sums = quantize_int8(linear.weight.detach())
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("row_sums", row_sums)
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
    each call. A call of many rows (reading a context, several sequences' steps: `fbgemm_rows.FROM_ROWS` and more)
    is bound by multiply-adds, not bytes, and runs on int8 weights instead: with VNNI on the int8 kernel
    (`gemm_int8.c`) up to `fbgemm_rows.INT8_KERNEL_MAX_ROWS` rows, else (and beyond) on fbgemm where torch has it
    (`fbgemm_rows.py`; without it, every such call on the int8 kernel). Only ever used for drafting, where
    precision moves the acceptance rate, not the output.
    """

    def __init__(self, linear: nn.Linear, lib: ctypes.CDLL) -> None:
        super().__init__()
        _check_shape(linear, lib, INT4_K_MULTIPLE)
        q, scale = quantize_int4(linear.weight.detach())
        self.register_buffer("qweight", pack_int4(q, scale))  # [N, K/64 * 36] uint8
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).contiguous()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._lib = lib
        self._call = _KernelCall(lib.specdec_gemm_w4a8, (self.qweight,), self.bias)
        self._int8: _KernelCall | None = None
        if int8_kernel_rows(lib):
            q8, scale8, row_sums8 = quantize_int8(linear.weight.detach())
            self.register_buffer("qweight8", q8)  # [N, K] int8
            self.register_buffer("scale8", scale8)  # [N]
            self.register_buffer("row_sums8", row_sums8)  # [N]
            self._int8 = _KernelCall(lib.specdec_gemm_w8a8, (q8, scale8, row_sums8), self.bias)
        self._rows = fbgemm_rows.Int8Rows(linear, lib) if fbgemm_rows.available() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] bf16 -> [..., N] bf16
        x = x.to(torch.bfloat16)  # a no-op for bf16 x
        rows = x.numel() // x.shape[-1]
        if self._rows is not None and rows > self.kernel_max_rows:
            return self._rows(x)
        if self._int8 is not None and rows >= fbgemm_rows.FROM_ROWS:
            return self._int8(x, self.out_features)
        return self.kernel(x)

    @property
    def kernel_max_rows(self) -> int:
        """The most rows a call takes on this layer's own kernels (4-bit, and int8 with VNNI) where fbgemm takes
        longer calls; the layers' one C call (`layers_quant.py`) takes no more."""
        return fbgemm_rows.INT8_KERNEL_MAX_ROWS if self._int8 is not None else fbgemm_rows.FROM_ROWS - 1

    @property
    def int8_rows(self) -> bool:
        """Whether calls of `fbgemm_rows.FROM_ROWS` rows or more run on int8 weights (then a row's result depends
        on how many rows share its call)."""
        return self._int8 is not None or self._rows is not None

    @property
    def int8_kernel(self) -> bool:
        """Whether calls of `FROM_ROWS` to `INT8_KERNEL_MAX_ROWS` rows (`fbgemm_rows`) run on the int8 kernel."""
        return self._int8 is not None

    @property
    def fbgemm_rows(self) -> bool:
        """Whether calls of many rows the int8 kernel does not take run on fbgemm."""
        return self._rows is not None

    def kernel(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] bf16 -> [..., N] bf16
        """The 4-bit kernel, whatever the number of rows (`forward` gives it calls of few rows)."""
        return self._call(x, self.out_features)


def int8_kernel_rows(lib: ctypes.CDLL) -> bool:
    """Whether a 4-bit layer's calls of many rows take the int8 kernel: built with VNNI (without it, on AVX2, fbgemm
    measured faster than the 4-bit kernel and the int8 kernel is not set against it), and not switched off
    (`SPECDEC_DISABLE_INT8_ROWS`)."""
    return bool(lib.specdec_has_vnni()) and not environment.draft_int8_rows_disabled()


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [N, K] -> q, scale, sums
    """`gemm_int8.c`'s weights: symmetric per output row, w ~= scale[n] * q[n, k], q in [-127, 127]; returns q
    [N, K] int8, scale [N] fp32 and q's row sums [N] int32."""
    w = w.float()  # [N, K]
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [N]
    q = torch.round(w / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8)  # [N, K]
    return q, scale.contiguous(), q.sum(dim=1, dtype=torch.int32).contiguous()


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, K] -> ([N, K] int8, [N, K/G] fp16)
    """Symmetric 4-bit quantization in groups of `INT4_GROUP` along k: w ~= scale[n, g] * q[n, k], q in [-7, 7],
    each scale max|group| / 7 rounded to fp16 (q is rounded against the fp16 scale). A group too small for fp16
    (a scale below its smallest value) or all zero gets q = 0."""
    N, K = w.shape
    groups = w.float().view(N, K // INT4_GROUP, INT4_GROUP)  # [N, K/G, G]
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
    P, H = N // INT4_PANEL, K // 64
    u = (q.to(torch.int16) + 8).to(torch.uint8).view(P, INT4_PANEL, H, 2, 8, 4)  # [panel, row, block, group, j, t]
    nibbles = (u[:, :, :, 0] | (u[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # [P, H, j, row, t]
    scales = scale.contiguous().view(P, INT4_PANEL, H, 2).permute(0, 2, 3, 1).contiguous()  # [P, H, group, row]
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
    (nn.Module's attribute lookup) showed as a visible share of a small draft's step under a profiler. The
    pointers are read once here; the tensors are held with them, so they stay valid whatever happens to the
    module's attributes."""

    def __init__(self, kernel: Any, weights: tuple[torch.Tensor, ...], bias: torch.Tensor | None) -> None:
        self._kernel = kernel
        self._held = (*weights, bias)  # keeps the memory behind the pointers alive
        self._pointers = tuple(w.data_ptr() for w in weights)
        self._bias = None if bias is None else bias.data_ptr()

    def __call__(self, x: torch.Tensor, out_features: int) -> torch.Tensor:  # bf16 [..., K] -> bf16 [..., N]
        K = x.shape[-1]
        x2 = x.reshape(-1, K).contiguous()  # [M, K]
        y = torch.empty(*x.shape[:-1], out_features, dtype=torch.bfloat16)  # [..., N]
        self._kernel(
            x2.data_ptr(),
            *self._pointers,
            self._bias,
            y.data_ptr(),
            x2.shape[0],
            out_features,
            K,
            torch.get_num_threads(),
        )
        return y
