"""A draft linear layer's calls of many rows on fbgemm's int8 GEMM (`fbgemm_rows.py`): each row independent of
the batch, and each keeping its own precision."""

from __future__ import annotations

import pytest
import torch

from specdec_core.kernels import fbgemm_rows, library
from specdec_core.kernels import linear as linear_module
from specdec_core.kernels.linear import Int4CPULinear, Int8CPULinear
from tests.specdec_core.kernels.marks import close, needs_fbgemm, needs_int8, needs_kernels

pytestmark = needs_kernels


@needs_fbgemm
def test_int4_layers_run_several_rows_as_int8_rows_each_independent_of_the_batch(monkeypatch):
    """Calls of FROM_ROWS rows or more go to fbgemm's int8 GEMM (here with the int8 kernel switched off), fewer to
    the 4-bit kernel. Each row is pinned to the range [-1, 1] first, so fbgemm's one quantization per call is the
    same for every batch: a row gets the same bits in any call fbgemm runs. Rows of very different magnitudes each
    keep their own precision (one scale for the call would flatten the small row to a few levels)."""
    torch.manual_seed(3)
    linear = torch.nn.Linear(192, 56, bias=False).to(torch.bfloat16)
    monkeypatch.setattr(linear_module, "int8_kernel_rows", lambda lib: False)
    layer = Int4CPULinear(linear, library.load_library())
    assert layer.fbgemm_rows and not layer.int8_kernel
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
    close(y[0], want[0], 3e-2)


@needs_int8
def test_with_vnni_int4_layers_run_many_rows_on_the_int8_kernel_up_to_its_limit():
    """Where the int8 kernel has VNNI, a 4-bit layer's calls of FROM_ROWS to INT8_KERNEL_MAX_ROWS rows are the int8
    kernel's, bit for bit an `Int8CPULinear` of the same weights (each row quantized alone, so independent of the
    batch); longer calls go to fbgemm where torch has it."""
    lib = library.load_library()
    if not lib.specdec_has_vnni():
        pytest.skip("the int8 kernel takes a 4-bit layer's rows only with VNNI")
    torch.manual_seed(5)
    linear = torch.nn.Linear(192, 56, bias=True).to(torch.bfloat16)
    layer, int8 = Int4CPULinear(linear, lib), Int8CPULinear(linear, lib)
    assert layer.int8_kernel and layer.int8_rows
    x = torch.randn(fbgemm_rows.INT8_KERNEL_MAX_ROWS + 1, 192).to(torch.bfloat16)
    for rows in (fbgemm_rows.FROM_ROWS, 9, fbgemm_rows.INT8_KERNEL_MAX_ROWS):
        assert torch.equal(layer(x[:rows]), int8(x[:rows]))
    few = fbgemm_rows.FROM_ROWS - 1
    assert torch.equal(layer(x[:few]), layer.kernel(x[:few]))
    longest = layer(x)
    if layer.fbgemm_rows:
        assert torch.equal(longest, fbgemm_rows.Int8Rows(linear, lib)(x))
    else:
        assert torch.equal(longest, int8(x))
