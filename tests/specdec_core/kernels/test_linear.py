"""The kernels' linear layers (`linear.py`): agreement with torch, the exact integer sums of int8 and 4-bit weights,
4-bit packing, rows computed identically whatever the batch, and the same on builds for other CPUs."""

from __future__ import annotations

import pytest
import torch

from specdec_core import hardware
from specdec_core.kernels import library
from specdec_core.kernels.linear import FastCPULinear, Int4CPULinear, Int8CPULinear, pack_int4, quantize_int4
from tests.specdec_core.kernels.marks import close, needs_int8, needs_kernels

pytestmark = needs_kernels


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 16, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_torch(rows, bias):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(128, 40, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 128).to(torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), linear.weight.float(), None if not bias else linear.bias.float())
    close(FastCPULinear(linear, library.load_library())(x), want, 5e-3)
    if library.load_library().specdec_has_int8():
        close(Int8CPULinear(linear, library.load_library())(x), want, 3e-2)


def _linear_kernels():
    lib = library.load_library()
    linear = torch.nn.Linear(128, 48).to(torch.bfloat16)
    yield FastCPULinear(linear, lib)
    if lib.specdec_has_int8():
        yield Int8CPULinear(linear, lib)


def test_linear_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    x = torch.randn(13, 128).to(torch.bfloat16)  # row blocks of 6, 6 and 1
    for layer in _linear_kernels():
        batched = layer(x)
        for i in range(13):
            assert torch.equal(layer(x[i : i + 1]), batched[i : i + 1])
        assert torch.equal(layer(x[2:6]), batched[2:6])


def _int8_reference(layer: Int8CPULinear, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N] bf16
    """What the int8 kernel computes, spelled out: x quantized per row (round half to even), the products summed
    as integers (exact in float64 here: |sum| < 2^53), scaled by both scales in fp32 in the kernel's order."""
    xf = x.float()
    sx = xf.abs().amax(dim=1) / 127.0  # [M]
    sx = torch.where(sx > 0, sx, torch.ones_like(sx))
    xq = torch.round(xf / sx.unsqueeze(1))  # [M, K]
    dot = (xq.double() @ layer.qweight.double().T).float()  # [M, N], integers
    y = dot * sx.unsqueeze(1) * layer.scale.unsqueeze(0)
    if layer.bias is not None:
        y = y + layer.bias.float()
    return y.to(torch.bfloat16)


@needs_int8
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13])
def test_int8_linear_computes_exactly_its_integer_sums(rows):
    """Every output of the int8 kernel equals the exact integer product of the quantized row and weights, scaled:
    a wrong row, column or k offset in any block shape shows as a mismatch, not within a tolerance."""
    torch.manual_seed(rows)
    linear = torch.nn.Linear(192, 56, bias=True).to(torch.bfloat16)
    layer = Int8CPULinear(linear, library.load_library())
    x = torch.randn(rows, 192).to(torch.bfloat16)
    assert torch.equal(layer(x), _int8_reference(layer, x))


def test_int4_quantization_is_within_half_a_step_and_packs_two_to_a_byte_with_the_scales():
    torch.manual_seed(0)
    w = torch.randn(24, 128).to(torch.bfloat16)  # [N, K]
    w[3, 32:64] = 0.0  # an all-zero group
    w[5, 64:96] = 1e-9  # a group whose scale is below fp16's smallest value: taken as zero
    q, scale = quantize_int4(w)  # [N, K] int8, [N, K/32] fp16
    assert scale.dtype == torch.float16 and q.abs().max() <= 7
    assert not q[3, 32:64].any() and not q[5, 64:96].any()
    step = scale.float().repeat_interleave(32, dim=1)  # [N, K]
    close = (w.float() - q.float() * step).abs() <= step / 2 + 1e-6
    assert close[:, :64].all() and close[:5].all() and close[6:].all()
    packed = pack_int4(q, scale)  # [N, K/64 * 36]
    assert packed.shape == (24, 2 * 36) and packed.dtype == torch.uint8
    blocks = packed.reshape(3, 2, 288)  # [panel of 8 rows, block of 64 k, bytes]
    for panel in range(3):
        rows = slice(8 * panel, 8 * panel + 8)
        for block in range(2):
            nibbles = blocks[panel, block, :256].view(8, 8, 4)  # [j, row, t]: k = 64 block + 4 j + t
            first = q[rows, 64 * block : 64 * block + 32].reshape(8, 8, 4).transpose(0, 1)  # [j, row, t]
            second = q[rows, 64 * block + 32 : 64 * block + 64].reshape(8, 8, 4).transpose(0, 1)
            assert torch.equal((nibbles & 15).to(torch.int8) - 8, first)
            assert torch.equal((nibbles >> 4).to(torch.int8) - 8, second)
            scales = blocks[panel, block, 256:].contiguous().view(torch.float16).view(2, 8)  # [group, row]
            assert torch.equal(scales, scale[rows, 2 * block : 2 * block + 2].T)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13])
