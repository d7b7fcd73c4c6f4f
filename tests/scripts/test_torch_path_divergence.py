"""scripts/torch_path_divergence.py on the tiny pair: it runs, switches the kernels off, and reports what it
measured consistently with its per-prompt records (the real pair is for a person to run: see its docstring)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from specdec_core.kernels import cpu

SCRIPT = Path(__file__).parents[2] / "scripts" / "torch_path_divergence.py"


@pytest.fixture()
def script(monkeypatch):
    monkeypatch.setenv("SPECDEC_DISABLE_CPU_KERNELS", "")  # restored afterwards: the script sets it
    cpu.load_library.cache_clear()
    spec = importlib.util.spec_from_file_location("torch_path_divergence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    cpu.load_library.cache_clear()


def test_reports_divergence_with_the_kernels_off(script, tiny_dir, near_draft_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "The quick brown fox"]))
    out = tmp_path / "out.json"
    assert script.main(["--target", str(tiny_dir / "target"), "--draft", str(near_draft_dir), "--prompts",
                        str(prompts), "--max-new-tokens", "12", "--num-speculative-tokens", "3", "--json",
                        str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["target_kernels"] == "torch fallback (SPECDEC_DISABLE_CPU_KERNELS is set)"
    assert report["rows_batch_invariant"] is False
    assert report["num_prompts"] == len(report["prompts"]) == 2
    diverging = [p for p in report["prompts"] if p["first_divergence"] is not None]
    assert report["diverging_prompts"] == len(diverging)
    for entry in report["prompts"]:
        same = entry["plain_token_ids"] == entry["speculative_token_ids"]
        assert same == (entry["first_divergence"] is None)
    assert report["logits_rows"] > 0 and 0 <= report["logits_bit_equal_rows"] <= report["logits_rows"]
