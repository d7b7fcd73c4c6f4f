"""`specdec chaos` against a second application on the session's Serve: two replicas of each worker and of the
router, each fault made while greedy streams are in flight. No request may end wrong, no session may be left."""

from __future__ import annotations

import pytest

from specdec_tools.chaos import FAULTS, FaultReport, Outcome, _classify, chaos_overrides, format_table, run_chaos

APP = "specdec-chaos"
DIED = "actor died unexpectedly"
EXPECTED = (1, 2, 3, 4)


@pytest.mark.parametrize(
    "outcome,expected,verdict",
    [
        (Outcome(EXPECTED, "OK", ""), EXPECTED, "exact"),
        (Outcome((1, 2, 3, 5), "OK", ""), EXPECTED, "wrong"),  # a wrong token
        (Outcome((1, 2), "OK", ""), EXPECTED, "wrong"),  # ended early without saying so
        (Outcome((1, 2), "UNAVAILABLE", "target worker lost"), EXPECTED, "retryable"),
        (Outcome((1, 3), "UNAVAILABLE", "target worker lost"), EXPECTED, "wrong"),  # not a prefix
        (Outcome((1,), "UNAVAILABLE", ""), EXPECTED, "wrong"),  # no cause named
        (Outcome((1,), "INTERNAL", "boom"), EXPECTED, "wrong"),
        (
            Outcome((1,), "INTERNAL", f"The {DIED} before finishing. name: SERVE_REPLICA::a#Router#x"),
            EXPECTED,
            "router_died",
        ),
        (Outcome((1, 3), "INTERNAL", f"The {DIED}. name: SERVE_REPLICA::a#Router#x"), EXPECTED, "wrong"),
        (Outcome((1,), "INTERNAL", f"The {DIED}. name: SERVE_REPLICA::a#TargetWorker#x"), EXPECTED, "wrong"),
        (Outcome((), "INVALID_ARGUMENT", "sampling.top_k: at most 2147483647"), None, "refused_as_expected"),
        (Outcome((), "INTERNAL", "top_k"), None, "wrong"),
        (Outcome((7,), "OK", ""), None, "wrong"),  # the bad value was served
    ],
)
def test_each_request_is_counted_by_what_it_got(outcome, expected, verdict):
    report = FaultReport("x")
    _classify(report, outcome, expected)
    counts = {k: getattr(report, k) for k in ("exact", "retryable", "refused_as_expected", "router_died", "wrong")}
    assert counts == {k: int(k == verdict) for k in counts} and report.requests == 1


def test_the_fault_campaign_ends_no_request_wrong_and_leaks_no_session(served, tiny_dir, near_draft_dir):
    from ray import serve

    from deployments.app import build_app
    from deployments.serve_config import parse_config

    address, base = served
    data = chaos_overrides(tiny_dir)
    data["draft"]["model"] = str(near_draft_dir)  # a draft that agrees often: rounds accept, and reject
    config = parse_config({**data, "app_name": APP, "grpc_port": base.grpc_port, "http_port": base.http_port})
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    try:
        report = run_chaos(
            [address],
            APP,
            streams=4,
            slots=2 * config.target.max_sequences,
            stall_s=config.router.rpc_timeout_s + 3,
            idle_s=config.session_idle_timeout_s,
        )
    finally:
        serve.delete(APP)
    print(format_table(report))
    faults = {r["fault"]: r for r in report["faults"]}
    assert list(faults) == list(FAULTS)
    for fault, r in faults.items():
        assert r["wrong"] == 0, (fault, r["wrong_details"])
        assert r["leaked_sessions"] == 0, fault
        assert r["exact"] + r["retryable"] + r["refused_as_expected"] + r["router_died"] == r["requests"] > 0, fault
        assert r["router_died"] == 0 or fault == "kill-router", fault
        assert r["recovery_s"] is not None, fault  # serving again, exactly
    assert faults["bad-value"]["refused_as_expected"] == 1
    assert faults["bad-value"]["exact"] == faults["bad-value"]["requests"] - 1  # the good ones, untouched
    assert faults["kill-draft"]["exact"] == faults["kill-draft"]["requests"]  # a draft's loss costs speed only
    assert faults["fill-kv"]["exact"] == faults["fill-kv"]["requests"]  # queued, not refused
    assert report["passed"]
