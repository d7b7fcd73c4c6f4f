"""What a forward of w tokens costs on this CPU, on the CPU kernels and on torch's code path, side by side.

Speculation pays where verifying k + 1 tokens costs little more than decoding one; this measures exactly that for
the target (w = 1, 2, 3, 5, 9, 17 by default) and a draft step for the draft (bf16 and int8), after a context of
`--context` tokens, each configuration in a process of its own (the kernels are chosen when a process first loads
them), medians of `--repeats` rounds over the widths interleaved. Prints the table and writes the JSON.

`--baseline-cflags` adds, after each kernels run, the same run on kernels built with those extra compiler flags
(`SPECDEC_KERNEL_CFLAGS`): a change to a kernel's tuning measured against the old setting in the same script run.

    PYTHONPATH=.:proto python benchmarks/kernels/kernel_costs.py --json out/kernel_costs.json
    PYTHONPATH=.:proto python benchmarks/kernels/kernel_costs.py --only target-kernels,draft-int8 \
        --baseline-cflags "-DPREFETCH_BYTES=512 -DPREFETCH=512" --json out/prefetch.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"

# --only key -> (report name, model, draft quantization, kernels on)
RUNS = {
    "target-kernels": ("target, kernels", "target", "none", True),
    "target-torch": ("target, torch", "target", "none", False),
    "draft-bf16": ("draft bf16, kernels", "draft", "none", True),
    "draft-int8": ("draft int8, kernels", "draft", "int8", True),
    "draft-int4": ("draft int4, kernels", "draft", "int4", True),
    "draft-torch": ("draft bf16, torch", "draft", "none", False),
}


def measure(
    model_source: str, quantization: str, widths: Sequence[int], context: int, repeats: int, threads: int
) -> dict[str, Any]:
    """Median milliseconds of a forward of w new tokens after `context` cached ones, on the path this process runs."""
    import torch

    from specdec_core.build import prepare_model
    from specdec_core.environment import kernel_cflags
    from specdec_core.kernels.report import kernel_path
    from specdec_core.kv_cache import KVCache

    torch.set_num_threads(threads)
    model = prepare_model(model_source, quantization=quantization).model.eval()
    layer = model.layers[0].self_attn
    cache = KVCache(
        model.args.num_layers, 1, layer.num_kv_heads, context + max(widths) + 8, model.args.head_dim, torch.bfloat16
    )
    ids = torch.randint(
        10, min(30000, model.vocab_size), (1, context + max(widths)), generator=torch.Generator().manual_seed(0)
    )

    def forward(w: int) -> None:
        positions = (context + torch.arange(w)).view(1, w)
        model(ids[:, context : context + w], positions, cache, torch.tensor([0]), context + w, (0, context))

    times: dict[int, list[float]] = {w: [] for w in widths}
    with torch.inference_mode():
        model(
            ids[:, :context],
            torch.arange(context).view(1, -1),
            cache,
            torch.tensor([0]),
            context,
            (0, 0),
            torch.tensor([[context - 1]]),
        )
        for w in widths:
            forward(w)  # warm
        for _ in range(repeats):
            for w in widths:
                t0 = time.perf_counter()
                forward(w)
                times[w].append(time.perf_counter() - t0)
    ms = {str(w): round(1000 * statistics.median(v), 2) for w, v in times.items()}
    one = ms[str(min(widths))]
    return {
        "path": kernel_path(model),
        "kernel_cflags": " ".join(kernel_cflags()),
        "ms": ms,
        "relative_to_first": {w: round(m / one, 3) for w, m in ms.items()},
    }


def run_child(
    args: argparse.Namespace, model: str, quantization: str, widths: Sequence[int], kernels: bool, cflags: str = ""
) -> dict[str, Any]:
    """`measure` in a fresh process, with the kernels on or switched off (`SPECDEC_DISABLE_CPU_KERNELS`), and
    `cflags` added to the kernels' compiler flags."""
    env = dict(os.environ)
    env.pop("SPECDEC_DISABLE_CPU_KERNELS", None)
    if not kernels:
        env["SPECDEC_DISABLE_CPU_KERNELS"] = "1"
    if cflags:
        env["SPECDEC_KERNEL_CFLAGS"] = f"{env.get('SPECDEC_KERNEL_CFLAGS', '')} {cflags}".strip()
    command = [
        sys.executable,
        __file__,
        "--child",
        model,
        quantization,
        ",".join(map(str, widths)),
        str(args.context),
        str(args.repeats),
        str(args.threads),
    ]
    done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--child":
        model, quantization, widths, context, repeats, threads = argv[1:]
        print(
            json.dumps(
                measure(
                    model, quantization, [int(w) for w in widths.split(",")], int(context), int(repeats), int(threads)
                )
            )
        )
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=TARGET)
    parser.add_argument("--draft", default=DRAFT)
    parser.add_argument("--target-widths", default="1,2,3,5,9,17")
    parser.add_argument("--draft-widths", default="1,2,5,9")
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--only", default=",".join(RUNS), help=f"comma-separated runs, of: {', '.join(RUNS)} (default: all)"
    )
    parser.add_argument(
        "--baseline-cflags",
        default="",
        help="also run each kernels run on kernels built with these extra compiler flags",
    )
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    if unknown := sorted(set(only) - set(RUNS)):
        parser.error(f"--only: unknown runs {unknown}; choose from {', '.join(RUNS)}")
    target_widths = [int(w) for w in args.target_widths.split(",")]
    draft_widths = [int(w) for w in args.draft_widths.split(",")]
    from specdec_core.hardware import cpu_flags

    report: dict[str, Any] = {
        "context": args.context,
        "repeats": args.repeats,
        "threads": args.threads,
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "amx"))),
        "target": args.target,
        "draft": args.draft,
        "runs": {},
    }
    if args.baseline_cflags:
        report["baseline_cflags"] = args.baseline_cflags
    models = {"target": args.target, "draft": args.draft}
    for key in only:
        name, role, quantization, kernels = RUNS[key]
        widths = target_widths if role == "target" else draft_widths
        variants = [(name, "")]
        if kernels and args.baseline_cflags:
            variants.append((f"{name} (baseline)", args.baseline_cflags))
        for label, cflags in variants:
            report["runs"][label] = result = run_child(args, models[role], quantization, widths, kernels, cflags)
            cells = " ".join(f"w={w}: {m} ms ({result['relative_to_first'][w]}x)" for w, m in result["ms"].items())
            print(f"{label:33} [{result['path']}] {cells}", flush=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
