"""`specdec bench sessions`: bad flags and files name the flag; the replay against a fake server sends what the
command promises (history, salts, seeds, the order of the modes); and a real run against the served stack of tiny
models, over both APIs, gives the report's contract."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import pytest

from specdec_tools.cli import main

SESSIONS = [
    {"id": "add", "system": "You are a coding assistant.", "turns": ["def add(a, b):", "Add a docstring.", "A test?"]},
    {"system": "You review Python code.", "turns": ["x = [1, 2]", "Explain it."]},
]


@pytest.fixture
def sessions_file(tmp_path):
    path = tmp_path / "sessions.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in SESSIONS))
    return path


def bench_sessions(address, sessions, out, *flags):
    return main(
        [
            "bench",
            "sessions",
            "--address",
            address,
            "--sessions",
            str(sessions),
            "--max-new-tokens",
            "4",
            "--json",
            str(out),
            *flags,
        ]
    )


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--num-speculative-tokens", "x"], "--num-speculative-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--protocol", "http"], "--protocol"),
        (["--num-sessions", "0"], "--num-sessions"),
        (["--timeout", "0"], "--timeout"),
    ],
)
def test_a_bad_flag_value_fails_naming_the_flag(flags, named, sessions_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_sessions("127.0.0.1:1", sessions_file, tmp_path / "out.json", *flags)
    assert exit_.value.code == 2
    assert f"argument {named}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "lines, flags, named",
    [
        (None, ["--num-sessions", "3"], "--num-sessions"),  # the file holds 2
        (["not json"], [], "--sessions"),
        ([{"turns": ["hi"]}], [], "--sessions"),  # no system prompt
        ([{"system": "s", "turns": []}], [], "--sessions"),
        ([{"system": "s", "turns": ["hi", 3]}], [], "--sessions"),
        ([{"system": "s", "turns": ["hi"], "turn": ["typo"]}], [], "--sessions"),  # unknown key
        ([{"id": "a", "system": "s", "turns": ["hi"]}, {"id": "a", "system": "s", "turns": ["hi"]}], [], "--sessions"),
        ([], [], "--sessions"),  # no sessions at all
    ],
)
def test_a_bad_file_is_an_error_naming_the_flag(lines, flags, named, sessions_file, tmp_path, capsys):
    if lines is not None:
        sessions_file.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    assert bench_sessions("127.0.0.1:1", sessions_file, tmp_path / "out.json", *flags) == 2
    assert f"error: {named}" in capsys.readouterr().err


def test_a_missing_file_is_an_error_naming_the_flag(tmp_path, capsys):
    assert bench_sessions("127.0.0.1:1", tmp_path / "nowhere.jsonl", tmp_path / "out.json") == 2
    assert "error: --sessions" in capsys.readouterr().err


def test_the_shipped_sessions_file_reads():
    from pathlib import Path

    from specdec_tools.requests import read_sessions

    sessions = read_sessions(Path(__file__).parents[3] / "benchmarks/sessions/coding.jsonl")
    assert 6 <= len(sessions) <= 8 and all(3 <= len(s.turns) <= 4 for s in sessions)
    assert all("```" in s.system for s in sessions)  # each system prompt holds the code under discussion


def test_an_unreachable_address_is_exit_code_1(sessions_file, tmp_path, capsys):
    from deployments.ports import free_port

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    assert bench_sessions(address, sessions_file, tmp_path / "out.json", "--timeout", "10") == 1
    assert f"--address {address}" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


# -- the replay, against a fake server -----------------------------------------------------------------------------


class FakeServer:
    """Answers every turn with a text naming it; records what each request carried. `fail` names (salt suffix,
    user text) pairs to answer with an error."""

    def __init__(self, fail=()):
        self.sent, self.fail = [], set(fail)

    async def send(self, prompt, index, sampling, speculation, *, history=(), cache_salt=""):
        from specdec_tools.loadgen.metrics import RequestRecord

        self.sent.append(
            {
                "text": prompt.text,
                "index": index,
                "history": history,
                "salt": cache_salt,
                "max_tokens": prompt.max_tokens,
                "speculation": speculation,
            }
        )
        mode = "cached" if cache_salt.endswith("-cached") else "uncached"
        if (mode, prompt.text) in self.fail:
            return RequestRecord(e2el=0.01, error="INTERNAL")
        prompt_tokens = 10 * (len(history) + 1)
        return RequestRecord(
            chunk_times=(0.01, 0.02),
            chunk_tokens=(1, 3),
            e2el=0.03,
            prompt_tokens=prompt_tokens,
            cached_tokens=prompt_tokens - 10 if mode == "cached" else 0,
            text=f"answer to {prompt.text}",
        )


def replay_fake(monkeypatch, tmp_path, server):
    from specdec_tools.bench import sessions as module
    from specdec_tools.loadgen.client import Sampling
    from specdec_tools.requests import read_sessions

    @asynccontextmanager
    async def connect(protocol, address, auth_token, timeout_s):
        yield {"id": "fake"}, server.send

    monkeypatch.setattr(module, "connect", connect)
    path = tmp_path / "sessions.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in SESSIONS))
    config = module.SessionsConfig(
        address="unused",
        sessions_path=path,
        sessions=read_sessions(path),
        max_new_tokens=4,
        sampling=Sampling(0.0, 0, False),
        speculation="auto",
        progress=False,
    )
    return asyncio.run(module.run(config))


def test_each_turn_carries_the_history_of_its_mode_and_the_salts_keep_the_modes_apart(monkeypatch, tmp_path):
    server = FakeServer()
    report = replay_fake(monkeypatch, tmp_path, server)
    sent = server.sent
    assert len(sent) == 2 * (3 + 2)
    modes = ["cached" if s["salt"].endswith("-cached") else "uncached" for s in sent]
    assert modes == ["cached"] * 3 + ["uncached"] * 3 + ["uncached"] * 2 + ["cached"] * 2  # alternating first
    for request in sent:
        session = SESSIONS[0] if request["index"] < 3 else SESSIONS[1]
        turn = session["turns"].index(request["text"])
        assert request["index"] == (0 if session is SESSIONS[0] else 3) + turn  # the same seeds in both modes
        expected = [("system", session["system"])]
        for earlier in session["turns"][:turn]:
            expected += [("user", earlier), ("assistant", f"answer to {earlier}")]
        assert list(request["history"]) == expected
        assert request["max_tokens"] == 4 and request["speculation"] == "auto"
    cached = [s["salt"] for s, m in zip(sent, modes) if m == "cached"]
    uncached = [s["salt"] for s, m in zip(sent, modes) if m == "uncached"]
    assert len(set(cached[:3])) == 1 and len(set(cached[3:])) == 1 and cached[0] != cached[3]  # one per session
    assert len(set(uncached)) == len(uncached) and not set(uncached) & set(cached)  # one per request
    assert report["identical_turns"] == 5 and report["different_turns"] == 0 and report["identical"]
    assert report["modes"]["cached"]["later_turns"] == report["modes"]["uncached"]["later_turns"] == 3
    assert report["prefill_tokens_saved"] == report["modes"]["cached"]["cached_tokens"] > 0
    assert report["modes"]["uncached"]["cached_tokens"] == 0
    assert [row["first"] for row in report["turns"]] == ["cached"] * 3 + ["uncached"] * 2
    assert report["modes"]["cached"]["median_decode_tokens_per_s"] == pytest.approx(3 / 0.02)


def test_after_a_failed_turn_the_rest_of_the_session_is_not_sent(monkeypatch, tmp_path):
    server = FakeServer(fail={("uncached", "Add a docstring.")})
    report = replay_fake(monkeypatch, tmp_path, server)
    assert not any(s["text"] == "A test?" and not s["salt"].endswith("-cached") for s in server.sent)
    uncached = report["modes"]["uncached"]
    assert uncached["failed"] == 2 and uncached["errors"] == {"EARLIER_TURN_FAILED": 1, "INTERNAL": 1}
    assert report["modes"]["cached"]["failed"] == 0
    assert report["identical_turns"] == 3 and report["different_turns"] == 0 and not report["identical"]
    assert [row["identical"] for row in report["turns"]] == [True, None, None, True, True]


# -- the served stack ----------------------------------------------------------------------------------------------

TURN_KEYS = {
    "ttft_ms",
    "decode_tokens_per_s",
    "e2el_ms",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "text",
    "error",
}
MODE_KEYS = {
    "turns",
    "completed",
    "failed",
    "errors",
    "later_turns",
    "median_ttft_ms",
    "mean_ttft_ms",
    "median_decode_tokens_per_s",
    "mean_decode_tokens_per_s",
    "median_e2el_ms",
    "mean_e2el_ms",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
}
REPORT_KEYS = {
    "address",
    "protocol",
    "sessions",
    "num_sessions",
    "num_turns",
    "max_new_tokens",
    "temperature",
    "num_speculative_tokens",
    "run_id",
    "server",
    "modes",
    "ttft_ratio",
    "prefill_tokens_saved",
    "identical_turns",
    "different_turns",
    "identical",
    "turns",
}


@pytest.mark.parametrize("protocol", ["grpc", "openai"])
def test_sessions_against_the_served_stack(protocol, served, sessions_file, tmp_path, capsys):
    grpc_address, config = served
    address = grpc_address if protocol == "grpc" else f"127.0.0.1:{config.http_port}"
    out = tmp_path / "report.json"
    assert (
        bench_sessions(address, sessions_file, out, "--protocol", protocol, "--ignore-eos", "--auth-token", "secret")
        == 0
    )
    print(capsys.readouterr().out)  # the table, for whoever runs with -s
    report = json.loads(out.read_text())
    assert REPORT_KEYS <= set(report) and report["protocol"] == protocol
    assert report["num_sessions"] == 2 and report["num_turns"] == 5 and report["temperature"] == 0.0
    assert len(report["turns"]) == 5
    for name in ("cached", "uncached"):
        figures = report["modes"][name]
        assert MODE_KEYS <= set(figures)
        assert figures["completed"] == figures["turns"] == 5 and figures["failed"] == 0 and figures["errors"] == {}
        assert figures["later_turns"] == 3 and figures["output_tokens"] == 5 * 4
        assert 0 < figures["median_ttft_ms"] <= figures["median_e2el_ms"]
        assert figures["median_decode_tokens_per_s"] > 0
        assert isinstance(figures["cached_tokens"], int) and 0 <= figures["cached_tokens"] <= figures["prompt_tokens"]
        rows = [row[name] for row in report["turns"]]
        assert all(TURN_KEYS <= set(row) and row["error"] is None and row["output_tokens"] == 4 for row in rows)
        assert all(isinstance(row["cached_tokens"], int) and row["cached_tokens"] >= 0 for row in rows)
        for session in ("add", "line-2"):
            prompts = [row[name]["prompt_tokens"] for row in report["turns"] if row["session"] == session]
            assert all(later > earlier for earlier, later in zip(prompts, prompts[1:]))  # the history grows
    assert report["identical_turns"] == 5 and report["different_turns"] == 0 and report["identical"]
    assert all(row["cached"]["text"] == row["uncached"]["text"] for row in report["turns"])
    assert any(row["cached"]["text"] for row in report["turns"])  # the answers' text is collected (greedy: fixed)
    assert report["prefill_tokens_saved"] == report["modes"]["cached"]["cached_tokens"]
    assert report["ttft_ratio"] > 0
