"""`specdec bench gpu`'s run: the parts in order, each printed as it ends, one JSON report, and the exit status."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec_tools.bench.gpu.costs_part import Measured, costs_part
from specdec_tools.bench.gpu.device import environment
from specdec_tools.bench.gpu.engines import build_tiny_models
from specdec_tools.bench.gpu.exactness import engine_checks
from specdec_tools.bench.gpu.projection_part import projection_part
from specdec_tools.bench.gpu.report import Report
from specdec_tools.bench.gpu.sampler_law import rejection_checks

PARTS = ("environment", "exactness", "sampler_law", "costs", "projection")


@dataclass(frozen=True)
class Options:
    """The command's flags."""

    device: torch.device
    quick: bool  # small sizes everywhere: to develop on a CPU
    json: Path
    parts: tuple[str, ...]  # of PARTS; the environment is always reported
    recorded: tuple[Path, ...]  # the reports the projection prices


def exactness(report: Report, options: Options) -> None:
    """Part 2 in float32, and on CUDA in bfloat16 too, over tiny models written to a temporary directory."""
    dtypes = [torch.float32, torch.bfloat16] if options.device.type == "cuda" else [torch.float32]
    max_tokens, prompts_used = (24, 3) if options.quick else (48, 4)
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
        models = build_tiny_models(Path(tmp))
        for dtype in dtypes:
            report.part(
                f"exactness_{str(dtype).removeprefix('torch.')}",
                lambda dtype=dtype: engine_checks(report, options.device, dtype, models, max_tokens, prompts_used),
            )


def run(options: Options) -> int:
    """Every part of `options.parts`, in order; 0 only if every check passed. Writes `options.json`."""
    torch.set_float32_matmul_precision("highest")  # float32 exactness runs must not use TF32
    report = Report()
    started = time.perf_counter()
    dtypes = [torch.float32, torch.bfloat16] if options.device.type == "cuda" else [torch.float32]
    report.data["environment"] = environment(options.device, dtypes)
    report.data["parts"] = list(options.parts)
    if "exactness" in options.parts:
        exactness(report, options)
    if "sampler_law" in options.parts:
        rows = 100_000 if options.quick else 200_000
        report.part("sampler_law", lambda: rejection_checks(report, options.device, rows))
    measured: Measured | None = None
    if "costs" in options.parts:
        measured = report.part("costs", lambda: costs_part(report, options.device, options.quick), Measured.json)
    if "projection" in options.parts:
        report.part("projection", lambda: projection_part(measured, options.recorded))
    return finish(report, options, started)


def finish(report: Report, options: Options, started: float) -> int:
    """Write the report, print the line that sums it up, and return the exit status."""
    failed = report.failed
    report.data |= {"ok": not failed, "failed": failed, "seconds": round(time.perf_counter() - started, 1)}
    options.json.parent.mkdir(parents=True, exist_ok=True)
    options.json.write_text(json.dumps(report.data, indent=1, default=str) + "\n")
    total = len(report.data["checks"])
    print(
        f"bench gpu on {report.data['environment']['device_name']}: {'PASS' if not failed else 'FAIL'}, "
        f"{total - len(failed)}/{total} checks passed in {report.data['seconds']} s, report {options.json}"
        + (f"; failed: {', '.join(failed)}" if failed else ""),
        flush=True,
    )
    return 0 if not failed else 1
