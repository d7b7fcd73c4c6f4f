"""benchmarks/kernels/vs_llamacpp.py: llama-bench's JSON read as milliseconds a forward, medians over rounds,
ours / theirs.

llama.cpp is not installed by the suite; a stand-in `llama-bench` prints what the real one prints with `-o json`
(the fields read: n_prompt, n_gen, avg_ns), a different time each round, so that a wrong unit, field or median shows.
"""

from __future__ import annotations

import json
import stat

from tests.benchmarks import load_script

FAKE = """#!/usr/bin/env python3
import json, pathlib, sys
args = sys.argv[1:]
counter = pathlib.Path(sys.argv[0]).with_suffix(".count")
calls = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(calls + 1))
scale = 1 + calls // 2  # draft and target each round: rounds run 1x, 2x, 3x slower
gen, prompts = int(args[args.index("-n") + 1]), [int(p) for p in args[args.index("-p") + 1].split(",")]
tests = [{"n_prompt": 0, "n_gen": gen, "n_depth": 600, "avg_ns": scale * gen * 20_000_000}] if gen else []
tests += [{"n_prompt": p, "n_gen": 0, "n_depth": 600, "avg_ns": scale * (100 + 10 * p) * 1_000_000}
          for p in prompts if p]
print(json.dumps(tests))
"""


def _script():
    return load_script("kernels/vs_llamacpp.py")


def test_rounds_are_read_in_milliseconds_and_compared_by_their_medians(tmp_path, monkeypatch):
    binary = tmp_path / "llama-bench"
    binary.write_text(FAKE)
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    module = _script()
    monkeypatch.setattr(
        module,
        "ours",
        lambda widths, context, threads: {"target": {str(w): 50.0 + 5 * w for w in widths}, "draft": {"1": 15.0}},
    )
    out = tmp_path / "report.json"
    code = module.main(
        [
            "--llama-bench",
            str(binary),
            "--draft-gguf",
            "d.gguf",
            "--target-gguf",
            "t.gguf",
            "--target-widths",
            "1,5",
            "--rounds",
            "3",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert [r["llama.cpp"]["draft"]["1"] for r in report["rounds"]] == [20.0, 40.0, 60.0]
    assert [r["llama.cpp"]["target"]["5"] for r in report["rounds"]] == [150.0, 300.0, 450.0]
    assert report["draft"] == {"specdec_ms": {"1": 15.0}, "llama_cpp_ms": {"1": 40.0}, "ratio": {"1": 0.375}}
    assert report["target"]["llama_cpp_ms"] == {"1": 40.0, "5": 300.0}
    assert report["target"]["ratio"] == {"1": round(55 / 40, 3), "5": round(75 / 300, 3)}
