"""benchmarks/overlap/replay.py: rounds priced by hand against the script, and its run over a report."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks import load_script

replay = load_script("overlap/replay.py")
COSTS = {"draft_step_ms": 1.0, "verify_ms": {"1": 10.0, "5": 12.0}}


def test_a_verify_between_measured_widths_is_interpolated_and_flat_beyond():
    assert replay.verify_ms(COSTS, 3) == pytest.approx(11.0)
    assert replay.verify_ms(COSTS, 9) == 12.0 and replay.verify_ms(COSTS, 1) == 10.0


def test_rounds_priced_as_the_docstring_says():
    # Three rounds of 4 drafts: fresh drafts that pre-draft the next (a hit), the branch (pre-drafts again, a miss),
    # then fresh drafts again without pre-drafting. A verify of 5 (12 ms) has time for all 5 draft steps (1 ms).
    rounds = [(4, 4, False, True), (4, 1, True, True), (4, 2, False, False)]
    rpc = 0.5
    got = replay.replay(rounds, COSTS, rpc)
    tokens = 5 + 2 + 3
    verify = 12.0 + rpc
    sequential = 3 * (4 * 1.0 + rpc + verify)
    overlapped = (4.5 + max(verify, 5.5)) + (0 + max(verify, 5.5)) + (4.5 + verify)
    assert got["tokens"] == tokens
    assert got["sequential_tokens_per_s"] == pytest.approx(1e3 * tokens / sequential)
    assert got["overlapped_tokens_per_s"] == pytest.approx(1e3 * tokens / overlapped)
    assert got["plain_tokens_per_s"] == pytest.approx(1e3 / (10.0 + rpc))
    assert got["overlapped_over_sequential"] == pytest.approx(sequential / overlapped)


def test_a_branch_is_cut_to_the_draft_steps_that_fit_in_the_verify():
    """Draft steps of 5 ms beside verifies of 10-12 ms: a pre-draft has time for 2 steps (the guess and one draft),
    so the branch verified next holds one draft, and its round commits at most 2 tokens."""
    costs = {"draft_step_ms": 5.0, "verify_ms": {"1": 10.0, "5": 12.0}}
    got = replay.replay([(4, 4, False, True), (4, 4, True, False)], costs, 0.0)
    first = 4 * 5.0 + max(12.0, 2 * 5.0)
    second = replay.verify_ms(costs, 2)  # the branch's one draft, no draft call
    assert got["overlapped_tokens_per_s"] == pytest.approx(1e3 * (5 + 2) / (first + second))
    assert got["sequential_tokens_per_s"] == pytest.approx(1e3 * 10 / (2 * (20.0 + 12.0)))


def test_a_report_is_replayed_over_its_overlapped_engines_rounds(tmp_path, capsys):
    rows = [
        {"method": "draft_model", "round_outcomes": [[4, 4, False, False]]},
        {"method": "draft_model+overlap", "round_outcomes": [[4, 4, False, True], [4, 4, True, True]]},
    ]
    report = tmp_path / "methods.json"
    report.write_text(json.dumps({"methods": ["off", "draft_model", "draft_model+overlap"], "requests": rows}))
    out = tmp_path / "replay.json"
    assert replay.main(["--report", str(report), "--rpc-ms", "0,1", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["method"] == "draft_model+overlap" and written["rounds"] == 2 and written["hit_rate"] == 0.5
    assert len(written["rows"]) == 2 * len(replay.PRESETS)
    assert "branch hit rate 0.50" in capsys.readouterr().out
