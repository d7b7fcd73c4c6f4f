"""`specdec bench peer` without a llama-server or a cluster: the flags' lists, llama-server's command lines and the
speculation types read from its help, the best of a sweep, the table and its ratios from measured runs, the
equality counts, the completions as each server answers them, and the client's concurrency against a fake server.
No timing is asserted: only how the figures relate."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from deployments.serve_config import DraftConfig
from specdec_tools.bench import peer
from specdec_tools.bench import peer_llama as llama
from specdec_tools.cli import build_parser, main

SETUP = llama.LlamaSetup(Path("bin/llama-server"), Path("t.gguf"), Path("d.gguf"), threads=2)
HELP = """\
--spec-draft-n-max N                    number of tokens to draft for speculative decoding (default: 3)
--spec-type none,draft-simple,draft-eagle3,ngram-simple,ngram-map-k,ngram-mod,ngram-cache
                                        comma-separated list of types of speculative decoding to use (default:
--draft, --draft-n, --draft-max N       the argument has been removed. use --spec-draft-n-max or
"""


def completion(ids, tokens=None):
    return peer.Completion(tuple(ids), "", len(ids) if tokens is None else tokens, 0, 0, "server")


def run(system, role, setting, c, tokens, seconds, workload=peer.PROMPTS, ids=((1, 2),), error=""):
    """A run of len(ids) prompts generating `tokens` in all over `seconds`."""
    done = [completion(i, 0) for i in ids]
    done[0] = completion(ids[0], tokens)
    return peer.Run(system, workload, role, setting, c, seconds, tuple(done), error=error)


# -- flags -----------------------------------------------------------------------------------------------------------


def test_positive_ints_keep_order_and_drop_repeats():
    assert peer.positive_ints("1,4") == (1, 4)
    assert peer.positive_ints(" 8, 3 ,8,") == (8, 3)


@pytest.mark.parametrize("text", ["", "0,1", "-1", "a,2", "1.5"])
def test_positive_ints_refuse_what_is_not_a_list_of_positive_integers(text):
    with pytest.raises(argparse.ArgumentTypeError):
        peer.positive_ints(text)


def test_the_command_defaults_to_concurrency_1_4_and_n_max_3_5_8_12():
    args = build_parser().parse_args(
        ["bench", "peer", "--llama-server", "L", "--target-gguf", "T", "--draft-gguf", "D", "--config", "C"]
        + ["--prompts", "P", "--json", "out.json"]
    )
    assert (args.concurrency, args.draft_n_max, args.max_new_tokens) == ((1, 4), (3, 5, 8, 12), 128)
    assert args.edit_prompts is None and args.threads >= 1


def test_a_missing_binary_is_an_error_naming_its_flag(tmp_path, capsys):
    code = main(
        ["bench", "peer", "--llama-server", str(tmp_path / "nope"), "--target-gguf", "T", "--draft-gguf", "D"]
        + ["--config", "C", "--prompts", "P", "--json", str(tmp_path / "out.json")]
    )
    assert code == 2
    assert "--llama-server" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


# -- llama-server ----------------------------------------------------------------------------------------------------


def test_the_plain_server_command_gives_every_slot_the_same_context():
    command = llama.server_command(SETUP, llama.LlamaSpeculation(), port=8090, parallel=4)
    assert command == [
        "bin/llama-server",
        "-m",
        "t.gguf",
        "--port",
        "8090",
        "-c",
        str(4 * llama.CONTEXT_PER_SLOT),
        "-t",
        "2",
        "-np",
        "4",
    ]


def test_a_draft_setting_adds_the_draft_model_its_type_and_n_max():
    (setting,) = llama.draft_sweep([5])
    command = llama.server_command(SETUP, setting, port=1, parallel=1)
    assert command[-6:] == ["-md", "d.gguf", "--spec-type", "draft-simple", "--spec-draft-n-max", "5"]
    assert setting.name == "draft-simple n-max 5"


def test_an_ngram_setting_names_its_type_and_loads_no_draft():
    command = llama.server_command(SETUP, llama.LlamaSpeculation("ngram-mod"), port=1, parallel=1)
    assert command[-2:] == ["--spec-type", "ngram-mod"]
    assert "-md" not in command


def test_the_speculation_types_are_read_from_the_binarys_help():
    assert llama.spec_types(HELP)[:2] == ("none", "draft-simple")
    assert llama.ngram_types(HELP) == ("ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")
    assert llama.ngram_types("no such flag here") == ()


def test_the_plan_sweeps_the_draft_and_runs_ngram_types_only_on_edits():
    plan = peer.llama_plan({peer.PROMPTS: []}, [3, 8], ["ngram-mod"])
    assert [(w, r, s.name) for w, r, s in plan] == [
        (peer.PROMPTS, peer.PLAIN, "no draft"),
        (peer.PROMPTS, peer.SPECULATIVE, "draft-simple n-max 3"),
        (peer.PROMPTS, peer.SPECULATIVE, "draft-simple n-max 8"),
    ]
    with_edits = peer.llama_plan({peer.PROMPTS: [], peer.EDIT: []}, [3], ["ngram-mod", "ngram-cache"])
    assert [s.name for w, r, s in with_edits if w == peer.EDIT] == ["no draft", "ngram-mod", "ngram-cache"]


def test_a_server_that_exits_is_an_error_quoting_its_log():
    command = [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3") as failure, llama.llama_server(command, port=1):
        pass
    assert "no such model" in str(failure.value)


# -- completions -----------------------------------------------------------------------------------------------------


def never(text):
    raise AssertionError("the ids were in the answer")


def test_our_answer_gives_its_ids_and_speculation_counts():
    answer = {
        "choices": [{"text": "ab", "token_ids": [5, 6]}],
        "usage": {"completion_tokens": 2},
        "speculation": {"proposed": 7, "accepted": 4},
    }
    assert peer.parse_completion(answer, never) == peer.Completion((5, 6), "ab", 2, 7, 4, "server")


def test_llama_servers_answer_gives_its_ids_under_verbose_and_drafts_in_timings():
    answer = {
        "choices": [{"text": "ab"}],
        "usage": {"completion_tokens": 2},
        "__verbose": {"tokens": [5, 6]},
        "timings": {"draft_n": 3, "draft_n_accepted": 1},
    }
    assert peer.parse_completion(answer, never) == peer.Completion((5, 6), "ab", 2, 3, 1, "server")


def test_an_answer_without_ids_is_retokenized_and_says_so():
    answer = {"choices": [{"text": "ab"}], "usage": {"completion_tokens": 2}}
    got = peer.parse_completion(answer, lambda text: [ord(ch) for ch in text])
    assert (got.token_ids, got.ids_from, got.drafted) == ((97, 98), "text", 0)


class FakeServer:
    """An OpenAI-style completions endpoint that answers only once `concurrency` requests are in flight together
    (a barrier: a client that sends fewer at a time gets 500s), echoing each prompt's last id."""

    def __init__(self, concurrency):
        barrier, bodies = threading.Barrier(concurrency, timeout=5), []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                bodies.append(body)
                try:
                    barrier.wait()
                except threading.BrokenBarrierError:
                    self.send_response(500)
                    self.end_headers()
                    return
                n = body["max_tokens"]
                answer = {
                    "choices": [{"text": "x" * n, "token_ids": [body["prompt"][-1]] * n}],
                    "usage": {"completion_tokens": n},
                }
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.bodies = bodies
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def test_the_client_sends_one_body_c_at_a_time_and_keeps_the_prompts_order():
    fake = FakeServer(concurrency=4)
    endpoint = peer.Endpoint(fake.url, "m", extras={"return_token_ids": True})
    prompts = [[1, 10], [1, 11], [1, 12], [1, 13], [1, 14], [1, 15], [1, 16], [1, 17]]
    try:
        seconds, done = peer.run_set(endpoint, prompts, 3, concurrency=4, retokenize=never)
    finally:
        fake.server.shutdown()
    assert [c.token_ids for c in done] == [(p[-1],) * 3 for p in prompts]
    assert seconds > 0 and sum(c.completion_tokens for c in done) == 24
    expected = {"model": "m", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": False}
    assert all(body.items() >= {**expected, "return_token_ids": True}.items() for body in fake.bodies)
    assert sorted(body["prompt"] for body in fake.bodies) == prompts


# -- the report ------------------------------------------------------------------------------------------------------


def test_the_best_of_a_sweep_is_the_fastest_that_did_not_fail():
    runs = [
        run(peer.LLAMA, peer.SPECULATIVE, "draft-simple n-max 3", 1, 30, 2.0),
        run(peer.LLAMA, peer.SPECULATIVE, "draft-simple n-max 5", 1, 40, 2.0),
        run(peer.LLAMA, peer.SPECULATIVE, "draft-simple n-max 8", 1, 0, 0.0, error="exited with 1"),
        run(peer.LLAMA, peer.SPECULATIVE, "draft-simple n-max 12", 4, 90, 2.0),
    ]
    assert peer.best_run(runs, peer.PROMPTS, peer.LLAMA, peer.SPECULATIVE, 1).setting == "draft-simple n-max 5"
    assert peer.best_run(runs, peer.PROMPTS, peer.LLAMA, peer.PLAIN, 1) is None
    assert peer.best_run(runs, peer.EDIT, peer.LLAMA, peer.SPECULATIVE, 1) is None


MEASURED = [
    run(peer.LLAMA, peer.PLAIN, "no draft", 1, 20, 2.0),  # 10 tok/s
    run(peer.LLAMA, peer.SPECULATIVE, "draft-simple n-max 3", 1, 30, 2.0),  # 15
    run(peer.LLAMA, peer.SPECULATIVE, "draft-simple n-max 8", 1, 40, 2.0),  # 20
    run(peer.SPECDEC, peer.PLAIN, "off", 1, 24, 2.0),  # 12
    run(peer.SPECDEC, peer.SPECULATIVE, "on", 1, 50, 2.0),  # 25
    run(peer.LLAMA, peer.PLAIN, "no draft", 4, 40, 2.0),  # 20; no speculative llama run at c = 4
    run(peer.SPECDEC, peer.PLAIN, "off", 4, 30, 2.0),  # 15
]


def test_the_table_gives_each_configurations_best_and_names_the_setting():
    rows = {r["configuration"]: r["cells"] for r in peer.table(MEASURED, [peer.PROMPTS], [1, 4])}
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
    got = {r["ratio"]: r["values"] for r in peer.ratios(MEASURED, [peer.PROMPTS], [1, 4])}
    assert got[peer.RATIOS[peer.SPECULATIVE]] == {"1": pytest.approx(25 / 20), "4": None}
    assert got[peer.RATIOS[peer.PLAIN]] == {"1": pytest.approx(12 / 10), "4": pytest.approx(15 / 20)}


def test_equality_counts_the_prompts_each_speculative_run_shares_with_its_servers_plain_run():
    plain_ids, other = ((1, 2), (3, 4), (5, 6)), ((1, 2), (3, 9), (5, 6))
    runs = [
        run(peer.LLAMA, peer.PLAIN, "no draft", 1, 6, 1.0, ids=plain_ids),
        run(peer.LLAMA, peer.SPECULATIVE, "draft-simple n-max 5", 1, 6, 1.0, ids=other),
        run(peer.SPECDEC, peer.PLAIN, "off", 1, 6, 1.0, ids=plain_ids),
        run(peer.SPECDEC, peer.SPECULATIVE, "on", 1, 6, 1.0, ids=plain_ids),
        run(peer.LLAMA, peer.SPECULATIVE, "ngram-mod", 1, 0, 0.0, workload=peer.EDIT, error="failed"),
    ]
    assert peer.identical_count(runs[1], runs[0]) == 2
    rows = {(e["system"], e["setting"]): (e["identical"], e["prompts"]) for e in peer.equality(runs)}
    assert rows == {(peer.LLAMA, "draft-simple n-max 5"): (2, 3), (peer.SPECDEC, "on"): (3, 3)}


def bench_config():
    return peer.PeerBenchConfig(SETUP, Path("c.yaml"), Path("p.jsonl"), None, 16, (1, 4), (3, 8))


def test_the_report_says_whether_ours_stayed_exact_and_prints_one_table():
    workloads = {peer.PROMPTS: [[1, 2]]}
    report = peer.build_report(bench_config(), {}, "version: x", workloads, MEASURED, ["a note"])
    assert report["specdec_identical_to_plain"] is True
    assert report["runs"][1]["command"] is None and report["runs"][1]["tokens_per_s"] == 15.0
    text = peer.format_table(report)
    assert "draft-simple n-max 8" in text and "1.25x" in text and "0.75x" in text
    assert "llama-server draft-simple n-max 3 == its plain (prompts, c=1): 1/1 prompts" in text
    assert "note: a note" in text

    wrong = [*MEASURED[:4], run(peer.SPECDEC, peer.SPECULATIVE, "on", 1, 50, 2.0, ids=((9, 9),))]
    assert peer.build_report(bench_config(), {}, "", workloads, wrong, [])["specdec_identical_to_plain"] is False
    assert peer.build_report(bench_config(), {}, "", workloads, MEASURED[:3], [])["specdec_identical_to_plain"] is None


@pytest.mark.parametrize(
    ("draft", "method"),
    [
        (DraftConfig(method="draft_model", model="m"), None),
        (DraftConfig(method="hybrid", model="m"), "suffix"),
        (DraftConfig(method="ngram"), "ngram"),
        (DraftConfig(method="none"), None),
    ],
)
def test_our_model_free_method_is_the_configs_own_or_a_hybrids_free_part(draft, method):
    assert peer.model_free_method(draft) == method
