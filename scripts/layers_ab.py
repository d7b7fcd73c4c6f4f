"""A model's forward of w tokens with its layers in one C call against the layer-by-layer loop, side by side.

A quantized draft (`--quantization int4` or `int8`) or a bf16 model (`none`: the target, `--draft` naming it).

The two run in one process over one model and one KV cache, swapped every repeat (`Transformer.run_layers`), so
the machine's drift (15-25% within minutes on a shared 2-core machine) moves both alike; the figure to read is the
median of the paired ratios. First checks that both give bit-identical logits at every width.

    PYTHONPATH=.:proto python scripts/layers_ab.py --quantization int4 --json out/layers_int4_ab.json
    PYTHONPATH=.:proto python scripts/layers_ab.py --draft qwen2.5-coder-1.5b-instruct --quantization none \
        --widths 1,2,5,9,17 --repeats 10 --json out/layers_bf16_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

DRAFT = "qwen2.5-coder-0.5b-instruct"


def run(model_source: str, quantization: str, widths: Sequence[int], context: int, repeats: int,
        threads: int) -> dict[str, Any]:
    import torch

    from specdec_core.build import prepare_model
    from specdec_core.kernels.layers_quant import QuantLayers
    from specdec_core.models.transformer import run_in_turn
    from specdec_core.runner import ModelRunner, RunnerConfig

    torch.set_num_threads(threads)
    model = prepare_model(model_source, quantization=quantization).model.eval()
    fused = model.run_layers
    if not isinstance(fused, QuantLayers):
        raise SystemExit(f"{model_source} ({quantization}): its layers do not run in one call here (no kernels, or "
                         "not every linear quantized)")
    runner = ModelRunner(model, RunnerConfig(num_slots=1, max_seq_len=context + max(widths) + 8))
    slot = runner.allocate()
    ids = torch.randint(10, min(30000, model.vocab_size), (context + max(widths),),
                        generator=torch.Generator().manual_seed(0)).tolist()
    runner.extend([slot], [ids[:context]])
    paths = {"loop": run_in_turn, "one call": fused}

    def forward(path: str, w: int, all_logits: bool = False) -> tuple[float, torch.Tensor]:
        """As a draft step runs: logits of the last token only (all of them for the comparison)."""
        model.run_layers = paths[path]
        start = time.perf_counter()
        logits = runner.extend([slot], [ids[context : context + w]], all_logits=all_logits)  # [1, w or 1, V]
        seconds = time.perf_counter() - start
        runner.truncate(slot, context)
        return seconds, logits

    identical = {w: torch.equal(forward("loop", w, True)[1], forward("one call", w, True)[1]) for w in widths}
    times: dict[tuple[str, int], list[float]] = {(p, w): [] for p in paths for w in widths}
    for rep in range(repeats):
        for path in (paths if rep % 2 else reversed(list(paths))):
            for w in widths:
                times[(path, w)].append(forward(path, w)[0])
    model.run_layers = fused
    return {
        "model": str(model_source), "quantization": quantization, "context": context, "repeats": repeats, "threads": threads,
        "widths": {str(w): {
            "identical": identical[w],
            "loop_ms": round(1000 * statistics.median(times[("loop", w)]), 2),
            "one_call_ms": round(1000 * statistics.median(times[("one call", w)]), 2),
            "paired_ratio": round(statistics.median(b / a for a, b in zip(times[("loop", w)],
                                                                         times[("one call", w)])), 3),
        } for w in widths},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default=DRAFT, help="model name or directory")
    parser.add_argument("--quantization", default="int4", choices=("int4", "int8", "none"))
    parser.add_argument("--widths", default="1,2,3", help="tokens a forward, comma-separated")
    parser.add_argument("--context", type=int, default=700)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    report = run(args.draft, args.quantization, widths, args.context, args.repeats, args.threads)
    for w, row in report["widths"].items():
        print(f"w={w}: loop {row['loop_ms']} ms, one call {row['one_call_ms']} ms, paired ratio "
              f"{row['paired_ratio']}, logits {'identical' if row['identical'] else 'DIFFER'}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(row["identical"] for row in report["widths"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
