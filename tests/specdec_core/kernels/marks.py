"""What the kernel tests share: marks that skip where a kernel cannot run, and a relative-error check."""

from __future__ import annotations

import pytest
import torch

from specdec_core.kernels import fbgemm_rows, library

needs_kernels = pytest.mark.skipif(
    library.load_library() is None, reason="CPU kernels need AVX-512 or AVX2 with FMA, and a C compiler"
)
needs_int8 = pytest.mark.skipif(
    not library.load_library() or not library.load_library().specdec_has_int8(),
    reason="AVX-512 kernels have the int8 draft kernel only with VNNI",
)
needs_fbgemm = pytest.mark.skipif(not fbgemm_rows.available(), reason="this torch has no x86 int8 GEMM (fbgemm)")


def close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < rel, err
