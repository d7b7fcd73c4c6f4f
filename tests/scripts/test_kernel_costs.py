"""scripts/kernel_costs.py on the tiny model: every run measured in its own process, on the path it names."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from specdec_core.kernels import cpu

SCRIPT = Path(__file__).parents[2] / "scripts" / "kernel_costs.py"


def _script():
    spec = importlib.util.spec_from_file_location("kernel_costs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_run_reports_its_path_and_costs_relative_to_one_token(tiny_dir, tmp_path):
    out = tmp_path / "costs.json"
    model = str(tiny_dir / "target")
    code = _script().main(["--target", model, "--draft", model, "--target-widths", "1,3", "--draft-widths", "1,2",
                           "--context", "8", "--repeats", "1", "--threads", "1", "--json", str(out)])
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"target, kernels", "target, torch", "draft bf16, kernels", "draft int8, kernels",
                         "draft bf16, torch"}
    assert runs["target, torch"]["path"].startswith("torch fallback (SPECDEC_DISABLE_CPU_KERNELS")
    assert runs["target, kernels"]["path"].startswith("bf16 " if cpu.load_library() else "torch fallback")
    lib = cpu.load_library()
    assert ("int8" in runs["draft int8, kernels"]["path"]) is bool(lib and lib.specdec_has_int8())
    for run in runs.values():
        assert set(run["ms"]) == set(run["relative_to_first"]) and all(m > 0 for m in run["ms"].values())
        first = min(run["ms"], key=int)
        assert run["relative_to_first"][first] == 1.0
    assert sys.modules.get("kernel_costs") is None  # loaded without registering: nothing leaks to other tests
