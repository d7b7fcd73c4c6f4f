"""CPU kernels: agreement with torch, and rows computed identically whatever the batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdec_core import hardware
from specdec_core.build import prepare_model
from specdec_core.kernels import fbgemm_rows, library, report
from specdec_core.kernels.layers import FastMLP, FastRMSNorm, FusedAttention, _fuse
from specdec_core.kernels.linear import FastCPULinear, Int4CPULinear, Int8CPULinear, pack_int4, quantize_int4
from specdec_core.models.loader import load_model
from specdec_core.models.transformer import MLP, RMSNorm, TorchAttention
from specdec_core.runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.skipif(
    library.load_library() is None, reason="CPU kernels need AVX-512 or AVX2 with FMA, and a C compiler"
)
needs_int8 = pytest.mark.skipif(
    not library.load_library() or not library.load_library().specdec_has_int8(),
    reason="AVX-512 kernels have the int8 draft kernel only with VNNI",
)


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < rel, err


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 16, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_torch(rows, bias):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(128, 40, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 128).to(torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), linear.weight.float(), None if not bias else linear.bias.float())
    _close(FastCPULinear(linear, library.load_library())(x), want, 5e-3)
    if library.load_library().specdec_has_int8():
        _close(Int8CPULinear(linear, library.load_library())(x), want, 3e-2)


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


needs_fbgemm = pytest.mark.skipif(not fbgemm_rows.available(), reason="this torch has no x86 int8 GEMM (fbgemm)")


@needs_fbgemm
def test_int4_layers_run_several_rows_as_int8_rows_each_independent_of_the_batch():
    """Calls of FROM_ROWS rows or more go to fbgemm's int8 GEMM, fewer to the 4-bit kernel. Each row is pinned to
    the range [-1, 1] first, so fbgemm's one quantization per call is the same for every batch: a row gets the same
    bits in any call fbgemm runs. Rows of very different magnitudes each keep their own precision (one scale for
    the call would flatten the small row to a few levels)."""
    torch.manual_seed(3)
    linear = torch.nn.Linear(192, 56, bias=False).to(torch.bfloat16)
    layer = Int4CPULinear(linear, library.load_library())
    x = torch.randn(13, 192)
    x[4] *= 1e-3
    x[9] *= 50.0
    x = x.to(torch.bfloat16)
    batched = layer(x)
    assert not torch.equal(batched, layer.kernel(x))  # not the 4-bit kernel
    few = fbgemm_rows.FROM_ROWS - 1
    assert torch.equal(layer(x[:few]), layer.kernel(x[:few]))
    for i in range(13 - fbgemm_rows.FROM_ROWS):
        assert torch.equal(layer(x[i : i + fbgemm_rows.FROM_ROWS])[0], batched[i])
    assert torch.equal(layer(x[3:11]), batched[3:11])
    want = torch.nn.functional.linear(x.float(), linear.weight.float())  # [13, N]
    for i in range(13):  # each row within int8's error of its own exact value, the small one included
        row_error = (batched[i].float() - want[i]).norm() / want[i].norm()
        assert row_error < 3e-2, (i, row_error)


@needs_fbgemm
def test_int8_rows_keep_a_zero_row_the_bias_and_the_leading_dimensions():
    torch.manual_seed(4)
    linear = torch.nn.Linear(128, 40, bias=True).to(torch.bfloat16)
    rows = fbgemm_rows.Int8Rows(linear, library.load_library())
    x = torch.randn(2, 3, 128).to(torch.bfloat16)
    x[1, 2] = 0.0
    y = rows(x)
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    assert torch.equal(y[1, 2], linear.bias.detach())  # a zero row: the bias alone
    want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    _close(y[0], want[0], 3e-2)


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


@pytest.mark.parametrize("rows", [1, 4, 7])
def test_fused_projection_equals_its_parts_bit_for_bit(rows):
    """q/k/v (and gate/up) run as one linear layer: each part's outputs must be exactly what it gave alone."""
    torch.manual_seed(rows)
    lib = library.load_library()
    parts = [torch.nn.Linear(64, n, bias=True).to(torch.bfloat16) for n in (64, 16, 16)]
    x = torch.randn(rows, 64).to(torch.bfloat16)
    fused = FastCPULinear(_fuse(parts), lib)(x)  # [rows, 96]
    alone = torch.cat([FastCPULinear(p, lib)(x) for p in parts], dim=-1)  # [rows, 96]
    assert torch.equal(fused, alone)


