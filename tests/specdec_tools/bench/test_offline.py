"""`specdec bench offline` end to end on tiny models: the report's contract and its bad-input errors."""

from __future__ import annotations

import json

import pytest

from specdec_core.kernels import library
from specdec_tools.cli import main

KEYS = {
    "target_only_tokens_per_s",
    "speculative_tokens_per_s",
    "speedup",
    "acceptance_rate",
    "mean_tokens_per_round",
    "identical_to_target",
    "prompts",
}


@pytest.fixture()
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "x = 1\ny = 2\nx = 1\n"]))
    return path


def _run(args, capsys):
    code = main(["bench", "offline", *map(str, args)])
    return code, capsys.readouterr()


@pytest.mark.parametrize("drafting", [["--draft", "DRAFT"], ["--ngram"], ["--suffix"]])
def test_report_contract(tiny_dir, prompts, tmp_path, capsys, drafting):
    drafting = [str(tiny_dir / "draft") if a == "DRAFT" else a for a in drafting]
    out = tmp_path / "out.json"
    code, captured = _run(
        [
            "--target",
            tiny_dir / "target",
            *drafting,
            "--prompts",
            prompts,
            "--max-new-tokens",
            12,
            "--temperature",
            0,
            "--dtype",
            "float32",
            "--compare-hf",
            "--json",
            out,
        ],
        capsys,
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert KEYS <= set(report) and "hf_assisted_speedup" in report
    # float32 runs on torch's code paths: said in the report and on the terminal
    assert report["target_kernels"] == "torch fallback (float32: the kernels are bf16)"
    assert report["rows_batch_invariant"] is False
    assert '"target_kernels": "torch fallback (float32: the kernels are bf16)"' in captured.out
    if drafting[0] == "--draft":
        assert report["draft_quantization"] == "auto" and report["draft_quantization_used"] == "none"
    else:
        assert report["draft_kernels"] is None and report["draft_quantization_used"] is None
    assert report["identical_to_target"] is True  # greedy, fp32: speculation changes nothing
    assert report["speedup"] == pytest.approx(report["speculative_tokens_per_s"] / report["target_only_tokens_per_s"])
    assert len(report["prompts"]) == 2
    for entry in report["prompts"]:
        assert entry["target_only_token_ids"] == entry["speculative_token_ids"]
        assert entry["first_divergence"] is None


def test_drafting_flags_are_mutually_exclusive(tiny_dir, prompts, tmp_path, capsys):
    with pytest.raises(SystemExit):
        _run(
            [
                "--target",
                tiny_dir / "target",
                "--ngram",
                "--suffix",
                "--prompts",
                prompts,
                "--max-new-tokens",
                4,
                "--json",
                tmp_path / "out.json",
            ],
            capsys,
        )
    assert "not allowed with" in capsys.readouterr().err


def test_sampling_reports_divergence_position(tiny_dir, prompts, tmp_path, capsys):
    out = tmp_path / "out.json"
    code, _ = _run(
        [
            "--target",
            tiny_dir / "target",
            "--draft",
            tiny_dir / "draft",
            "--prompts",
            prompts,
            "--max-new-tokens",
            12,
            "--temperature",
            1.0,
            "--seed",
            3,
            "--dtype",
            "float32",
            "--num-speculative-tokens",
            3,
            "--json",
            out,
        ],
        capsys,
    )
    assert code == 0
    for entry in json.loads(out.read_text())["prompts"]:
        div = entry["first_divergence"]
        assert div is None or (div["position"] >= 0 and div["margin"] >= 0)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"--max-new-tokens": 0}, "max_new_tokens"),
        ({"--temperature": -1}, "temperature"),
        ({"--target": "no-such-model"}, "no-such-model"),
        ({"--prompts": "missing.jsonl"}, "prompts"),
        ({"--num-speculative-tokens": "many"}, "num_speculative_tokens"),
    ],
)
def test_bad_input_is_a_clear_error_before_any_work(tiny_dir, prompts, tmp_path, capsys, change, field):
    args = {
        "--target": tiny_dir / "target",
        "--draft": tiny_dir / "draft",
        "--prompts": prompts,
        "--max-new-tokens": 8,
        "--temperature": 0,
        "--json": tmp_path / "out.json",
    }
    args.update(change)
    code, captured = _run([x for kv in args.items() for x in kv], capsys)
    assert code == 2
    assert field in captured.err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.skipif(
    library.load_library() is None, reason="CPU kernels need AVX-512 or AVX2 with FMA, and a C compiler"
)
def test_bf16_on_the_kernels_reports_their_path_and_an_exact_greedy_run(tiny_dir, prompts, tmp_path, capsys):
    """By default (--draft-quantization auto) a bf16 draft is int4 where the int8 kernel runs; the target
    computes rows alike whatever the batch, so greedy output is identical by construction."""
    out = tmp_path / "out.json"
    code, _ = _run(
        [
            "--target",
            tiny_dir / "target",
            "--draft",
            tiny_dir / "target",
            "--prompts",
            prompts,
            "--max-new-tokens",
            12,
            "--temperature",
            0,
            "--json",
            out,
        ],
        capsys,
    )
    assert code == 0
    report = json.loads(out.read_text())
    lib = library.load_library()
    isa = "AVX-512" if lib.specdec_has_avx512() else "AVX2"
    assert report["target_kernels"].startswith(f"bf16 {isa}")
    assert report["rows_batch_invariant"] is True and report["identical_to_target"] is True
    chosen = "int4" if lib.specdec_has_int8() else "none"
    assert report["draft_quantization_used"] == chosen
    assert ("+ int8 " in report["draft_kernels"]) is (chosen == "int8")  # an int4 draft's fbgemm rows aside
    assert ("+ int4 " in report["draft_kernels"]) is (chosen == "int4")
