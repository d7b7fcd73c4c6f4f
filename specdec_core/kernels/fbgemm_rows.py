"""A draft linear layer's calls of many rows, run by torch's int8 GEMM (fbgemm, `torch.ops.quantized`).

Why: a draft step of one token reads every weight once, and there the 4-bit kernel (`gemm_int4.c`) is cheapest:
it reads the fewest bytes. A call of many rows is bound by the multiply-adds instead, and there the 4-bit kernel,
which unpacks and re-signs each weight for every row, loses to fbgemm's packed int8 GEMM on AVX2 (`FROM_ROWS`;
docs/engine.md has the measurements). Many rows are what a draft reads when it starts a sequence (the context its
prefix cache lacks), when it catches up on the tokens a suffix proposal committed, and when several sequences
draft at once.

Each row is independent of the others in its call: fbgemm quantizes its whole input with one scale and zero point,
so each row is first divided by its largest magnitude and given two extra entries, +1 and -1 (against weight
columns of zeros): every row then spans exactly [-1, 1], the quantization is the same for every batch, the
integer sums are exact, and the row's own magnitude multiplies its output back. A call of fewer rows goes through
the 4-bit kernel instead, so a row's draft logits can differ between the two (a draft step of one sequence
against one of five): only the acceptance rate can move, never the output (the drafts' q is what they were drawn
from).
"""

from __future__ import annotations

import ctypes
import warnings

import torch
from torch import nn

from specdec_core import environment

# Activations in 7 bits: without VNNI (AVX2) fbgemm multiplies bytes with vpmaddubsw, whose 16-bit pair sums would
# saturate at full 8-bit range; fbgemm's own dynamic quantization sets the same for x86.
REDUCE_RANGE = True
# Calls of at least this many rows take fbgemm. Fewer are still bound by bytes, where the 4-bit weights win: the
# crossover measured on AVX2 with the demo draft, 4-bit kernel against fbgemm, alternating (docs/benchmarks.md).
FROM_ROWS = 5
# Where the int8 kernel has VNNI (`linear.int8_kernel_rows`) it takes a 4-bit layer's calls of FROM_ROWS rows up to
# this many, fbgemm only longer ones (or none, without fbgemm): measured on AVX-512, the demo draft's forward of 5 /
# 8 / 10 rows took 0.87 / 0.94 / 0.95 of fbgemm's time on the int8 kernel, and 12 rows 1.14 (docs/engine.md).
INT8_KERNEL_MAX_ROWS = 10
_MARKS = 2  # the extra entries that pin every row's range to [-1, 1]


def available() -> bool:
    """Whether this torch has an int8 GEMM engine for x86 (fbgemm, or x86, which dispatches to it), and it is not
    switched off (`SPECDEC_DISABLE_INT8_ROWS`)."""
    if environment.draft_int8_rows_disabled():
        return False
    try:  # torch marks its quantized tensors deprecated (for torchao): a torch without them keeps the 4-bit kernel
        torch.ops.quantized.linear_prepack, torch.ops.quantized.linear_dynamic  # noqa: B018 (looked up to probe)
    except (AttributeError, RuntimeError):
        return False
    return bool({"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines))


class Int8Rows:
    """`linear`'s weights quantized to int8 per output row (symmetric) and packed for fbgemm; called on bf16 rows.
    `lib`: the CPU kernels, whose `specdec_rows_span` and `specdec_rows_finish` do the per-row scaling in one pass
    each (as torch ops they cost more than the GEMM itself at a few rows)."""

    def __init__(self, linear: nn.Linear, lib: ctypes.CDLL) -> None:
        w = linear.weight.detach().float()  # [N, K]
        N = w.shape[0]
        w = torch.cat([w, w.new_zeros(N, _MARKS)], dim=1)  # [N, K + 2]: the marks' columns add nothing
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [N]
        with warnings.catch_warnings():  # the deprecation `available` allows for, once per layer
            warnings.simplefilter("ignore", UserWarning)
            qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(N, dtype=torch.long), 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qw, None)
        self._bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).contiguous()  # [N]
        self._lib = lib
        self.out_features = N

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # bf16 [..., K] -> bf16 [..., N]
        K = x.shape[-1]
        rows = x.reshape(-1, K).contiguous()  # [M, K]
        M = rows.shape[0]
        spanned = torch.empty(M, K + _MARKS)  # [M, K + 2]: every row spans exactly [-1, 1]
        peak = torch.empty(M)  # [M]
        self._lib.specdec_rows_span(rows.data_ptr(), spanned.data_ptr(), peak.data_ptr(), M, K)
        y = torch.ops.quantized.linear_dynamic(spanned, self._packed, REDUCE_RANGE)  # [M, N] fp32
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.bfloat16)  # [..., N]
        bias = None if self._bias is None else self._bias.data_ptr()
        self._lib.specdec_rows_finish(y.data_ptr(), peak.data_ptr(), bias, out.data_ptr(), M, self.out_features)
        return out
