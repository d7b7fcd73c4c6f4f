"""benchmarks/overlap/served.py: each deployment pinned and set as its mode, and the table built from the runs."""

from __future__ import annotations

import json

import pytest

from deployments.serve_config import parse_config
from tests.benchmarks import load_script

served = load_script("overlap/served.py")
CONFIG = {"target": {"model": "t"}, "draft": {"method": "draft_model", "model": "d"}}


def run(role, workload, c, seconds, tokens, ids):
    return {
        "role": role,
        "workload": workload,
        "concurrency": c,
        "seconds": seconds,
        "tokens": tokens,
        "drafted": 0,
        "accepted": 0,
        "token_ids": ids,
    }


def test_pinned_sets_each_workers_cores_and_the_mode_and_nothing_else():
    config = parse_config(CONFIG)
    got = served.pinned(config, "on", [0], [1, 2])
    assert got.target.cpu_affinity == [0] and got.draft.cpu_affinity == [1, 2] and got.draft.overlap == "on"
    assert got.target.model == "t" and got.draft.method == "draft_model"
    assert config.draft.overlap == "auto" and config.target.cpu_affinity is None  # the original is untouched
    assert got.overlap == "on"  # what the router's engine is given


def test_shared_keeps_the_configs_placement_and_runs_sequential_rounds():
    config = parse_config({**CONFIG, "target": {"model": "t", "cpu_affinity": [3]}})
    got = served.pinned(config, "shared", [0], [1])
    assert got.target.cpu_affinity == [3] and got.draft.cpu_affinity is None and got.overlap == "off"


def test_summary_sums_rotations_and_compares_with_sequential_and_plain():
    ids = [[1, 2, 3]]
    runs = [
        run("plain", "prompts", 1, 4.0, 40, ids),
        run("sequential", "prompts", 1, 2.0, 40, ids),
        run("overlap on", "prompts", 1, 1.0, 20, ids),
        run("overlap on", "prompts", 1, 1.0, 20, [[1, 2, 4]]),  # a second rotation that differs from plain
    ]
    (row,) = served.summarise(runs)
    assert row["tokens_per_s"] == {"plain": 10.0, "sequential": 20.0, "overlap on": 20.0}
    assert row["vs_sequential"] == {"plain": 0.5, "overlap on": 1.0}
    assert row["identical_to_plain"] == {"plain": True, "sequential": True, "overlap on": False}


def test_main_deploys_every_mode_per_rotation_and_writes_the_report(tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps(CONFIG))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    monkeypatch.setattr(served, "Workloads", lambda args, model: None)
    deployed = []

    def measure(cfg, work, mode, rotation):
        deployed.append((mode, rotation, cfg.draft.overlap, cfg.target.cpu_affinity, cfg.draft.cpu_affinity))
        role = "sequential" if mode == "off" else f"overlap {mode}"
        extra = [run("plain", "prompts", 1, 2.0, 10, [[5]])] if mode == "off" else []
        return extra + [run(role, "prompts", 1, 1.0, 10, [[5]])]

    out = tmp_path / "r.json"
    argv = [str(config), "--target-cores", "0", "--draft-cores", "1", "--prompts", str(prompts), "--json", str(out)]
    assert served.main([*argv, "--rotations", "2", "--modes", "off,on"], measure) == 0
    assert deployed == [(m, r, m, [0], [1]) for r in (0, 1) for m in ("off", "on")]
    report = json.loads(out.read_text())
    assert report["table"][0]["vs_sequential"] == {"plain": 0.5, "overlap on": 1.0}
    assert len(report["runs"]) == 6


def test_modes_without_sequential_are_refused(tmp_path):
    argv = ["c.yaml", "--target-cores", "0", "--draft-cores", "1", "--prompts", "p", "--json", "r"]
    with pytest.raises(SystemExit, match="modes"):
        served.main([*argv, "--modes", "on,auto"])
