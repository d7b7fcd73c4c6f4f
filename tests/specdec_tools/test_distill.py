"""`specdec distill` end to end on tiny models: acceptance on held-out prompts, measured by `bench offline`'s code,
rises; the draft directory loads as any other; a rerun resumes; a changed run is refused."""

from __future__ import annotations

import json
import random

import pytest

from specdec_core.build import prepare_draft
from specdec_core.models.loader import load_model
from specdec_core.models.tiny import _CORPUS
from specdec_tools.cli import main
from tests.helpers import build_taught_target, corpus_prompt, one_torch_thread


@pytest.fixture(scope="module")
def taught_target(tiny_dir, tmp_path_factory):
    with one_torch_thread():
        return build_taught_target(tiny_dir, tmp_path_factory.mktemp("taught") / "target")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    words, rng = _CORPUS.split(" "), random.Random(5)
    lines = [
        json.dumps({"prompt": corpus_prompt(words, rng.randrange(len(words) - 30), rng.randint(2, 6))})
        for _ in range(200)
    ]
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def proposal_log(tmp_path_factory):
    """Three rounds as a served log with context writes them: two rejected (taught), one all accepted (not)."""
    path = tmp_path_factory.mktemp("log") / "proposals.jsonl"
    records = [
        {"proposed": [40, 41, 42], "accepted": 1, "context": [1, 30, 31, 32]},
        {"proposed": [50, 51], "accepted": 0, "context": [33, 34]},
        {"proposed": [60, 61], "accepted": 2, "context": [35, 36]},
    ]
    path.write_text("".join(json.dumps({"ts": 0, "request_id": "r", "round": 0, "k": 3, **r}) + "\n" for r in records))
    return path


def _distill(taught_target, tiny_dir, prompts, out, *extra):
    args = [
        "distill",
        "--target",
        taught_target,
        "--draft",
        tiny_dir / "draft",
        "--prompts",
        prompts,
        "--out",
        out,
        "--steps",
        400,
        "--max-new-tokens",
        32,
        "--lora-rank",
        0,
        "--learning-rate",
        1e-2,
        "--dtype",
        "float32",
        *extra,
    ]
    with one_torch_thread():
        return main([str(a) for a in args])


@pytest.fixture(scope="module")
def distilled(taught_target, tiny_dir, prompts, proposal_log, tmp_path_factory):
    out = tmp_path_factory.mktemp("distilled") / "draft"
    assert _distill(taught_target, tiny_dir, prompts, out, "--proposal-log", proposal_log) == 0
    return out


def test_acceptance_on_held_out_prompts_rises_by_a_large_factor(distilled):
    report = json.loads((distilled / "report.json").read_text())
    before, after = report["before"]["acceptance_rate"], report["after"]["acceptance_rate"]
    assert report["held_out_prompts"] >= 30 and report["train_prompts"] >= 120
    assert after > 0.3 and after > 10 * before, (before, after)
    assert report["after"]["identical_to_target"] is True  # greedy, float32: the draft changes speed only


def test_held_out_prompts_are_not_trained_on(distilled, prompts):
    held = {json.loads(line)["prompt"] for line in (distilled / "work" / "heldout.jsonl").read_text().splitlines()}
    trained = {json.loads(line)["prompt"] for line in (distilled / "work" / "train.jsonl").read_text().splitlines()}
    assert held and trained and not held & trained
    given = {json.loads(line)["prompt"] for line in prompts.read_text().splitlines()}
    assert held | trained == given  # every distinct prompt once, on one side


def test_the_rejections_of_the_proposal_log_are_trained_on(distilled):
    report = json.loads((distilled / "report.json").read_text())
    assert report["training_sequences"] == report["train_prompts"] + 2  # the all-accepted round teaches nothing


def test_the_draft_directory_loads_as_any_draft(distilled, taught_target):
    target = load_model(taught_target, dtype="float32")
    draft = prepare_draft(distilled, target.tokenizer, dtype="float32")
    assert draft.model.vocab_size == 384


def test_a_rerun_resumes_and_regenerates_nothing(distilled, taught_target, tiny_dir, prompts, proposal_log, capsys):
    completions = (distilled / "work" / "completions.jsonl").read_text()
    assert _distill(taught_target, tiny_dir, prompts, distilled, "--proposal-log", proposal_log) == 0
    report = json.loads((distilled / "report.json").read_text())
    assert report["resumed_from_step"] == 400 and report["loss_first"] is None
    assert (distilled / "work" / "completions.jsonl").read_text() == completions
    assert "target completions" not in capsys.readouterr().err  # no progress bar: nothing generated


def test_a_run_with_other_settings_is_refused(distilled, taught_target, tiny_dir, prompts, capsys):
    assert _distill(taught_target, tiny_dir, prompts, distilled, "--max-new-tokens", 16) == 2
    assert "other settings" in capsys.readouterr().err


def test_the_split_is_seeded_and_a_repeated_prompt_stays_on_one_side():
    from specdec_tools.distill_stages import split_prompts

    texts = [f"p{i}" for i in range(10)] + ["p3", "p3"]
    train, held = split_prompts(texts, 0.2, seed=0)
    assert len(held) == 2 and len(train) == 8 and not set(train) & set(held)
    assert split_prompts(texts, 0.2, seed=0) == (train, held)
    assert split_prompts(texts, 0.2, seed=1) != (train, held)
