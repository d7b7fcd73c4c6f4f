"""The PNG and the printed summary from a made-up report: both load kinds, both modes, an infinite rate."""

from __future__ import annotations

from specdec_tools.loadgen.cli import format_summary
from specdec_tools.loadgen.metrics import RequestRecord, summarize
from specdec_tools.loadgen.plot import plot_report

RECORD = RequestRecord(chunk_times=(0.1, 0.5), chunk_tokens=(1, 3), e2el=0.6, rounds=1, proposed=3, accepted=2)


def figures(seconds):
    return summarize([RECORD, RequestRecord(error="UNAVAILABLE")], seconds, {})


REPORT = {
    "address": "127.0.0.1:9000",
    "server": {"target_model": "/models/target"},
    "points": [
        {"concurrency": 1, "speculative": figures(1.0), "off": figures(2.0), "speedup": 2.0},
        {"concurrency": 4, "speculative": figures(0.5), "off": figures(1.0), "speedup": 2.0},
        {"request_rate": 2.0, "speculative": figures(1.0)},
        {"request_rate": "inf", "speculative": figures(1.0)},
    ],
}


def test_the_plot_is_a_png(tmp_path):
    path = tmp_path / "sub" / "load.png"
    plot_report(REPORT, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_report_of_only_an_infinite_rate_still_plots(tmp_path):
    path = tmp_path / "inf.png"
    plot_report({**REPORT, "points": REPORT["points"][3:]}, path)
    assert path.stat().st_size > 0


def test_the_summary_has_a_line_per_point_and_mode():
    lines = format_summary(REPORT).splitlines()
    assert len([line for line in lines if "speculative" in line]) == 4
    assert len([line for line in lines if " off " in line]) == 2
    assert sum("speedup" in line and "2.00x" in line for line in lines) == 2
    assert any("request rate inf" in line for line in lines)
    assert sum("{'UNAVAILABLE': 1}" in line for line in lines) == 6