def _attend(q, kc, vc, slots, starts, threads):  # q [B, T, H, D] -> [B, T, H, D]
    out = torch.empty_like(q)
    B, T, H, D = q.shape
    library.load_library().specdec_attention_bf16(
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
        threads,
    )
    return out


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(12, 2, 128), (14, 2, 64), (4, 4, 16), (8, 1, 32)])
def test_attention_matches_torch_and_a_token_alone_gets_the_same_bits(heads, kv_heads, head_dim):
    """Query rows of one KV head are computed in tiles that share its loads; which rows share a tile (T new tokens
    in a verify, one in decoding, and how many threads split them) must not change a row's bits."""
    g = torch.Generator().manual_seed(heads * head_dim)
    B, T, capacity = 2, 7, 48
    q = torch.randn(B, T, heads, head_dim, generator=g).to(torch.bfloat16)
    kc, vc = (torch.randn(3, kv_heads, capacity, head_dim, generator=g).to(torch.bfloat16) for _ in range(2))
    slots, starts = torch.tensor([2, 0]), torch.tensor([30, 5])
    full = _attend(q, kc, vc, slots, starts, threads=3)
    group = heads // kv_heads
    for b in range(B):
        for t in range(T):
            n = int(starts[b]) + t + 1  # the prefix and the new tokens up to this one
            k = kc[slots[b], :, :n].float().repeat_interleave(group, dim=0)  # [H, n, D]
            v = vc[slots[b], :, :n].float().repeat_interleave(group, dim=0)  # [H, n, D]
            p = torch.softmax(torch.einsum("hd,hnd->hn", q[b, t].float(), k) * head_dim**-0.5, dim=-1)  # [H, n]
            _close(full[b, t], torch.einsum("hn,hnd->hd", p, v), 1e-2)
    for t in range(T):  # decoding token t alone, one thread or several
        for threads in (1, 2):
            alone = _attend(q[:, t : t + 1].contiguous(), kc, vc, slots, starts + t, threads)
            assert torch.equal(alone[:, 0], full[:, t]), (t, threads)
    assert torch.equal(_attend(q[:1].contiguous(), kc, vc, slots[:1], starts[:1], 1), full[:1])


def test_attention_refuses_a_head_dim_beyond_its_scratch():
    wide = library.load_library().specdec_attention_max_head_dim() + 16
    q, kv = torch.zeros(1, 1, 1, wide, dtype=torch.bfloat16), torch.zeros(1, 1, 4, wide, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="specdec_attention_bf16 failed: Invalid argument"):
        _attend(q, kv, kv, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 1)


def test_linear_kernels_refuse_shapes_they_cannot_run():
    with pytest.raises(ValueError, match="in_features"):
        FastCPULinear(torch.nn.Linear(80, 40).to(torch.bfloat16), library.load_library())


def test_kernels_that_cannot_allocate_their_scratch_raise_memory_error():
    """Sizes whose scratch (2^62 bytes) no machine can allocate: the kernel returns ENOMEM before touching the
    (small) tensors, and the call raises instead of writing through a NULL pointer."""
    lib = library.load_library()
    q, out = torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16), torch.empty(1, 1, 1, 16, dtype=torch.bfloat16)
    kv = torch.zeros(1, 1, 4, 16, dtype=torch.bfloat16)
    zeros = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(MemoryError, match="specdec_attention_bf16"):
        lib.specdec_attention_bf16(
            q.data_ptr(),
            kv.data_ptr(),
            kv.data_ptr(),
            zeros.data_ptr(),
            zeros.data_ptr(),
            out.data_ptr(),
            1,
            1,
            1,
            1,
            16,
            1 << 60,
            0.25,
            2,
        )
    if lib.specdec_has_int8():
        x, y = torch.zeros(1, 64, dtype=torch.bfloat16), torch.empty(1, 8, dtype=torch.bfloat16)
        w, sw, wsum = torch.zeros(8, 64, dtype=torch.int8), torch.ones(8), torch.zeros(8, dtype=torch.int32)
        with pytest.raises(MemoryError, match="specdec_gemm_w8a8"):
            lib.specdec_gemm_w8a8(
                x.data_ptr(), w.data_ptr(), sw.data_ptr(), wsum.data_ptr(), None, y.data_ptr(), 1 << 56, 8, 64, 1
            )


def test_fused_elementwise_ops_match_torch():
    torch.manual_seed(1)
    lib = library.load_library()
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    norm.weight.data = torch.randn(64).to(torch.bfloat16)
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    _close(FastRMSNorm(norm, lib)(x), norm(x), 1e-2)
    mlp = MLP(SimpleNamespace(hidden_size=64, intermediate_size=32)).to(torch.bfloat16)
    _close(FastMLP(mlp, lib)(x), mlp(x), 2e-2)


