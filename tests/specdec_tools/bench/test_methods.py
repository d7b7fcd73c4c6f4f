"""`specdec bench methods` on tiny models: every method's output equals plain decoding's at temperature 0, the
counts add up, the ratios are the ratios of the reported rates, and bad input is refused naming its flag before
any model loads. No timing is asserted: only how the figures relate."""

from __future__ import annotations

import json

import pytest

from specdec_core.chat import ChatMessage, encode_chat
from specdec_core.drafters import registry
from specdec_core.errors import InvalidArgument
from specdec_tools.bench.methods_report import (
    HYBRID_CRITERION,
    LATER_TURNS,
    OFF,
    TURN_1,
    format_table,
    hybrid_comparison,
)
from specdec_tools.bench.methods_run import MethodsBenchConfig, engine_names, run_methods_bench
from specdec_tools.cli import main

PROMPTS = ["def add(a, b):", "x = 1\ny = 2\nx = 1\ny = 2\n"]
SESSIONS = [
    {"id": "add", "system": "You are a coding assistant.", "turns": ["def add(a, b):", "Add a docstring.", "A test?"]},
    {"id": "list", "system": "You review Python code.", "turns": ["x = [1, 2]", "Explain it."]},
]
EXPECTED = (OFF, *registry.METHODS)  # hybrid too, once it is registered
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("methods")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (root / "sessions.jsonl").write_text("".join(json.dumps(s) + "\n" for s in SESSIONS))
    return root


def bench(tiny_dir, near_draft_dir, **settings):
    config = MethodsBenchConfig(
        target=str(tiny_dir / "target"),
        draft=str(near_draft_dir),
        dtype="float32",
        max_new_tokens=NEW_TOKENS,
        progress=False,
        **settings,
    )
    return run_methods_bench(config)


@pytest.fixture(scope="module")
def prompts_report(tiny_dir, near_draft_dir, files):
    return bench(tiny_dir, near_draft_dir, prompts=files / "prompts.jsonl")


@pytest.fixture(scope="module")
def sessions_report(tiny_dir, near_draft_dir, files):
    return bench(tiny_dir, near_draft_dir, sessions=files / "sessions.jsonl")


def rows(report, method):
    return [r for r in report["requests"] if r["method"] == method]


def assert_ratios_are_of_the_rates(report):
    for group in report["groups"]:
        off = report["results"][OFF][group]
        for method in report["methods"]:
            f = report["results"][method][group]
            assert f["speedup"] == pytest.approx(f["tokens_per_s"] / off["tokens_per_s"])
            assert f["decode_speedup"] == pytest.approx(f["decode_tokens_per_s"] / off["decode_tokens_per_s"])
            assert f["tokens_per_round"] == pytest.approx((f["output_tokens"] - f["requests"]) / f["rounds"])
            # Every round is counted once, under the method whose proposal it verified ("none": no proposal).
            parts = f["rounds_by_method"]
            assert sum(p["rounds"] for p in parts.values()) == f["rounds"]
            assert sum(p["tokens"] for p in parts.values()) == f["output_tokens"] - f["requests"]
            assert sum(p["proposed"] for p in parts.values()) == f["proposed"]
            assert sum(p["accepted"] for p in parts.values()) == f["accepted"]
            assert 0 < sum(p["seconds"] for p in parts.values()) <= f["decode_seconds"]
            allowed = {"off": set(), "hybrid": {"suffix", "draft_model"}}.get(method, {method})
            assert set(parts) <= allowed | {"none"}, (method, parts)
    headline = report["headline_group"]
    assert report["headline_decode_speedup"] == {
        m: report["results"][m][headline]["decode_speedup"] for m in report["methods"]
    }


def test_prompts_every_method_gives_plain_decodings_tokens(prompts_report):
    report = prompts_report
    assert report["methods"] == list(EXPECTED) and {"ngram", "suffix", "draft_model"} <= set(report["methods"])
    assert report["workload"] == "prompts" and report["groups"] == ["all"] and report["prefix_caching"] is False
    assert report["all_identical"] is True
    off_ids = {r["item"]: r["token_ids"] for r in rows(report, OFF)}
    for method in report["methods"]:
        f = report["results"][method]["all"]
        assert f["requests"] == len(PROMPTS) == f["identical"]
        assert [r["token_ids"] for r in rows(report, method)] == [off_ids[r["item"]] for r in rows(report, method)]
        assert f["output_tokens"] == sum(r["output_tokens"] for r in rows(report, method))
        assert 0 < f["decode_seconds"] <= f["seconds"] and f["accepted"] <= f["proposed"]
    assert {"cpus", "processor"} <= set(report["machine"])


def test_prompts_counts_and_ratios_add_up(prompts_report):
    report = prompts_report
    off = report["results"][OFF]["all"]
    assert off["proposed"] == 0 and off["rounds"] == off["output_tokens"] - off["requests"]  # one token a round
    assert off["speedup"] == off["decode_speedup"] == 1.0
    assert report["results"]["draft_model"]["all"]["proposed"] > 0  # the near draft always proposes
    assert_ratios_are_of_the_rates(report)


