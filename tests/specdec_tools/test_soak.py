"""`specdec soak` against the session's served stack (tiny models): a short soak must end with no error, no
session left in the workers, and memory figures for every worker process."""

from __future__ import annotations

import time

import pytest

from specdec_tools.cli import build_parser
from specdec_tools.soak import make_variant, run_soak, verdict


def test_a_short_soak_has_no_errors_and_leaves_no_session(served):
    address, config = served
    start = time.monotonic()
    report = run_soak(address, config.app_name, concurrency=3, duration_s=9.0, seed=1, cancel_fraction=0.2)
    assert time.monotonic() - start < 120

    assert report["requests"]["errors"] == 0, report["errors_by_status"]
    assert report["requests"]["ok"] > 0
    assert report["requests"]["total"] == report["requests"]["ok"] + report["requests"]["cancelled_on_purpose"]
    assert report["tokens"] > 0
    assert report["sessions_left"] == 0
    assert report["passed"] and report["failures"] == []

    workers = report["workers"]
    kinds = sorted(w["kind"] for w in workers)
    assert kinds == ["draft", "draft", "target"]  # the fixture's one target and two draft replicas
    for w in workers:
        for key in ("rss_start_bytes", "rss_peak_bytes", "rss_end_bytes"):
            assert isinstance(w[key], int) and w[key] > 0, (key, w)
        assert w["pid"] > 0 and w["address"], w
        assert w["active_sessions_end"] == 0
    # Every request that reached the stack started a target session.
    target = next(w for w in workers if w["kind"] == "target")
    assert target["sessions_started"] > 0


def test_requests_vary_and_repeat_with_the_seed():
    variants = [make_variant(i, seed=3, cancel_fraction=0.1) for i in range(300)]
    tags = {tag for v in variants for tag in v.tags}
    assert {"greedy", "sampled", "spec=off", "spec=auto", "spec=server", "token_ids", "cancel"} <= tags
    assert [v.request for v in variants[:20]] == [make_variant(i, 3, 0.1).request for i in range(20)]
    cancelled = [v for v in variants if v.cancel_after_chunks is not None]
    assert all(v.request.sampling.ignore_eos and v.request.sampling.max_tokens == 64 for v in cancelled)


def test_verdict_fails_on_errors_sessions_left_or_no_completed_request():
    assert verdict(ok=10, errors=0, sessions_left=0, unreadable_workers=0, workers=3) == []
    assert verdict(10, 2, 0, 0, 3) == ["2 errors"]
    assert verdict(10, 0, 1, 0, 3) == ["1 sessions left open in the workers"]
    assert verdict(0, 0, 0, 0, 3) == ["no request completed"]
    assert len(verdict(10, 0, 0, 1, 3)) == 1


def test_soak_arguments():
    args = build_parser().parse_args(["soak", "--concurrency", "6", "--minutes", "0.5", "--json", "out.json"])
    assert (args.concurrency, args.minutes, str(args.json), args.config) == (6, 0.5, "out.json", None)
    defaults = build_parser().parse_args(["soak"])
    assert defaults.concurrency > 0 and defaults.minutes > 0 and defaults.json is None
    for bad in (["--concurrency", "0"], ["--minutes", "-1"], ["--concurrency", "two"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["soak", *bad])
