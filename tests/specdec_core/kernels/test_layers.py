"""The kernels' parts of a decoder layer (`layers.py`): fused projections, attention, RMSNorm and the MLP's
activation, against torch and exact values, and a row's bits whatever else is in the call."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdec_core.kernels import library
from specdec_core.kernels.layers import FastMLP, FastRMSNorm, _fuse
from specdec_core.kernels.linear import FastCPULinear
from specdec_core.models.transformer import MLP, RMSNorm
from tests.specdec_core.kernels.marks import close, needs_kernels

pytestmark = needs_kernels


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
            close(full[b, t], torch.einsum("hn,hnd->hd", p, v), 1e-2)
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


def test_fused_elementwise_ops_match_torch():
    torch.manual_seed(1)
    lib = library.load_library()
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    norm.weight.data = torch.randn(64).to(torch.bfloat16)
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    close(FastRMSNorm(norm, lib)(x), norm(x), 1e-2)
    mlp = MLP(SimpleNamespace(hidden_size=64, intermediate_size=32)).to(torch.bfloat16)
    close(FastMLP(mlp, lib)(x), mlp(x), 2e-2)


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