def test_vector_exp_is_within_two_ulp_of_exact():
    x = torch.cat([torch.linspace(-87.0, 88.0, 200_003), torch.randn(10_000) * 5, torch.tensor([0.0, -0.0, 1e-30])])
    got = torch.empty_like(x)
    library.load_library().specdec_exp_f32(x.data_ptr(), got.data_ptr(), x.numel())
    want = torch.exp(x.double())
    ulp = (want.float().abs().nextafter(torch.tensor(float("inf"))) - want.float().abs()).double()  # fp32 spacing
    assert ((got.double() - want).abs() / ulp).max() <= 2.0
    edge = torch.tensor([float("nan"), -1000.0, float("-inf"), 1000.0])
    out = torch.empty_like(edge)
    library.load_library().specdec_exp_f32(edge.data_ptr(), out.data_ptr(), edge.numel())
    assert out[0].isnan() and 0 <= out[1] < 1e-37 and 0 <= out[2] < 1e-37 and 1e38 < out[3] < float("inf")


@pytest.mark.parametrize("width", [1, 7, 8, 9, 19, 32])
def test_silu_mul_is_the_exact_value_rounded_once(width):
    """Every value, the tail of a row too, within one bf16 rounding of silu(g) * u computed in float64."""
    torch.manual_seed(width)
    rows = 3
    gu = (torch.randn(rows, 2 * width) * 4).to(torch.bfloat16)
    gu[0, 0] = 100.0
    if width > 1:
        gu[1, 1] = -100.0
    y = torch.empty(rows, width, dtype=torch.bfloat16)
    library.load_library().specdec_silu_mul_bf16(gu.data_ptr(), y.data_ptr(), rows, width, 2)
    g, u = gu[:, :width].double(), gu[:, width:].double()
    want = g * torch.sigmoid(g) * u
    below = want.to(torch.bfloat16).double()  # the nearest bf16; the kernel may land on a neighbour of it
    spacing = (below.abs() * 2.0**-7).clamp_min(1e-30)
    assert ((y.double() - want).abs() <= spacing).all()
    gu[2, 0] = float("nan")
    library.load_library().specdec_silu_mul_bf16(gu.data_ptr(), y.data_ptr(), rows, width, 2)
    assert y[2, 0].isnan() and not y[2, 1:].isnan().any()


@pytest.fixture(scope="module")
def bf16_pair(tiny_dir):
    """The tiny target in bf16 twice: with the CPU kernels and with torch's code paths."""
    return prepare_model(tiny_dir / "target", dtype="bfloat16"), load_model(tiny_dir / "target", dtype="bfloat16")


def test_kernels_are_in_place_and_agree_with_torch(bf16_pair):
    fast, plain = bf16_pair
    assert not isinstance(fast.model.attention, TorchAttention)
    layer = fast.model.layers[0]
    assert isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FastMLP)
    assert isinstance(plain.model.attention, TorchAttention)
    tokens = [3, 77, 12, 5, 200, 41, 9, 150, 7]
    outs = []
    for loaded in bf16_pair:
        runner = ModelRunner(loaded.model, RunnerConfig(num_slots=1, max_seq_len=64))
        slot = runner.allocate()
        outs.append(runner.extend([slot], [tokens], all_logits=True)[0])
    _close(outs[0], outs[1], 3e-2)


def test_verify_reproduces_decode_bit_for_bit(bf16_pair):
    """The property that makes greedy speculation exact in bf16: scoring k+1 tokens at once gives each position
    the very logits that decoding it alone gives."""
    fast, _ = bf16_pair
    runner = ModelRunner(fast.model, RunnerConfig(num_slots=2, max_seq_len=64))
    prompt, tail = [5, 9, 31, 77, 2, 140], [12, 240, 8, 99]
    one, many = runner.allocate(), runner.allocate()
    runner.extend([one], [prompt])
    runner.extend([many], [prompt])
    decoded = [runner.extend([one], [[t]])[0] for t in tail]  # T = 1, four times
    verified = runner.extend([many], [tail], all_logits=True)[0]  # T = 4, once
    for i, row in enumerate(decoded):
        assert torch.equal(row, verified[i]), i


