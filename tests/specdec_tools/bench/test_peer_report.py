"""What `specdec bench peer` makes of measured runs: the best of a sweep, the table and its ratios, the equality counts,
the report. No timing is asserted: only how the figures relate."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec_tools.bench import peer
from specdec_tools.bench import peer_client as client
from specdec_tools.bench import peer_llama as llama
from specdec_tools.bench import peer_report as report

SETUP = llama.LlamaSetup(Path("bin/llama-server"), Path("t.gguf"), (Path("d.gguf"),), threads=2)


def completion(ids, tokens=None):
    return client.Completion(tuple(ids), "", len(ids) if tokens is None else tokens, 0, 0, "server")


def run(system, role, setting, c, tokens, seconds, workload=report.PROMPTS, ids=((1, 2),), error="", paired=False):
    """A run of len(ids) prompts generating `tokens` in all over `seconds`."""
    done = [completion(i, 0) for i in ids]
    done[0] = completion(ids[0], tokens)
    return report.Run(system, workload, role, setting, c, seconds, tuple(done), error=error, paired=paired)


# -- the report ------------------------------------------------------------------------------------------------------


def test_the_best_of_a_sweep_is_the_fastest_that_did_not_fail():
    runs = [
        run(report.LLAMA, report.SPECULATIVE, "draft-simple n-max 3", 1, 30, 2.0),
        run(report.LLAMA, report.SPECULATIVE, "draft-simple n-max 5", 1, 40, 2.0),
        run(report.LLAMA, report.SPECULATIVE, "draft-simple n-max 8", 1, 0, 0.0, error="exited with 1"),
        run(report.LLAMA, report.SPECULATIVE, "draft-simple n-max 12", 4, 90, 2.0),
    ]
    assert report.best_run(runs, report.PROMPTS, report.LLAMA, report.SPECULATIVE, 1).setting == "draft-simple n-max 5"
    assert report.best_run(runs, report.PROMPTS, report.LLAMA, report.PLAIN, 1) is None
    assert report.best_run(runs, report.EDIT, report.LLAMA, report.SPECULATIVE, 1) is None


def test_a_cell_shows_the_paired_run_over_a_faster_sweep_run():
    sweep = run(report.LLAMA, report.SPECULATIVE, "draft-simple n-max 8", 1, 50, 2.0)  # alone: 25 tok/s
    paired = run(report.LLAMA, report.SPECULATIVE, "draft-simple n-max 8", 1, 40, 2.0, paired=True)  # 20
    ours = run(report.SPECDEC, report.SPECULATIVE, "on", 1, 50, 2.0, paired=True)
    assert report.headline_run([sweep, paired], report.PROMPTS, report.LLAMA, report.SPECULATIVE, 1) is paired
    assert report.headline_run([sweep], report.PROMPTS, report.LLAMA, report.SPECULATIVE, 1) is sweep
    got = {r["ratio"]: r["values"]["1"] for r in report.ratios([sweep, paired, ours], [report.PROMPTS], [1])}
    assert got[report.RATIOS[report.SPECULATIVE]] == pytest.approx(25 / 20)
    built = report.build_report(bench_config(), {}, "", {report.PROMPTS: [[1]]}, [sweep, paired, ours], [])
    assert built["sweep"] == [
        {
            "workload": report.PROMPTS,
            "setting": "draft-simple n-max 8",
            "concurrency": 1,
            "tokens_per_s": 25.0,
            "error": None,
        }
    ]
    assert "llama-server sweep, alone: draft-simple n-max 8 (prompts, c=1): 25.00 tok/s" in report.format_table(built)


MEASURED = [
    run(report.LLAMA, report.PLAIN, "no draft", 1, 20, 2.0),  # 10 tok/s
    run(report.LLAMA, report.SPECULATIVE, "draft-simple n-max 3", 1, 30, 2.0),  # 15
    run(report.LLAMA, report.SPECULATIVE, "draft-simple n-max 8", 1, 40, 2.0),  # 20
    run(report.SPECDEC, report.PLAIN, "off", 1, 24, 2.0),  # 12
    run(report.SPECDEC, report.SPECULATIVE, "on", 1, 50, 2.0),  # 25
    run(report.LLAMA, report.PLAIN, "no draft", 4, 40, 2.0),  # 20; no speculative llama run at c = 4
    run(report.SPECDEC, report.PLAIN, "off", 4, 30, 2.0),  # 15
]


def test_the_table_gives_each_configurations_best_and_names_the_setting():
    rows = {r["configuration"]: r["cells"] for r in report.table(MEASURED, [report.PROMPTS], [1, 4])}
    assert rows["llama-server, no draft"] == {
        "1": {"tokens_per_s": 10.0, "setting": "no draft"},
        "4": {"tokens_per_s": 20.0, "setting": "no draft"},
    }
    assert rows["llama-server, draft-simple (best n-max)"]["1"] == {
        "tokens_per_s": 20.0,
        "setting": "draft-simple n-max 8",
    }
    assert rows["llama-server, draft-simple (best n-max)"]["4"] is None
    assert rows["specdec serve, on"]["1"]["tokens_per_s"] == 25.0
    assert len(rows) == 4  # no edit prompts: no edit rows


def test_the_ratios_divide_ours_by_llama_servers_best_at_each_concurrency():
    got = {r["ratio"]: r["values"] for r in report.ratios(MEASURED, [report.PROMPTS], [1, 4])}
    assert got[report.RATIOS[report.SPECULATIVE]] == {"1": pytest.approx(25 / 20), "4": None}
    assert got[report.RATIOS[report.PLAIN]] == {"1": pytest.approx(12 / 10), "4": pytest.approx(15 / 20)}


def test_equality_counts_the_prompts_each_speculative_run_shares_with_its_servers_plain_run():
    plain_ids, other = ((1, 2), (3, 4), (5, 6)), ((1, 2), (3, 9), (5, 6))
    runs = [
        run(report.LLAMA, report.PLAIN, "no draft", 1, 6, 1.0, ids=plain_ids),
        run(report.LLAMA, report.SPECULATIVE, "draft-simple n-max 5", 1, 6, 1.0, ids=other),
        run(report.SPECDEC, report.PLAIN, "off", 1, 6, 1.0, ids=plain_ids),
        run(report.SPECDEC, report.SPECULATIVE, "on", 1, 6, 1.0, ids=plain_ids),
        run(report.LLAMA, report.SPECULATIVE, "ngram-mod", 1, 0, 0.0, workload=report.EDIT, error="failed"),
    ]
    assert report.identical_count(runs[1], runs[0]) == 2
    rows = {(e["system"], e["setting"]): (e["identical"], e["prompts"]) for e in report.equality(runs)}
    assert rows == {(report.LLAMA, "draft-simple n-max 5"): (2, 3), (report.SPECDEC, "on"): (3, 3)}


def bench_config():
    return peer.PeerBenchConfig(SETUP, Path("c.yaml"), Path("p.jsonl"), None, 16, (1, 4), (3, 8))


def test_the_report_says_whether_ours_stayed_exact_and_prints_one_table():
    workloads = {report.PROMPTS: [[1, 2]]}
    built = report.build_report(bench_config(), {}, "version: x", workloads, MEASURED, ["a note"])
    assert built["specdec_identical_to_plain"] is True
    assert built["runs"][1]["command"] is None and built["runs"][1]["tokens_per_s"] == 15.0
    text = report.format_table(built)
    assert "draft-simple n-max 8" in text and "1.25x" in text and "0.75x" in text
    assert "llama-server draft-simple n-max 3 == its plain (prompts, c=1): 1/1 prompts" in text
    assert "note: a note" in text

    wrong = [*MEASURED[:4], run(report.SPECDEC, report.SPECULATIVE, "on", 1, 50, 2.0, ids=((9, 9),))]
    assert report.build_report(bench_config(), {}, "", workloads, wrong, [])["specdec_identical_to_plain"] is False
    assert (
        report.build_report(bench_config(), {}, "", workloads, MEASURED[:3], [])["specdec_identical_to_plain"] is None
    )