def test_prompts_the_order_of_the_methods_rotates(prompts_report):
    methods = prompts_report["methods"]
    for i in range(len(PROMPTS)):
        order = [r["method"] for r in prompts_report["requests"] if r["item"] == f"prompt-{i}"]
        assert order == methods[i:] + methods[:i]


def test_sessions_turn_groups_partition_the_turns(sessions_report):
    report = sessions_report
    turns = sum(len(s["turns"]) for s in SESSIONS)
    assert report["num_turns"] == turns and report["groups"] == [TURN_1, LATER_TURNS]
    assert report["headline_group"] == LATER_TURNS and report["prefix_caching"] is True
    for method in report["methods"]:
        first, later = report["results"][method][TURN_1], report["results"][method][LATER_TURNS]
        assert first["requests"] == len(SESSIONS) and first["requests"] + later["requests"] == turns
        assert first["identical"] + later["identical"] == turns  # greedy: every turn as plain decoding gave it
    assert report["all_identical"] is True
    assert_ratios_are_of_the_rates(report)


def test_sessions_each_turn_follows_this_methods_conversation(sessions_report, tiny_target):
    """Turn n's prompt is the system prompt, the user turns and this method's answers before it, then turn n;
    the method's cache for the session holds turn n - 1; no method's first turn finds anything cached (a salt per
    method and session, the warm-up's its own)."""
    for method in sessions_report["methods"]:
        for session in SESSIONS:
            turns = [r for r in rows(sessions_report, method) if r["item"] == session["id"]]
            assert [r["turn"] for r in turns] == list(range(1, len(session["turns"]) + 1))
            history = [ChatMessage("system", session["system"])]
            for row, text in zip(turns, session["turns"]):
                history.append(ChatMessage("user", text))
                assert row["prompt_tokens"] == len(encode_chat(tiny_target.tokenizer, history))
                history.append(ChatMessage("assistant", row["text"]))
            assert turns[0]["cached_tokens"] == 0
            for before, after in zip(turns, turns[1:]):
                assert after["cached_tokens"] >= before["prompt_tokens"]


def test_hybrid_is_compared_with_the_faster_of_its_parts():
    def figures(rate):
        return {"turns_2_plus": {"decode_tokens_per_s": rate}}

    both = {"off": figures(5.0), "suffix": figures(10.0), "draft_model": figures(8.0), "hybrid": figures(9.6)}
    comparison = hybrid_comparison(both, "turns_2_plus")
    assert comparison["best_part"] == "suffix" and comparison["ratio_to_best_part"] == pytest.approx(0.96)
    assert comparison["meets_criterion"] is (0.96 >= HYBRID_CRITERION)
    slower = {**both, "hybrid": figures(9.0)}
    assert hybrid_comparison(slower, "turns_2_plus")["meets_criterion"] is False
    assert hybrid_comparison({k: v for k, v in both.items() if k != "hybrid"}, "turns_2_plus") is None


def test_a_threshold_comparison_pits_hybrid_against_its_parts_at_that_threshold():
    def figures(rate):
        return {"all": {"decode_tokens_per_s": rate}}

    run = {
        "suffix": figures(10.0),
        "draft_model": figures(30.0),
        "draft_model@0.5": figures(12.0),
        "hybrid": figures(20.0),
        "hybrid@0.5": figures(11.0),
    }
    comparison = hybrid_comparison(run, "all", "@0.5")
    assert comparison["best_part"] == "draft_model@0.5" and comparison["ratio_to_best_part"] == pytest.approx(11 / 12)
    assert hybrid_comparison(run, "all")["best_part"] == "draft_model"


def test_methods_that_run_a_draft_model_run_once_per_threshold():
    names = engine_names(("off", "ngram", "draft_model", "hybrid"), (0.0, 0.5, 0.75))
    assert names == {
        "off": ("off", 0.0, False),
        "ngram": ("ngram", 0.0, False),
        "draft_model": ("draft_model", 0.0, False),
        "draft_model@0.5": ("draft_model", 0.5, False),
        "draft_model@0.75": ("draft_model", 0.75, False),
        "hybrid": ("hybrid", 0.0, False),
        "hybrid@0.5": ("hybrid", 0.5, False),
        "hybrid@0.75": ("hybrid", 0.75, False),
    }


def test_overlap_runs_each_draft_model_engine_again_with_pre_drafting():
    names = engine_names(("off", "ngram", "draft_model"), (0.0, 0.5), overlap=True)
    assert names == {
        "off": ("off", 0.0, False),
        "ngram": ("ngram", 0.0, False),
        "draft_model": ("draft_model", 0.0, False),
        "draft_model+overlap": ("draft_model", 0.0, True),
        "draft_model@0.5": ("draft_model", 0.5, False),
        "draft_model@0.5+overlap": ("draft_model", 0.5, True),
    }


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--target-cores", "0"], "give both"),
        (["--target-cores", "0", "--draft-cores", "0,1"], "must not share"),
    ],
)
def test_cores_come_in_pairs_and_apart(files, capsys, flags, words):
    from specdec_tools.cli import main

    out = files / "out.json"
    code = main(
        ["bench", "methods", "--target", "t", "--draft", "d", "--prompts", str(files / "prompts.jsonl")]
        + ["--max-new-tokens", "4", "--json", str(out), *flags]
    )
    err = capsys.readouterr().err
    assert code == 2 and words in err and "--draft-cores" in err and not out.exists()


