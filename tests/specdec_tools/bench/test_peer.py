"""`specdec bench peer` without a llama-server or a cluster: its flags, the plan of llama-server's runs, and our
model-free method."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from specdec_tools.bench import peer
from specdec_tools.bench import peer_client as client
from specdec_tools.bench import peer_report as report
from specdec_tools.cli import build_parser, main

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


def test_the_sweep_plan_runs_the_draft_n_max_on_prompts_and_ngram_types_only_on_edits():
    plan = peer.llama_plan({report.PROMPTS: []}, [3, 8], ["ngram-mod"], [Path("d.gguf")])
    assert [(w, s.name) for w, s in plan] == [
        (report.PROMPTS, "draft-simple n-max 3"),
        (report.PROMPTS, "draft-simple n-max 8"),
    ]
    with_edits = peer.llama_plan(
        {report.PROMPTS: [], report.EDIT: []}, [3], ["ngram-mod", "ngram-cache"], [Path("d.gguf")]
    )
    assert [s.name for w, s in with_edits if w == report.EDIT] == ["ngram-mod", "ngram-cache"]


def test_sessions_run_at_one_request_at_a_time_against_its_best_draft_or_ngram_type():
    plan = peer.llama_plan({report.PROMPTS: [], report.SESSIONS: []}, [8], ["ngram-simple"], [Path("d.gguf")])
    assert [s.name for w, s in plan if w == report.SESSIONS] == ["draft-simple n-max 8", "ngram-simple"]
    bench = peer.PeerBenchConfig(None, Path("c.yaml"), Path("p.jsonl"), None, 16, (1, 4), (8,))
    work = peer._Work(bench, {}, [], str.split)
    assert work.concurrency(report.SESSIONS) == (1,) and work.concurrency(report.PROMPTS) == (1, 4)


# -- taking turns ----------------------------------------------------------------------------------------------------


def test_prompts_are_cut_into_chunks_of_c_and_sessions_into_conversations():
    bench = peer.PeerBenchConfig(None, Path("c.yaml"), Path("p.jsonl"), None, 16, (1, 4), (8,))
    prompts = [[i] for i in range(10)]
    work = peer._Work(bench, {report.PROMPTS: prompts}, [], str.split, sessions=[("s", ("a", "b"))] * 3)
    chunks = work.chunks(report.PROMPTS, 4)
    assert [len(chunk.args[0]) for chunk in chunks] == [4, 4, 2]
    assert [list(x) for chunk in chunks for x in chunk.args[0]] == prompts  # each prompt once, in order
    assert all(chunk.args[2] == 4 for chunk in chunks)  # sent 4 at a time
    assert len(work.chunks(report.PROMPTS, 1)) == 10
    work = dataclasses.replace(work, encode_conversation=lambda conversation: [])
    assert [chunk.args[0] for chunk in work.chunks(report.SESSIONS, 1)] == [[("s", ("a", "b"))]] * 3


def completion(n):
    return client.Completion((n,), "", n, 0, 0, "server")


def test_the_side_going_first_swaps_at_every_chunk_and_each_side_sums_its_own():
    order = []

    def side(name, seconds):
        def call(chunk):
            order.append((name, chunk))
            return seconds, (completion(chunk),)

        return call

    ours, theirs = peer.take_turns([1, 2, 3], side("ours", 1.0), side("theirs", 2.0))
    assert order == [("ours", 1), ("theirs", 1), ("theirs", 2), ("ours", 2), ("ours", 3), ("theirs", 3)]
    assert ours == (3.0, (completion(1), completion(2), completion(3)))
    assert theirs == (6.0, (completion(1), completion(2), completion(3)))
