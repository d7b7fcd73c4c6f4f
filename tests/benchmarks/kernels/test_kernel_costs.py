"""benchmarks/kernels/kernel_costs.py on the tiny model: every run measured in its own process, on the path it names."""

from __future__ import annotations

import json
import sys

import pytest

from specdec_core.kernels import library
from tests.benchmarks import load_script


def _script():
    return load_script("kernels/kernel_costs.py")


def test_each_run_reports_its_path_and_costs_relative_to_one_token(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_KERNEL_CFLAGS", raising=False)
    out = tmp_path / "costs.json"
    model = str(tiny_dir / "target")
    baseline = "-DPREFETCH_BYTES=256 -DPREFETCH=256"
    code = _script().main(
        [
            "--target",
            model,
            "--draft",
            model,
            "--only",
            "target-torch,draft-int8",
            "--baseline-cflags",
            baseline,
            "--target-widths",
            "1,3",
            "--draft-widths",
            "1,2",
            "--context",
            "8",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    runs = report["runs"]
    # A baseline twin for the kernels run only: torch's path has no kernels to build otherwise.
    assert list(runs) == ["target, torch", "draft int8, kernels", "draft int8, kernels (baseline)"]
    assert report["baseline_cflags"] == baseline
    assert runs["target, torch"]["path"].startswith("torch fallback (SPECDEC_DISABLE_CPU_KERNELS")
    lib = library.load_library()
    for name in ("draft int8, kernels", "draft int8, kernels (baseline)"):
        assert ("int8" in runs[name]["path"]) is bool(lib and lib.specdec_has_int8())
    assert runs["draft int8, kernels"]["kernel_cflags"] == ""
    assert runs["draft int8, kernels (baseline)"]["kernel_cflags"] == baseline
    for run in runs.values():
        assert set(run["ms"]) == set(run["relative_to_first"]) and all(m > 0 for m in run["ms"].values())
        first = min(run["ms"], key=int)
        assert run["relative_to_first"][first] == 1.0
    assert sys.modules.get("kernel_costs") is None  # loaded without registering: nothing leaks to other tests


def test_an_unknown_run_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        _script().main(["--only", "target-kernels,draft-fp8", "--json", str(tmp_path / "costs.json")])
    assert exit_.value.code == 2
    assert "draft-fp8" in capsys.readouterr().err
    assert not (tmp_path / "costs.json").exists()