def test_a_pinned_drafter_makes_every_call_on_its_own_core(tiny_target):
    """Each call of the draft model runs on the pinned thread, whatever thread makes it; what it returns is the
    drafter's own."""
    import os
    import threading

    from specdec_core.config import TokenShaping
    from specdec_core.drafters.base import DraftRequest
    from specdec_core.drafters.draft_model import DraftModelDrafter
    from specdec_core.runner import ModelRunner, RunnerConfig
    from specdec_tools.bench.pinned import PinnedDrafter

    seen = []

    class Spy(DraftModelDrafter):
        def propose(self, requests):
            seen.append((threading.current_thread().name, sorted(os.sched_getaffinity(0))))
            return super().propose(requests)

    core = sorted(os.sched_getaffinity(0))[-1]
    inner = Spy(ModelRunner(tiny_target.model, RunnerConfig(num_slots=1, max_seq_len=64)), 400)
    drafter = PinnedDrafter(inner, [core])
    drafter.start("s", [5, 6, 7])
    request = DraftRequest("s", [5, 6, 7], 3, TokenShaping(), None)
    (proposal,) = drafter.propose([request])
    assert len(proposal.token_ids) == 3 and drafter.name == "draft_model"
    assert seen == [("draft-on-" + str(core), [core])]


@pytest.mark.parametrize("thresholds", [(), (0.5, 0.5), (1.0,), (-0.1,)])
def test_bad_thresholds_are_refused_naming_the_flag(files, thresholds):
    config = MethodsBenchConfig(
        target="unused",
        draft="unused",
        max_new_tokens=4,
        prompts=files / "prompts.jsonl",
        draft_confidence_thresholds=thresholds,
    )
    with pytest.raises(InvalidArgument, match="--draft-confidence-threshold"):
        run_methods_bench(config)


def test_the_table_breaks_down_the_rounds_of_methods_that_mix_proposals(prompts_report):
    table = format_table(prompts_report)
    mixed = 0
    for method, groups in prompts_report["results"].items():
        parts = groups["all"]["rounds_by_method"]
        mixed += len(parts) > 1
        line = next((ln for ln in table.splitlines() if ln.startswith(f"{method} rounds in all: ")), None)
        assert (line is not None) == (len(parts) > 1), method
        if line is not None:
            assert all(f"{name} {p['rounds']} (" in line for name, p in parts.items())
    assert mixed  # the n-gram and suffix drafters propose nothing in some rounds


def test_hybrid_is_reported_when_it_ran(prompts_report):
    hybrid = prompts_report["hybrid"]
    if "hybrid" not in registry.METHODS:
        assert hybrid is None
    else:
        assert hybrid["best_part"] in ("suffix", "draft_model")


def run_cli(tiny_dir, near_draft_dir, files, tmp_path, *flags):
    return main(
        [
            "bench",
            "methods",
            "--target",
            str(tiny_dir / "target"),
            "--draft",
            str(near_draft_dir),
            "--dtype",
            "float32",
            "--max-new-tokens",
            "6",
            "--json",
            str(tmp_path / "out.json"),
            *flags,
        ]
    )


def test_the_command_writes_the_report_and_prints_the_table(tiny_dir, near_draft_dir, files, tmp_path, capsys):
    code = run_cli(
        tiny_dir,
        near_draft_dir,
        files,
        tmp_path,
        "--prompts",
        str(files / "prompts.jsonl"),
        "--methods",
        "suffix,ngram",
        "--num-prompts",
        "1",
    )
    assert code == 0
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["methods"] == [OFF, "suffix", "ngram"] and report["num_prompts"] == 1
    table = capsys.readouterr().out
    assert all(method in table for method in report["methods"])


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--prompts", "PROMPTS", "--methods", "off,suffixx"], "--methods"),
        (["--sessions", "SESSIONS", "--num-prompts", "1"], "--num-prompts"),
        (["--sessions", "SESSIONS", "--num-sessions", "3"], "--num-sessions"),  # the file holds 2
        (["--prompts", "PROMPTS", "--max-seq-len", "20"], "--max-seq-len"),
    ],
)
def test_bad_input_is_an_error_naming_the_flag(flags, named, tiny_dir, near_draft_dir, files, tmp_path, capsys):
    flags = [
        str(files / "prompts.jsonl") if f == "PROMPTS" else str(files / "sessions.jsonl") if f == "SESSIONS" else f
        for f in flags
    ]
    assert run_cli(tiny_dir, near_draft_dir, files, tmp_path, *flags) == 2
    err = capsys.readouterr().err
    assert named in err
    if named == "--methods":
        assert "'suffixx'" in err and "suffix" in err.split("choose from")[1]
    assert not (tmp_path / "out.json").exists()
