"""scripts/cpu_limits.py: the probe builds for the kernels' vector width and measures both limits."""

from __future__ import annotations

import pytest

from specdec_core.kernels import cpu
from tests.scripts import scripts_loaded


@pytest.fixture(scope="module")
def limits():
    with scripts_loaded("cpu_limits") as modules:
        yield modules[0]


@pytest.mark.skipif(cpu.load_library() is None, reason="the probe, like the kernels, needs AVX2 or AVX-512")
def test_the_probe_uses_the_kernels_vector_width_and_reports_both_limits(limits):
    result = limits.measure(threads=1, repeats=1)
    assert result["lanes"] == (16 if cpu.kernel_info()["avx512"] else 8)
    # One thread's FMA chains do at least a lane's multiply-add a nanosecond, and reading a GiB takes under 10 s.
    assert result["fma_gflops"] > 2.0 * result["lanes"] * 0.1 and result["read_gbs"] > 0.1
