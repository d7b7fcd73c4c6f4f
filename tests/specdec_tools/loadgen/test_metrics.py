"""The load generator's figures from hand-made request records, against values worked out by hand."""

from __future__ import annotations

import pytest

from specdec_tools.loadgen.metrics import (
    RequestRecord,
    distribution_ms,
    errors_by_code,
    inter_token_latencies,
    meets_slos,
    summarize,
    time_per_output_token,
)

# A speculative stream: 1 token from prefill at 0.1 s, a round of 4 at 0.5 s, a round of 1 at 0.8 s; ends at 0.9 s.
FIRST = RequestRecord(
    chunk_times=(0.1, 0.5, 0.8), chunk_tokens=(1, 4, 1), e2el=0.9, prompt_tokens=10, rounds=2, proposed=6, accepted=4
)
# 1 token at 0.2 s, then 3 at 0.6 s; ends at 0.7 s.
SECOND = RequestRecord(
    chunk_times=(0.2, 0.6), chunk_tokens=(1, 3), e2el=0.7, prompt_tokens=5, rounds=1, proposed=3, accepted=2
)
FAILED = RequestRecord(e2el=0.05, error="UNAVAILABLE")
ONE_TOKEN = RequestRecord(chunk_times=(0.3,), chunk_tokens=(1,), e2el=0.35)


def test_itl_spreads_each_gap_evenly_over_the_later_chunks_tokens():
    assert inter_token_latencies(FIRST.chunk_times, FIRST.chunk_tokens) == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.3])
    assert inter_token_latencies(SECOND.chunk_times, SECOND.chunk_tokens) == pytest.approx([0.4 / 3] * 3)
    assert inter_token_latencies((0.3,), (1,)) == []
    assert inter_token_latencies((), ()) == []


def test_tpot_is_the_time_after_the_first_token_over_the_tokens_after_it():
    assert time_per_output_token(0.9, 0.1, 6) == pytest.approx(0.16)
    assert FIRST.tpot == pytest.approx(0.16) and SECOND.tpot == pytest.approx(0.5 / 3)
    assert time_per_output_token(0.35, 0.3, 1) is None and ONE_TOKEN.tpot is None
    assert FAILED.ttft is None and FAILED.tpot is None and FAILED.output_tokens == 0


def test_distribution_in_milliseconds_with_linear_percentiles():
    got = distribution_ms([0.004, 0.001, 0.003, 0.002], "x")
    # sorted 1, 2, 3, 4 ms; p90 at rank 0.9 * 3 = 2.7 -> 3 + 0.7 * (4 - 3); p99 at rank 2.97
    assert got == pytest.approx({"mean_x_ms": 2.5, "median_x_ms": 2.5, "p90_x_ms": 3.7, "p99_x_ms": 3.97})
    assert distribution_ms([0.02], "y") == pytest.approx(
        {"mean_y_ms": 20, "median_y_ms": 20, "p90_y_ms": 20, "p99_y_ms": 20}
    )
    assert distribution_ms([], "z") == {"mean_z_ms": 0.0, "median_z_ms": 0.0, "p90_z_ms": 0.0, "p99_z_ms": 0.0}


@pytest.mark.parametrize(
    "slos, first, second",
    [
        ({}, True, True),
        ({"ttft": 100}, True, False),  # 100 ms meets an SLO of 100 ms; 200 ms does not
        ({"ttft": 99.9}, False, False),
        ({"tpot": 165}, True, False),  # TPOTs 160 and 166.7 ms
        ({"e2el": 800}, False, True),  # E2ELs 900 and 700 ms
        ({"ttft": 250, "tpot": 170, "e2el": 1000}, True, True),
        ({"ttft": 250, "tpot": 170, "e2el": 850}, False, True),
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slos, first, second):
    assert meets_slos(FIRST, slos) is first
    assert meets_slos(SECOND, slos) is second


def test_failed_requests_never_meet_slos_and_one_token_requests_meet_any_tpot():
    assert not meets_slos(FAILED, {}) and not meets_slos(FAILED, {"e2el": 1e9})
    assert meets_slos(ONE_TOKEN, {"tpot": 0.001}) and not meets_slos(ONE_TOKEN, {"ttft": 299})


def test_errors_are_counted_by_status_name():
    records = [
        FIRST,
        RequestRecord(error="UNAVAILABLE"),
        RequestRecord(error="DEADLINE_EXCEEDED"),
        RequestRecord(error="UNAVAILABLE"),
    ]
    assert errors_by_code(records) == {"DEADLINE_EXCEEDED": 1, "UNAVAILABLE": 2}
    assert list(errors_by_code(records)) == ["DEADLINE_EXCEEDED", "UNAVAILABLE"]
    assert errors_by_code([FIRST, SECOND]) == {}


def test_summary_of_a_load_point():
    got = summarize([FIRST, SECOND, FAILED], duration_s=2.0, slos_ms={"ttft": 150})
    assert got["num_requests"] == 3 and got["completed"] == 2 and got["failed"] == 1
    assert got["errors"] == {"UNAVAILABLE": 1}
    assert got["total_input_tokens"] == 15 and got["total_output_tokens"] == 10
    assert got["request_throughput"] == pytest.approx(1.0)
    assert got["output_throughput"] == got["output_tokens_per_s"] == pytest.approx(5.0)
    assert got["duration"] == 2.0 and got["total_token_throughput"] == pytest.approx((15 + 10) / 2)
    assert got["good_requests"] == 1 and got["request_goodput"] == pytest.approx(0.5)
    assert got["mean_ttft_ms"] == pytest.approx(150) and got["median_ttft_ms"] == pytest.approx(150)
    assert got["mean_tpot_ms"] == pytest.approx((160 + 500 / 3) / 2)
    # ITLs: 100 ms x4 and 300 ms (first), 133.3 ms x3 (second): mean 1.1 s / 8, median between 100 and 133.3
    assert got["mean_itl_ms"] == pytest.approx(137.5)
    assert got["median_itl_ms"] == pytest.approx((100 + 400 / 3) / 2)
    assert got["mean_e2el_ms"] == pytest.approx(800) and got["p99_e2el_ms"] == pytest.approx(700 + 0.99 * 200)
    assert (got["rounds"], got["proposed"], got["accepted"]) == (3, 9, 6)
    assert got["acceptance_rate"] == pytest.approx(6 / 9)
    assert got["mean_tokens_per_round"] == pytest.approx((10 - 2) / 3)  # the first token of each is from prefill


def test_summary_with_nothing_completed_or_proposed():
    got = summarize([FAILED], duration_s=1.0, slos_ms={})
    assert got["completed"] == 0 and got["errors"] == {"UNAVAILABLE": 1}
    assert got["output_tokens_per_s"] == 0.0 and got["acceptance_rate"] == 0.0 and got["mean_tokens_per_round"] == 0.0
    assert got["median_tpot_ms"] == 0.0
    assert summarize([], duration_s=0.0, slos_ms={})["request_throughput"] == 0.0
