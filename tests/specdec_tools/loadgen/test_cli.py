"""`specdec bench serve`: bad flags name themselves; an unreachable server is exit code 1; and a real run against
the served stack of tiny models (real Ray Serve, real gRPC) gives the report's contract."""

from __future__ import annotations

import itertools
import json

import pytest

from specdec_tools.cli import main


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"prompt": "hello there"}) + "\n" + json.dumps({"prompt": "def f(x):", "max_tokens": 8}) + "\n"
    )
    return path


def bench_serve(address, prompts, out, *flags):
    return main(
        [
            "bench",
            "serve",
            "--address",
            address,
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "10",
            "--json",
            str(out),
            *flags,
        ]
    )


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--concurrency", "1,x"], "--concurrency"),
        (["--request-rate", "-1"], "--request-rate"),
        (["--concurrency", "1", "--goodput", "latency:50"], "--goodput"),
        (["--concurrency", "1", "--goodput", "ttft:-5"], "--goodput"),
        (["--concurrency", "1", "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
        (["--concurrency", "1", "--duration", "0"], "--duration"),
        (["--concurrency", "1", "--burstiness", "0"], "--burstiness"),
        (["--concurrency", "1", "--blocks", "0"], "--blocks"),
    ],
)
def test_a_bad_flag_value_fails_naming_the_flag(flags, named, prompts, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_serve("127.0.0.1:1", prompts, tmp_path / "out.json", *flags)
    assert exit_.value.code == 2
    assert f"argument {named}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, prompt_lines, named",
    [
        ([], None, "--concurrency"),  # no load point
        (["--concurrency", "1"], ['{"text": "no prompt key"}'], "--prompts"),
        (["--concurrency", "1"], ['{"prompt": "x", "max_tokens": 0}'], "--prompts"),
        (["--duration", "5", "--request-rate", "inf"], None, "--request-rate"),
        (["--concurrency", "1", "--num-requests", "2", "--blocks", "3"], None, "--blocks"),
        (["--concurrency", "1,8", "--num-requests", "12", "--blocks", "2"], None, "--num-requests"),  # 6 < 8 a block
    ],
)
def test_bad_input_is_an_error_naming_the_flag(flags, prompt_lines, named, prompts, tmp_path, capsys):
    if prompt_lines is not None:
        prompts.write_text("\n".join(prompt_lines) + "\n")
    assert bench_serve("127.0.0.1:1", prompts, tmp_path / "out.json", *flags) == 2
    assert f"error: {named}" in capsys.readouterr().err


def test_an_unreachable_address_is_an_error_and_exit_code_1(prompts, tmp_path, capsys):
    from deployments.ports import free_port as _free_port

    address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    assert bench_serve(address, prompts, tmp_path / "out.json", "--concurrency", "1", "--timeout", "10") == 1
    err = capsys.readouterr().err
    assert f"--address {address}" in err and "UNAVAILABLE" in err and "Traceback" not in err
    assert not (tmp_path / "out.json").exists()


def test_blocks_interleave_the_modes_and_pool_their_figures(tmp_path):
    """--blocks 3 with 7 requests a mode: blocks of 3, 2 and 2 requests, in the order A B, B A, A B; each mode sees
    the same request indices, and its figures pool all its blocks."""
    import asyncio

    from specdec_tools.loadgen.cli import LoadConfig, run_load
    from specdec_tools.loadgen.client import Concurrency, Prompt, Sampling
    from specdec_tools.loadgen.metrics import RequestRecord

    sent = []

    def sender(mode):
        async def send(index):
            sent.append((mode, index))
            return RequestRecord(chunk_times=(0.001,), chunk_tokens=(5,), e2el=0.001)

        return send

    config = LoadConfig(
        address="unused",
        prompts_path=tmp_path,
        prompts=(Prompt("p", 5),),
        max_new_tokens=5,
        loads=(Concurrency(1),),
        sampling=Sampling(0.0, 0, False),
        speculation=None,
        compare_off=True,
        num_requests=7,
        progress=False,
        blocks=3,
    )
    senders = {"speculative": sender("speculative"), "off": sender("off")}
    point = asyncio.run(run_load(config, Concurrency(1), senders, speculative_first=True))
    runs = [(mode, [i for m, i in sent if m == mode]) for mode in ("speculative", "off")]
    order = [mode for mode, _ in itertools.groupby(m for m, _ in sent)]
    assert order == ["speculative", "off", "speculative", "off"]  # A | B B | A A | B: A B B A A B
    assert [m for m, _ in sent][:3] == ["speculative"] * 3 and [m for m, _ in sent][3:8] == ["off"] * 5
    for _, indices in runs:
        assert indices == list(range(7))
    for mode in ("speculative", "off"):
        assert point[mode]["num_requests"] == 7 and point[mode]["total_output_tokens"] == 35
    assert len(point["speedup_by_block"]) == 3


