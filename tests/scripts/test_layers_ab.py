"""scripts/layers_ab.py on the tiny model: both paths timed, their logits compared bit for bit."""

from __future__ import annotations

import json

import pytest

from specdec_core.kernels import cpu
from tests.scripts import scripts_loaded

pytestmark = pytest.mark.skipif(cpu.load_library() is None,
                                reason="CPU kernels need AVX-512 or AVX2 with FMA, and a C compiler")


@pytest.mark.parametrize("quantization", ["none", "int4", "int8"])
def test_both_paths_give_the_same_logits_and_are_timed(tiny_dir, tmp_path, quantization):
    if quantization == "int8" and not cpu.load_library().specdec_has_int8():
        pytest.skip("AVX-512 kernels have the int8 draft kernel only with VNNI")
    out = tmp_path / "ab.json"
    with scripts_loaded("layers_ab") as (script,):
        code = script.main(["--draft", str(tiny_dir / "target"), "--quantization", quantization,
                            "--widths", "1,3", "--context", "20",
                            "--repeats", "3", "--threads", "1", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert set(report["widths"]) == {"1", "3"} and report["quantization"] == quantization
    for row in report["widths"].values():
        assert row["identical"] is True
        assert row["loop_ms"] > 0 and row["one_call_ms"] > 0 and row["paired_ratio"] > 0


def test_a_model_whose_layers_cannot_run_in_one_call_is_refused(tiny_dir):
    with scripts_loaded("layers_ab") as (script,), pytest.raises(SystemExit, match="one call"):
        script.main(["--draft", str(tiny_dir / "draft"), "--repeats", "1"])
