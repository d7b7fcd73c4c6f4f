"""benchmarks/kernels/kernel_ab.py on the tiny target: the kernels of a git revision built beside this checkout's,
each swapped into the model in turn, every kernel call timed under the build that made it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from specdec_core.kernels import library
from tests.benchmarks import scripts_loaded

pytestmark = pytest.mark.skipif(
    library.load_library() is None, reason="CPU kernels need AVX-512 or AVX2 with FMA, and a C compiler"
)
ROOT = Path(__file__).parents[3]


def _kernels_as_committed() -> bool:
    """Whether the kernel sources in the working tree are HEAD's (then both builds are the same code)."""
    return subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "specdec_core/kernels"], cwd=ROOT).returncode == 0


def test_both_builds_run_the_model_and_each_is_timed(tiny_dir, tmp_path):
    out = tmp_path / "ab.json"
    with scripts_loaded("kernels/kernel_ab.py") as (script,):
        script.main(
            [
                "--model",
                str(tiny_dir / "target"),
                "--base",
                "HEAD",
                "--widths",
                "1,3",
                "--context",
                "20",
                "--repeats",
                "2",
                "--threads",
                "1",
                "--json",
                str(out),
            ]
        )
    report = json.loads(out.read_text())
    assert [row["width"] for row in report["widths"]] == [1, 3]
    for row in report["widths"]:
        assert row["ms"]["base"] > 0 and row["ms"]["head"] > 0 and row["ratio_median"] > 0
        gemms = [key for key in row["kernel_ms"] if key.startswith("specdec_gemm_bf16")]
        # The LM head's GEMM, and the layers: their attention and GEMMs call by call, or all in one call.
        assert gemms and {"specdec_attention_bf16", "specdec_layers_quant"} & set(row["kernel_ms"])
        for ms in row["kernel_ms"].values():  # each build's own calls ran under each build: the swap reached all
            assert ms["base"] > 0 and ms["head"] > 0
        if _kernels_as_committed():
            assert row["identical_logits"] is True


def test_a_revision_git_does_not_know_is_refused(tiny_dir, tmp_path):
    with scripts_loaded("kernels/kernel_ab.py") as (script,), pytest.raises(subprocess.CalledProcessError):
        script.main(
            [
                "--model",
                str(tiny_dir / "target"),
                "--base",
                "no-such-revision",
                "--widths",
                "1",
                "--repeats",
                "1",
                "--json",
                str(tmp_path / "ab.json"),
            ]
        )
