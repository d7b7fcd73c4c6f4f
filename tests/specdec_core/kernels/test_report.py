"""What runs a built model (`report.py`): the kernel path named, and rows batch-invariant only on the kernels."""

from __future__ import annotations

from specdec_core import hardware
from specdec_core.build import prepare_model
from specdec_core.kernels import fbgemm_rows, library, report
from specdec_core.kernels.linear import int8_kernel_rows
from tests.specdec_core.kernels.marks import needs_kernels

pytestmark = needs_kernels


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
        # auto: 4-bit weights (on AVX-512 only with VNNI, which the int8 kernel needs there)
        draft = prepare_model(tiny_dir / "target", dtype="bfloat16", quantization="auto")
        int4 = f"int4 AVX2{_int8_rows(lib)}, layers in one call"
        assert report.kernel_path(draft.model) == f"bf16 {isa} ({native}) + {int4}"
        draft = prepare_model(tiny_dir / "target", dtype="bfloat16", quantization="int8")
        int8 = "int8 VNNI" if lib.specdec_has_vnni() else "int8 AVX2"
        assert report.kernel_path(draft.model) == f"bf16 {isa} ({native}) + {int8}, layers in one call"
    draft = prepare_model(tiny_dir / "target", dtype="bfloat16", quantization="int4")
    rows = _int8_rows(lib)
    assert report.kernel_path(draft.model) == f"bf16 {isa} ({native}) + int4 AVX2{rows}, layers in one call"
    assert report.rows_batch_invariant(draft.model) is not bool(rows)


def _int8_rows(lib) -> str:
    """Where a 4-bit draft's calls of many rows go here: the int8 kernel with VNNI, fbgemm beyond or without it."""
    start, vnni, fbgemm = fbgemm_rows.FROM_ROWS, int8_kernel_rows(lib), fbgemm_rows.available()
    if vnni:
        beyond = f", fbgemm from {fbgemm_rows.INT8_KERNEL_MAX_ROWS + 1}" if fbgemm else ""
        return f" (int8 VNNI from {start} rows{beyond})"
    return f" (int8 fbgemm from {start} rows)" if fbgemm else ""
