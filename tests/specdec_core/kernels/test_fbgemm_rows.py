"""A draft linear layer's calls of many rows on fbgemm's int8 GEMM (`fbgemm_rows.py`): each row independent of
the batch, and each keeping its own precision."""

from __future__ import annotations

import torch

from specdec_core.kernels import fbgemm_rows, library
from specdec_core.kernels.linear import Int4CPULinear
from tests.specdec_core.kernels.marks import close, needs_fbgemm, needs_kernels

pytestmark = needs_kernels


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
    close(y[0], want[0], 3e-2)