def test_int4_linear_computes_its_group_sums(rows):
    """The 4-bit kernel against its arithmetic in float64 (x quantized per row, integer products summed per group of
    32, each sum times its group's fp16 scale): a wrong nibble, group, row or k offset in any block shape is far off,
    while the kernel's own fp32 rounding stays within one bf16 step of the exact value."""
    torch.manual_seed(rows)
    linear = torch.nn.Linear(192, 56, bias=True).to(torch.bfloat16)
    layer = Int4CPULinear(linear, library.load_library())
    x = torch.randn(rows, 192).to(torch.bfloat16)
    q, scale = quantize_int4(linear.weight.detach())
    xf = x.float()
    sx = xf.abs().amax(dim=1) / 127.0  # [M]
    xq = torch.round(xf / sx.unsqueeze(1)).double()  # [M, K]
    groups = (xq.view(rows, 1, 6, 32) * q.double().view(1, 56, 6, 32)).sum(-1)  # [M, N, K/32] integer sums
    want = (groups * scale.double()).sum(-1) * sx.double().unsqueeze(1) + linear.bias.double()  # [M, N]
    got = layer.kernel(x).double()
    spacing = want.abs().clamp_min(1e-3) * 2.0**-7  # a bf16 step at the value
    assert ((got - want).abs() <= spacing).all()
    batched = layer.kernel(x)
    assert all(torch.equal(layer.kernel(x[i : i + 1]), batched[i : i + 1]) for i in range(rows))
    assert torch.equal(layer(x[:1]), batched[:1])  # a row alone takes the 4-bit kernel


_INT4_OUTPUT = """
import sys
import torch
from specdec_core.kernels import library
from specdec_core.kernels.linear import FastCPULinear, Int4CPULinear, Int8CPULinear
torch.manual_seed(5)
linear = torch.nn.Linear(192, 56, bias=True).to(torch.bfloat16)
linear.weight.data[7, :32] *= 1e-4  # small scales: fp16 subnormals
x = torch.randn(7, 192).to(torch.bfloat16)
torch.save(Int4CPULinear(linear, library.load_library()).kernel(x), sys.argv[1])
"""


@pytest.mark.skipif("f16c" not in hardware.cpu_flags(), reason="this CPU builds the fallback already")
def test_int4_scales_read_without_f16c_give_the_same_bits(tmp_path):
    """The 4-bit kernel reads its fp16 scales with F16C's conversion, or without it by a portable one that must
    give the same floats: built both ways, the same layer gives the same bits."""
    import os
    import subprocess
    import sys

    outputs = []
    for flags in ("", "-mno-f16c"):
        env = {**os.environ, "SPECDEC_KERNEL_CFLAGS": flags, "SPECDEC_KERNEL_DIR": str(tmp_path / f"lib{flags}")}
        out = tmp_path / f"y{flags}.pt"
        subprocess.run([sys.executable, "-c", _INT4_OUTPUT, str(out)], env=env, check=True, timeout=300)
        outputs.append(torch.load(out))
    assert torch.equal(outputs[0], outputs[1])


_FP32_PATH_CHECK = """
import torch
from specdec_core.build import prepare_model
from specdec_core.kernels import library
from specdec_core.kernels.linear import FastCPULinear, Int4CPULinear, Int8CPULinear
lib = library.load_library()
assert lib is not None and not lib.specdec_has_native_bf16()
torch.manual_seed(0)
linear = torch.nn.Linear(128, 48, bias=True).to(torch.bfloat16)
layer = FastCPULinear(linear, lib)
x = torch.randn(13, 128).to(torch.bfloat16)
batched = layer(x)
assert all(torch.equal(layer(x[i : i + 1]), batched[i : i + 1]) for i in range(13))
want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
assert (batched.float() - want).norm() / want.norm() < 5e-3
y = torch.empty(1, 48, dtype=torch.bfloat16)
try:  # the widened inputs of 2^53 rows (2^62 bytes) cannot be allocated: an error, not a crash
    lib.specdec_gemm_bf16(x.data_ptr(), linear.weight.data_ptr(), None, y.data_ptr(), 1 << 53, 48, 128, 1)
except MemoryError:
    pass
else:
    raise AssertionError("no MemoryError")
"""


@pytest.mark.skipif(
    not library.load_library() or not library.load_library().specdec_has_native_bf16(),
    reason="this CPU runs the fp32 path already",
)
def test_the_path_for_cpus_without_native_bf16(tmp_path):
    """The kernel built as for a CPU without AVX512-BF16 (the widening fp32 path) agrees with torch and computes
    rows alike whatever the batch."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "SPECDEC_KERNEL_CFLAGS": "-mno-avx512bf16", "SPECDEC_KERNEL_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", _FP32_PATH_CHECK], env=env, check=True, timeout=300)


_AVX2_PATH_CHECK = """
import torch
from specdec_core.kernels import library
from specdec_core.kernels.linear import FastCPULinear, Int4CPULinear, Int8CPULinear
lib = library.load_library()
assert lib is not None and not lib.specdec_has_avx512() and lib.specdec_has_int8()
torch.manual_seed(0)
linear = torch.nn.Linear(128, 48, bias=True).to(torch.bfloat16)
x = torch.randn(13, 128).to(torch.bfloat16)
want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
for layer, tolerance in ((FastCPULinear(linear, lib), 5e-3), (Int8CPULinear(linear, lib), 3e-2)):
    batched = layer(x)
    assert all(torch.equal(layer(x[i : i + 1]), batched[i : i + 1]) for i in range(13))
    assert (batched.float() - want).norm() / want.norm() < tolerance
"""


@pytest.mark.skipif(
    not library.load_library() or not library.load_library().specdec_has_avx512(),
    reason="this CPU runs the AVX2 path already",
)
def test_the_path_for_cpus_without_avx512(tmp_path):
    """The kernels built as for an AVX2 CPU (8-lane vectors; int8 by byte multiply-adds, without VNNI) agree with
    torch and compute rows alike whatever the batch."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "SPECDEC_KERNEL_CFLAGS": "-mno-avx512f", "SPECDEC_KERNEL_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", _AVX2_PATH_CHECK], env=env, check=True, timeout=300)


def test_linear_kernels_refuse_shapes_they_cannot_run():
    with pytest.raises(ValueError, match="in_features"):
        FastCPULinear(torch.nn.Linear(80, 40).to(torch.bfloat16), library.load_library())