def test_by_default_each_block_holds_the_concurrency(tmp_path):
    from specdec_tools.loadgen.cli import LoadConfig
    from specdec_tools.loadgen.client import Concurrency, Prompt, Sampling

    config = LoadConfig(
        address="unused",
        prompts_path=tmp_path,
        prompts=(Prompt("p", 5),) * 3,
        max_new_tokens=5,
        loads=(Concurrency(4),),
        sampling=Sampling(0.0, 0, False),
        speculation=None,
        blocks=2,
    )
    assert config.requests_per_point(Concurrency(4)) == 8  # 2 blocks of 4, not 3 prompts
    assert config.requests_per_point(Concurrency(1)) == 3  # every prompt once


LATENCY_KEYS = [
    f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p90", "p99")
]
MODE_KEYS = [
    "completed",
    "errors",
    "request_throughput",
    "output_throughput",
    "output_tokens_per_s",
    "request_goodput",
    "acceptance_rate",
    "mean_tokens_per_round",
    "proposed",
    "accepted",
    "rounds",
    *LATENCY_KEYS,
]


def test_load_points_against_the_served_stack_speculation_on_and_off(served, prompts, tmp_path):
    address, _ = served
    out = tmp_path / "report.json"
    assert (
        bench_serve(
            address,
            prompts,
            out,
            "--concurrency",
            "1,2",
            "--compare-off",
            "--ignore-eos",
            "--warmup",
            "1",
            "--goodput",
            "ttft:60000",
            "e2el:60000",
            "--auth-token",
            "secret",
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["address"] == address and report["max_new_tokens"] == 10
    assert report["server"]["num_speculative_tokens"] == "3"
    assert [p["concurrency"] for p in report["points"]] == [1, 2]
    for point in report["points"]:
        assert point["speedup"] > 0
        for mode in ("speculative", "off"):
            figures = point[mode]
            assert set(MODE_KEYS) <= set(figures)
            # max(2 prompts, the concurrency) requests, cycling the prompts: 10 tokens asked, then 8
            assert figures["num_requests"] == figures["completed"] == 2 and figures["errors"] == {}
            assert figures["total_output_tokens"] == 10 + 8
            assert figures["good_requests"] == 2
            assert figures["request_goodput"] == pytest.approx(figures["request_throughput"])
            assert 0 < figures["median_ttft_ms"] <= figures["median_e2el_ms"] and figures["median_tpot_ms"] > 0
            assert figures["output_tokens_per_s"] == figures["output_throughput"] > 0
        speculative, off = point["speculative"], point["off"]
        assert speculative["proposed"] > 0 and 0 <= speculative["accepted"] <= speculative["proposed"]
        assert speculative["acceptance_rate"] == pytest.approx(speculative["accepted"] / speculative["proposed"])
        assert off["proposed"] == 0 and off["accepted"] == 0 and off["rounds"] > 0
        assert off["mean_tokens_per_round"] == pytest.approx(1.0)
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_same_load_over_the_openai_http_api(served, prompts, tmp_path):
    _, config = served
    address = f"127.0.0.1:{config.http_port}"
    out = tmp_path / "report.json"
    assert (
        bench_serve(
            address,
            prompts,
            out,
            "--protocol",
            "openai",
            "--concurrency",
            "2",
            "--compare-off",
            "--ignore-eos",
            "--warmup",
            "1",
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["protocol"] == "openai" and report["server"]["id"] == config.served_name
    (point,) = report["points"]
    for mode in ("speculative", "off"):
        figures = point[mode]
        assert figures["completed"] == 2 and figures["errors"] == {}
        assert figures["total_output_tokens"] == 10 + 8  # token counts per chunk are exact (return_token_ids)
        assert 0 < figures["median_ttft_ms"] <= figures["median_e2el_ms"]
    assert point["speculative"]["proposed"] > 0 and point["off"]["proposed"] == 0
    assert point["off"]["mean_tokens_per_round"] == pytest.approx(1.0)


def test_an_unreachable_http_server_is_exit_code_1(prompts, tmp_path, capsys):
    from deployments.ports import free_port

    code = bench_serve(
        f"127.0.0.1:{free_port()}", prompts, tmp_path / "out.json", "--protocol", "openai", "--concurrency", "1"
    )
    assert code == 1 and "/v1/models" in capsys.readouterr().err
