"""`specdec bench peer` without a llama-server or a cluster: its flags, the plan of llama-server's runs, and our
model-free method."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from deployments.serve_config import DraftConfig
from specdec_tools.bench import peer
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


def test_the_plan_sweeps_the_draft_and_runs_ngram_types_only_on_edits():
    plan = peer.llama_plan({report.PROMPTS: []}, [3, 8], ["ngram-mod"])
    assert [(w, r, s.name) for w, r, s in plan] == [
        (report.PROMPTS, report.PLAIN, "no draft"),
        (report.PROMPTS, report.SPECULATIVE, "draft-simple n-max 3"),
        (report.PROMPTS, report.SPECULATIVE, "draft-simple n-max 8"),
    ]
    with_edits = peer.llama_plan({report.PROMPTS: [], report.EDIT: []}, [3], ["ngram-mod", "ngram-cache"])
    assert [s.name for w, r, s in with_edits if w == report.EDIT] == ["no draft", "ngram-mod", "ngram-cache"]


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


def test_sessions_run_at_one_request_at_a_time_against_its_best_draft_or_ngram_type():
    plan = peer.llama_plan({report.PROMPTS: [], report.SESSIONS: []}, [8], ["ngram-simple"])
    sessions = [(r, s.name) for w, r, s in plan if w == report.SESSIONS]
    assert sessions == [
        (report.PLAIN, "no draft"),
        (report.SPECULATIVE, "draft-simple n-max 8"),
        (report.SPECULATIVE, "ngram-simple"),
    ]
    bench = peer.PeerBenchConfig(None, Path("c.yaml"), Path("p.jsonl"), None, 16, (1, 4), (8,))
    work = peer._Work(bench, {}, [], str.split)
    assert work.concurrency(report.SESSIONS) == (1,) and work.concurrency(report.PROMPTS) == (1, 4)
