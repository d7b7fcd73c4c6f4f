"""`specdec bench structured` on tiny models: constrained speculation gives constrained plain decoding's tokens at
temperature 0, the counts add up (rounds, forced tokens, groups), the ratios are the ratios of the reported rates,
outputs are checked against their schemas, and a bad workload line is an error naming the file and the line before
any model loads. No timing is asserted: only how the figures relate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deployments.openai.tools import ToolPlan
from specdec_core.grammar.state import GrammarState
from specdec_tools.bench.structured_check import SchemaCheck, ToolCallCheck
from specdec_tools.bench.structured_report import (
    ALL,
    CONSTRAINED_PLAIN,
    CONSTRAINED_SPEC,
    MODES,
    SPEEDUP_CRITERION,
    UNCONSTRAINED_SPEC,
)
from specdec_tools.bench.structured_run import StructuredBenchConfig, run_structured_bench
from specdec_tools.bench.structured_timing import DRAFTED_ROUND, FORCED_ROUND, PLAIN_ROUND, grammar_clock
from specdec_tools.bench.structured_workload import SCHEMA, TOOL, encode, read_structured
from specdec_tools.cli import main

# Bounded outputs (enums, booleans, bounded integers and strings): the tiny random model ends them well within
# NEW_TOKENS. The title is where drafts are proposed: the rest is forced, or one choice after a forced run.
TRIAGE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["severity", "fixed", "files", "title"],
    "properties": {
        "severity": {"enum": ["low", "high"]},
        "fixed": {"type": "boolean"},
        "files": {"type": "integer", "minimum": 0, "maximum": 9},
        "title": {"type": "string", "maxLength": 12},
    },
}
SET_LEVEL = {
    "type": "function",
    "function": {
        "name": "set_log_level",
        "description": "Set a logger's level.",
        "strict": True,
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["level"],
            "properties": {"level": {"enum": ["debug", "info"]}},
        },
    },
}
LINES = [
    {"id": "triage", "prompt": "Triage: the login test fails on CI.", "schema": TRIAGE},
    {
        "prompt": "Turn on debug logs.",
        "tools": [SET_LEVEL],
        "tool_choice": {"type": "function", "function": {"name": "set_log_level"}},
    },
    {"id": "triage-2", "system": "You triage bugs.", "prompt": "Crash on start.", "schema": TRIAGE},
]
NEW_TOKENS = 96
SHIPPED = Path(__file__).parents[3] / "benchmarks" / "prompts" / "structured.jsonl"


def write_lines(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    return write_lines(tmp_path_factory.mktemp("structured") / "structured.jsonl", LINES)


def config(tiny_dir, near_draft_dir, prompts, **settings):
    return StructuredBenchConfig(
        target=str(tiny_dir / "target"),
        draft=str(near_draft_dir),
        prompts=prompts,
        dtype="float32",
        max_new_tokens=NEW_TOKENS,
        progress=False,
        **settings,
    )


@pytest.fixture(scope="module")
def report(tiny_dir, near_draft_dir, workload):
    return run_structured_bench(config(tiny_dir, near_draft_dir, workload))


def rows(report, mode):
    return [r for r in report["requests"] if r["mode"] == mode]


def test_constrained_speculation_gives_constrained_plain_decodings_tokens(report):
    assert report["modes"] == list(MODES) and report["method"] == "draft_model"
    assert report["identical"] == {"requests": len(LINES), "identical": len(LINES), "all": True}
    plain = {r["item"]: r["token_ids"] for r in rows(report, CONSTRAINED_PLAIN)}
    assert [r["token_ids"] for r in rows(report, CONSTRAINED_SPEC)] == [
        plain[r["item"]] for r in rows(report, CONSTRAINED_SPEC)
    ]
    assert report["results"][CONSTRAINED_SPEC][ALL]["proposed"] > 0


def test_every_constrained_output_ends_and_is_valid(report):
    for mode in (CONSTRAINED_PLAIN, CONSTRAINED_SPEC):
        f = report["results"][mode][ALL]
        assert f["complete"] == f["valid"] == len(LINES) and f["cut_by_length"] == 0
        assert f["validity_rate"] == 1.0
        assert all(r["valid"] is True and r["problem"] is None for r in rows(report, mode))
    assert report["validity_rate"] == report["results"][CONSTRAINED_SPEC][ALL]["validity_rate"]
    tool_call = next(r for r in rows(report, CONSTRAINED_SPEC) if r["kind"] == "tool")
    assert json.loads(tool_call["text"].split("\n")[1])["name"] == "set_log_level"
    for r in rows(report, UNCONSTRAINED_SPEC):  # checked only where the output ended of itself
        assert (r["valid"] is None) == (r["finish_reason"] == "length")


def test_rounds_and_forced_tokens_add_up(report):
    for mode in MODES:
        f = report["results"][mode][ALL]
        kinds = f["by_round_kind"]
        assert sum(k["rounds"] for k in kinds.values()) == f["rounds"] == sum(r["rounds"] for r in rows(report, mode))
        assert sum(k["tokens"] for k in kinds.values()) == f["output_tokens"] - f["requests"]
        assert f["output_tokens"] == sum(r["output_tokens"] for r in rows(report, mode))
        assert (
            kinds[FORCED_ROUND]["rounds"] == f["forced_rounds"]
            and kinds[FORCED_ROUND]["tokens"] == f["forced_round_tokens"]
        )
        assert f["forced_tokens"] <= f["forced_round_tokens"] <= f["forced_tokens"] + f["forced_rounds"]
        assert 0.0 <= f["forced_share"] <= f["forced_round_share"] <= 1.0
        assert f["forced_share"] == pytest.approx(f["forced_tokens"] / f["output_tokens"])
        assert f["forced_round_share"] == pytest.approx(f["forced_round_tokens"] / f["output_tokens"])
        assert f["accepted"] <= f["proposed"]
    plain = report["results"][CONSTRAINED_PLAIN][ALL]
    assert plain["proposed"] == plain["forced_rounds"] == 0  # k = 0: forced tokens too, one per round
    assert plain["by_round_kind"][PLAIN_ROUND]["rounds"] == plain["rounds"] == plain["output_tokens"] - len(LINES)
    spec, free = report["results"][CONSTRAINED_SPEC][ALL], report["results"][UNCONSTRAINED_SPEC][ALL]
    assert spec["forced_tokens"] > 0 and spec["by_round_kind"][DRAFTED_ROUND]["rounds"] > 0
    assert report["forced_share"] == spec["forced_share"]
    assert free["forced_rounds"] == 0 and free["grammar_seconds"] == 0.0
    assert spec["grammar_seconds"] > 0 and plain["grammar_seconds"] > 0


def test_groups_partition_the_requests(report):
    assert report["groups"] == [ALL, "schema", "tool"] and report["num_by_kind"] == {"schema": 2, "tool": 1}
    for mode in MODES:
        groups = report["results"][mode]
        for field in ("requests", "output_tokens", "rounds", "forced_tokens", "valid"):
            assert groups["schema"][field] + groups["tool"][field] == groups[ALL][field]


def test_ratios_are_of_the_reported_rates(report):
    for group in report["groups"]:
        plain = report["results"][CONSTRAINED_PLAIN][group]
        for mode in MODES:
            f = report["results"][mode][group]
            assert f["speedup"] == pytest.approx(f["tokens_per_s"] / plain["tokens_per_s"])
            assert f["decode_speedup"] == pytest.approx(f["decode_tokens_per_s"] / plain["decode_tokens_per_s"])
            assert f["tokens_per_s"] == pytest.approx(f["output_tokens"] / f["seconds"])
            assert f["seconds_per_round"] == pytest.approx(f["round_seconds"] / f["rounds"])
            assert f["round_grammar_seconds"] <= f["grammar_seconds"] and f["round_seconds"] <= f["decode_seconds"]
    spec, free = report["results"][CONSTRAINED_SPEC][ALL], report["results"][UNCONSTRAINED_SPEC][ALL]
    assert report["speedup"]["tokens_per_s"] == spec["speedup"]
    assert report["speedup"]["meets_criterion"] is (spec["speedup"] >= SPEEDUP_CRITERION)
    per_round = report["grammar_cost"]["seconds_per_round"]
    assert per_round["constrained"] == spec["seconds_per_round"]
    assert per_round["unconstrained"] == free["seconds_per_round"]
    assert per_round["ratio"] == pytest.approx(spec["seconds_per_round"] / free["seconds_per_round"])
    assert report["grammar_cost"]["grammar_seconds_per_round"] == pytest.approx(
        spec["round_grammar_seconds"] / spec["rounds"]
    )


def test_the_order_of_the_modes_rotates(report):
    for i, name in enumerate(["triage", "line-2", "triage-2"]):
        order = [r["mode"] for r in report["requests"] if r["item"] == name]
        assert order == list(MODES[i:] + MODES[:i])


def test_the_grammar_clock_puts_the_methods_back():
    advance = GrammarState.advance
    with pytest.raises(RuntimeError), grammar_clock():
        assert GrammarState.advance is not advance
        raise RuntimeError("a failed run")
    assert GrammarState.advance is advance


def test_outputs_are_checked_against_their_schemas():
    check = SchemaCheck(TRIAGE)
    triage = '{"severity":"low","fixed":true,"files":%s,"title":"CI"%s}'
    assert check.problem(triage % (3, "")) is None
    assert "not JSON" in check.problem('{"severity":"low"')
    assert "files" in check.problem(triage % (12, ""))
    assert "extra" in check.problem(triage % (1, ',"extra":1'))
    tools = ToolCallCheck(ToolPlan(("set_log_level",), False), {"set_log_level": SET_LEVEL["function"]["parameters"]})
    call = '<tool_call>\n{"name": "set_log_level", "arguments": {"level": "%s"}}\n</tool_call>'
    assert tools.problem(call % "debug") is None
    assert "level" in tools.problem(call % "trace")
    assert "not a call" in tools.problem("Sure! " + call % "debug")
    assert tools.problem("no tools today") is not None


def test_the_shipped_workload_reads_and_encodes(tiny_target):
    """Every line compiles (strict schemas, the forced calls' grammars) and renders through the chat template."""
    items = read_structured(SHIPPED)
    assert [i.kind for i in items].count(SCHEMA) >= 3 and [i.kind for i in items].count(TOOL) >= 3
    for item in items:
        request = encode(item, tiny_target.tokenizer)
        assert request.constraint.kind == ("json_schema" if item.kind == SCHEMA else "grammar")
        if item.kind == SCHEMA:
            assert request.constraint.strict and request.constraint.compact


@pytest.mark.parametrize(
    "line, named",
    [
        ("{not json", "not JSON"),
        ({"schema": TRIAGE}, '"prompt"'),
        ({"prompt": "x"}, '"schema" and "tools"'),
        ({"prompt": "x", "schema": TRIAGE, "tools": [SET_LEVEL]}, '"schema" and "tools"'),
        ({"prompt": "x", "schema": TRIAGE, "max_tokens": 3}, "max_tokens"),
        ({"prompt": "x", "schema": {"type": "object", "not": {}}}, 'Unimplemented keys: ["not"]'),  # strict
        ({"prompt": "x", "tools": [SET_LEVEL]}, "must force a call"),
        (
            {"prompt": "x", "tools": [SET_LEVEL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"id": "triage", "prompt": "x", "schema": TRIAGE}, "taken"),
    ],
)
def test_a_bad_line_is_an_error_naming_the_file_and_line(line, named, tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", [LINES[0], line])
    with pytest.raises(Exception) as caught:
        read_structured(path)
    assert caught.value.field == "--prompts"
    assert f"{path}:2:" in caught.value.message and named in caught.value.message


def run_cli(tiny_dir, near_draft_dir, prompts, tmp_path, *flags):
    return main(
        [
            "bench",
            "structured",
            "--target",
            str(tiny_dir / "target"),
            "--prompts",
            str(prompts),
            "--dtype",
            "float32",
            "--max-new-tokens",
            "64",
            "--json",
            str(tmp_path / "out.json"),
            *flags,
        ]
    )


def test_the_command_writes_the_report_and_prints_the_table(tiny_dir, near_draft_dir, workload, tmp_path, capsys):
    code = run_cli(tiny_dir, near_draft_dir, workload, tmp_path, "--method", "suffix", "--num-prompts", "2")
    assert code == 0
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["method"] == "suffix" and report["num_prompts"] == 2 and report["identical"]["all"] is True
    table = capsys.readouterr().out
    assert all(mode in table for mode in MODES) and "criterion" in table


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--method", "draft_modle"], "--method"),
        (["--method", "draft_model"], "--draft"),  # it runs a draft model: --draft is needed
        (["--method", "ngram", "--num-prompts", "4"], "--num-prompts"),  # the file holds 3
        (["--method", "ngram", "--max-seq-len", "20"], "--max-seq-len"),
    ],
)
def test_bad_flags_are_an_error_naming_the_flag(flags, named, tiny_dir, near_draft_dir, workload, tmp_path, capsys):
    assert run_cli(tiny_dir, near_draft_dir, workload, tmp_path, *flags) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
