"""The demo pair's forwards on our CPU kernels and on llama.cpp's, side by side on this machine.

A draft step (one token) and the target's forwards of w tokens (a plain step at w = 1, a verify of w - 1 drafts
above it), after `--context` tokens, 2 threads. Ours: `kernel_costs.py` (the int4 draft, the bf16 target, each in a
process of its own). llama.cpp's: its `llama-bench` on GGUF files of the same models, the draft quantized to Q4_0
in every tensor (`llama-quantize --pure`: what `draft.quantization: int4` does, a 4-bit weight and an fp16 scale per
32) and the target in bf16 (as we run it). The two alternate `--rounds` times (this machine's speed drifts from
minute to minute); the report keeps every round and the medians, and the ratio ours / llama.cpp's.

llama-bench's one-token figure is its token generation (`-n`); a forward of w > 1 tokens is its prompt processing
(`-p w`), which computes logits at the last position only, where a verify computes them at all w (w - 1 more
rows of the LM head, the vocabulary's 151,936 x 1536 weights, on our side).

Getting llama.cpp here (PyPI's llama-cpp-python source ships it; no model hub needed):

    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp && cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \\
        && cmake --build build -j2 --target llama-bench llama-quantize
    PYTHONPATH=gguf-py python convert_hf_to_gguf.py ~/.cache/specdec/models/qwen2.5-coder-0.5b-instruct \\
        --outtype bf16 --outfile draft-bf16.gguf        # and the 1.5B target to target-bf16.gguf
    build/bin/llama-quantize --pure draft-bf16.gguf draft-q4_0.gguf Q4_0

    PYTHONPATH=.:proto python benchmarks/kernels/vs_llamacpp.py --llama-bench .../build/bin/llama-bench \\
        --draft-gguf draft-q4_0.gguf --target-gguf target-bf16.gguf --json docs/bench/vs_llamacpp_avx2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def llama_bench(binary: Path, model: Path, widths: Sequence[int], context: int, threads: int) -> dict[str, float]:
    """Milliseconds of a forward of w tokens after `context`, as llama-bench times them (mean of its repetitions)."""
    prompts = [w for w in widths if w > 1]
    command = [
        str(binary),
        "-m",
        str(model),
        "-t",
        str(threads),
        "-d",
        str(context),
        "-fa",
        "1",
        "-r",
        "5",
        "-o",
        "json",
        "-n",
        "32" if 1 in widths else "0",
        "-p",
        ",".join(map(str, prompts)) or "0",
    ]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    ms = {}
    for test in json.loads(done.stdout):
        if test["n_gen"] > 0:
            ms["1"] = test["avg_ns"] / test["n_gen"] / 1e6
        elif test["n_prompt"] > 0:
            ms[str(test["n_prompt"])] = test["avg_ns"] / 1e6
    return ms


def ours(widths: Sequence[int], context: int, threads: int) -> dict[str, dict[str, float]]:
    """`kernel_costs.py`'s medians for the bf16 target at `widths` and the int4 draft at one token."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "costs.json"
        subprocess.run(
            [
                sys.executable,
                str(HERE / "kernel_costs.py"),
                "--only",
                "target-kernels,draft-int4",
                "--target-widths",
                ",".join(map(str, widths)),
                "--draft-widths",
                "1",
                "--context",
                str(context),
                "--threads",
                str(threads),
                "--json",
                str(out),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        runs = json.loads(out.read_text())["runs"]
    return {"target": runs["target, kernels"]["ms"], "draft": runs["draft int4, kernels"]["ms"]}


def median_of(rounds: list[dict[str, Any]], engine: str, model: str) -> dict[str, float]:
    widths = rounds[0][engine][model]
    return {w: round(statistics.median(r[engine][model][w] for r in rounds), 2) for w in widths}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bench", type=Path, required=True)
    parser.add_argument("--draft-gguf", type=Path, required=True)
    parser.add_argument("--target-gguf", type=Path, required=True)
    parser.add_argument("--target-widths", default="1,5,9,17")
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.target_widths.split(",")]
    rounds = []
    for i in range(args.rounds):
        llama = {
            "draft": llama_bench(args.llama_bench, args.draft_gguf, [1], args.context, args.threads),
            "target": llama_bench(args.llama_bench, args.target_gguf, widths, args.context, args.threads),
        }
        rounds.append({"llama.cpp": llama, "specdec": ours(widths, args.context, args.threads)})
        print(f"round {i + 1}: {json.dumps(rounds[-1])}", flush=True)
    report: dict[str, Any] = {
        "context": args.context,
        "threads": args.threads,
        "rounds": rounds,
        "draft_gguf": args.draft_gguf.name,
        "target_gguf": args.target_gguf.name,
    }
    for model in ("draft", "target"):
        mine, theirs = median_of(rounds, "specdec", model), median_of(rounds, "llama.cpp", model)
        report[model] = {
            "specdec_ms": mine,
            "llama_cpp_ms": theirs,
            "ratio": {w: round(mine[w] / theirs[w], 3) for w in mine if w in theirs},
        }
        cells = "  ".join(f"w={w}: {mine[w]} vs {theirs[w]} ms ({r}x)" for w, r in report[model]["ratio"].items())
        print(f"{model:6} specdec vs llama.cpp: {cells}")
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
