"""`specdec bench gpu` on a CPU with --quick: one run end to end writes every part into its report, every check
passing, the graphs-on runs equal to graphs off and through the runners' buckets, the goals not judged off a GPU;
and flags that cannot work are refused before anything runs. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from specdec_core.drafters import registry
from specdec_tools.bench.gpu.goals import NOT_A_GPU
from specdec_tools.bench.gpu.run import PARTS
from specdec_tools.cli import main

RECORDED = {
    "target": "t",
    "draft": "d",
    "workload": "prompts",
    "device": "cpu",
    "methods": ["off", "draft_model"],
    "headline_group": "all",
    "results": {"draft_model": {"all": {"decode_speedup": 2.0}}},
    "requests": [
        {
            "method": "off",
            "group": "all",
            "by_method": {"none": {"rounds": 9, "proposed": 0, "accepted": 0, "tokens": 9}},
        },
        {
            "method": "draft_model",
            "group": "all",
            "by_method": {"draft_model": {"rounds": 2, "proposed": 8, "accepted": 7, "tokens": 9}},
        },
    ],
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_gpu")
    (root / "recorded.json").write_text(json.dumps(RECORDED))
    out = root / "report.json"
    argv = ["bench", "gpu", "--device", "cpu", "--quick", "--threads", "1", "--json", str(out)]
    code = main([*argv, "--recorded", str(root / "recorded.json")])
    return code, json.loads(out.read_text()), root


def test_the_quick_run_passes_and_reports_every_part(run):
    code, report, _ = run
    assert code == 0 and report["ok"] and not report["failed"]
    assert report["parts"] == list(PARTS)
    for key in ("environment", "exactness_float32", "sampler_law", "costs", "projection"):
        assert "error" not in report[key], key
    assert all(check["ok"] for check in report["checks"])


def test_graphs_on_every_method_equals_graphs_off_through_the_buckets(run):
    graphed = run[1]["exactness_float32"]["graphs"]
    methods = {entry["method"].split("/")[0] for entry in graphed}
    assert methods == {"none", *registry.METHODS}
    for entry in graphed:
        assert entry["identical"] and not entry["verdict"]["vs_graphs_off"] and not entry["verdict"]["vs_plain"]
        assert entry["graph_counters"]["target"]["replays"] > 0
    cut = [e for e in graphed if e["method"].endswith("near_cut")]
    assert cut and all(e["graph_counters"]["draft_eager_because"] for e in cut)


def test_costs_cover_both_pairs_and_the_goals_are_not_judged_off_a_gpu(run):
    costs = run[1]["costs"]
    assert set(costs["pairs"]) == {"qwen", "llama"}
    for pair in costs["pairs"].values():
        assert {(f["role"], f["batch"], f["width"]) for f in pair["forwards"]} >= {("target", 1, 1), ("draft", 1, 1)}
        assert all(f["ratio"] == pytest.approx(f["ms"] / f["limit_ms"]) for f in pair["forwards"])
        assert pair["rounds"]["speculative"]["rounds_timed"] > 0 and pair["rounds"]["plain"]["rounds_timed"] > 0
    assert costs["goals"] and {g["verdict"] for g in costs["goals"]} == {NOT_A_GPU}


def test_the_projection_prices_the_recorded_report_at_the_measured_costs(run):
    _, report, root = run
    projection = report["projection"]
    priced = projection["reports"][str(root / "recorded.json")]
    assert set(priced) == {"draft_model"}  # plain decoding is the baseline, not a method priced
    costs = projection["costs"]
    verify = {int(w): ms for w, ms in costs["verify_ms"].items()}
    # 2 rounds of 4 drafts: v(5) each, 8 draft steps; 9 tokens plain at v(1) each.
    spec = 2 * (verify[5] + costs["round_host_ms"]) + 8 * costs["draft_step_ms"]
    plain = 9 * (verify[1] + costs["plain_host_ms"])
    assert priced["draft_model"]["speedup"] == pytest.approx(plain / spec)
    assert priced["draft_model"]["recorded_decode_speedup"] == 2.0


@pytest.mark.parametrize(
    "flags",
    [["--parts", "projection"], ["--parts", "exactness,bogus"], ["--parts", ""]],
    ids=["projection without costs", "unknown part", "no part"],
)
def test_parts_that_cannot_run_are_refused_before_anything_runs(tmp_path, flags, capsys):
    out = tmp_path / "report.json"
    try:
        code = main(["bench", "gpu", "--device", "cpu", "--quick", "--json", str(out), *flags])
    except SystemExit as exc:  # argparse refuses a bad value itself
        code = exc.code
    assert code == 2 and not out.exists()
    assert "--parts" in capsys.readouterr().err