def test_a_prefill_from_cached_positions_gives_a_full_prefills_logits_bit_for_bit(bf16_pair):
    """The property that makes prefix caching exact in bf16: keys written by a prefill, a verify and decode steps,
    then copied into another slot (or taken over in place), give the rest of a prompt the very logits a full
    prefill gives it."""
    fast, _ = bf16_pair
    prompt, rest = [5, 9, 31, 77, 2, 140, 12, 240], [8, 99, 3, 17]
    reference = ModelRunner(fast.model, RunnerConfig(num_slots=1, max_seq_len=64))
    want = reference.extend([reference.allocate()], [prompt + rest], all_logits=True)[0, len(prompt) :]  # [4, V]
    for running in (True, False):  # copied from a running sequence's slot; taken over from an ended one's entry
        runner = ModelRunner(fast.model, RunnerConfig(num_slots=3, max_seq_len=64, prefix_caching=True))
        source = runner.allocate()
        runner.extend([source], [prompt[:3]])  # a prefill
        runner.extend([source], [prompt[3:6]], all_logits=True)  # a verify of three rows
        for token in prompt[6:]:  # decode steps
            runner.extend([source], [[token]])
        if not running:
            runner.release(source)
        slot = runner.allocate(prompt + rest[:-1])
        assert runner.length(slot) == len(prompt) and (slot == source) is not running
        assert torch.equal(runner.extend([slot], [rest], all_logits=True)[0], want)


@pytest.mark.parametrize("vocabulary", [0, 128])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_greedy_speculation_with_a_quantized_draft_is_exact_in_bf16(tiny_dir, quantization, vocabulary):
    """Also with the draft's head cut to its first 128 ids and the contexts' (`models.vocab_head`): the kept
    rows go to the same kernel as every other linear layer."""
    from specdec_core.build import DraftSpec, build_engine, load_pair
    from specdec_core.config import SamplingParams
    from specdec_core.models.vocab_head import VocabHead
    from tests.helpers import run_to_completion

    if quantization == "int8" and not library.load_library().specdec_has_int8():
        pytest.skip("AVX-512 kernels have the int8 draft kernel only with VNNI")
    target, draft = load_pair(
        str(tiny_dir / "target"), str(tiny_dir / "target"), draft_quantization=quantization, draft_vocabulary=vocabulary
    )
    layer = {"int8": Int8CPULinear, "int4": Int4CPULinear}[quantization]
    assert any(isinstance(m, layer) for m in draft.model.modules())
    head = draft.model.lm_head
    assert (type(head) is VocabHead and type(head.head) is layer) == (vocabulary > 0)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = target.tokenizer("def add(a, b):")["input_ids"]
    plain = run_to_completion(build_engine(target, None, DraftSpec(method="none")), [("r", prompt, params, 0)])
    spec = run_to_completion(build_engine(target, draft, DraftSpec()), [("r", prompt, params, 3)])
    assert spec["r"][0] == plain["r"][0]
    assert spec["r"][2].stats.accepted > 0


def test_the_kernel_path_is_named_and_batch_invariant_only_on_the_kernels(bf16_pair, tiny_dir):
    fast, plain = bf16_pair
    lib = library.load_library()
    native = "native bf16" if lib.specdec_has_native_bf16() else "fp32 widening"
    isa = "AVX-512" if lib.specdec_has_avx512() else "AVX2"
    assert isa == ("AVX-512" if {"avx512f", "avx512bw"} <= hardware.cpu_flags() else "AVX2")
    assert report.kernel_path(fast.model) == f"bf16 {isa} ({native}), layers in one call"
    assert report.rows_batch_invariant(fast.model)
    assert report.kernel_path(plain.model).startswith("torch fallback (")  # loaded, never given the kernels
    assert not report.rows_batch_invariant(plain.model)
    if library.load_library().specdec_has_int8():
        # auto: int8 on AVX-512 (with VNNI: the int8 kernel needs it there), 4-bit weights on AVX2
        draft = prepare_model(tiny_dir / "target", dtype="bfloat16", quantization="auto")
        int4 = "int4 AVX2" + (f" (int8 fbgemm from {fbgemm_rows.FROM_ROWS} rows)" if fbgemm_rows.available() else "")
        int4 += ", layers in one call"
        chosen = "int8 VNNI, layers in one call" if lib.specdec_has_avx512() else int4
        assert report.kernel_path(draft.model) == f"bf16 {isa} ({native}) + {chosen}"
        draft = prepare_model(tiny_dir / "target", dtype="bfloat16", quantization="int8")
        int8 = "int8 VNNI" if lib.specdec_has_vnni() else "int8 AVX2"
        assert report.kernel_path(draft.model) == f"bf16 {isa} ({native}) + {int8}, layers in one call"
    draft = prepare_model(tiny_dir / "target", dtype="bfloat16", quantization="int4")
    rows = f" (int8 fbgemm from {fbgemm_rows.FROM_ROWS} rows)" if fbgemm_rows.available() else ""
    assert report.kernel_path(draft.model) == f"bf16 {isa} ({native}) + int4 AVX2{rows}, layers in one call"
    assert report.rows_batch_invariant(draft.model) is not fbgemm_rows.available()
