"""The CPU kernels of this checkout against those of a git revision, side by side in one model.

Builds the kernels' sources as they were at `--base` beside the working tree's, loads the model once and times its
forward of w tokens after `--context` tokens of context with one build's kernels and then the other's, swapped in
every repeat (one process, one KV cache): the machine's drift (15-25% within minutes on a shared 2-core machine)
moves both alike, and the figure to read is the median of the paired ratios. Also says, per width, whether the
two builds give bit-identical logits, and times the kernel calls of each kind (matrix multiplies by shape,
attention) inside the forward.

    PYTHONPATH=.:proto python benchmarks/kernels/kernel_ab.py --base HEAD --json out/kernel_ab.json
    PYTHONPATH=.:proto python benchmarks/kernels/kernel_ab.py --model qwen2.5-coder-0.5b-instruct --quantization int4 \
        --widths 1,2,3 --json out/kernel_ab_draft.json
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

TARGET = "qwen2.5-coder-1.5b-instruct"
ROOT = Path(__file__).resolve().parents[2]


def base_library(rev: str, directory: Path) -> ctypes.CDLL:
    """The kernels built from their sources at git revision `rev` (same compiler, flags and CPU as this build)."""
    from specdec_core import environment
    from specdec_core.kernels import library

    src = directory / "src"
    src.mkdir()
    for path in (*library.SOURCES, *library.HEADERS):
        relative = path.relative_to(ROOT).as_posix()
        text = subprocess.run(["git", "show", f"{rev}:{relative}"], cwd=ROOT, capture_output=True, check=True).stdout
        (src / path.name).write_bytes(text)
    spec = library.library_spec()
    spec = library.LibrarySpec(
        name=f"{spec.name}_base",
        sources=tuple(src / p.name for p in library.SOURCES),
        headers=tuple(src / p.name for p in library.HEADERS),
        flags=spec.flags,
        libraries=spec.libraries,
        context=spec.context,
    )
    compiler = shutil.which(environment.c_compiler()) or shutil.which("gcc")
    lib = library.load(spec, compiler, directory / "kernels")
    library._declare(lib)
    return lib


def _holders(model: Any) -> Iterator[Any]:
    """Every object of the model that holds the kernel library or a bound kernel call."""
    yield from model.modules()
    yield model.attention
    yield model.run_layers


def use_library(model: Any, lib: ctypes.CDLL) -> None:
    """Point every kernel call of `model` at `lib`'s function of the same name."""
    for holder in _holders(model):
        if hasattr(holder, "_lib"):
            holder._lib = lib
        call = getattr(holder, "_call", None)
        if call is not None and hasattr(call, "_kernel"):
            call._kernel = getattr(lib, call._kernel.__name__)


class KernelTimer:
    """Seconds spent in each kernel call of one library, by function and (for matrix multiplies) shape."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self._lib = lib

    def wrap(self) -> None:
        for name in (
            "specdec_gemm_bf16",
            "specdec_gemm_w4a8",
            "specdec_gemm_w8a8",
            "specdec_attention_bf16",
            "specdec_layers_quant",
        ):
            function = getattr(self._lib, name, None)
            if function is not None:
                setattr(self._lib, name, self._timed(name, function))

    def _timed(self, name: str, function: Any) -> Any:
        def call(*args: Any) -> Any:
            start = time.perf_counter()
            result = function(*args)
            key = f"{name} {args[-2]}x{args[-3]}" if name.startswith("specdec_gemm") else name  # N x K
            self.seconds[key] += time.perf_counter() - start
            return result

        call.__name__ = name
        return call


def run(
    model_source: str, quantization: str, base: str, widths: Sequence[int], context: int, repeats: int, threads: int
) -> dict[str, Any]:
    import torch

    from specdec_core.build import prepare_model
    from specdec_core.kernels import library
    from specdec_core.runner import ModelRunner, RunnerConfig

    torch.set_num_threads(threads)
    model = prepare_model(model_source, quantization=quantization).model.eval()
    libs = {"head": library.load_library()}
    if libs["head"] is None:
        raise SystemExit("no CPU kernels on this machine")
    with tempfile.TemporaryDirectory() as tmp:
        libs["base"] = base_library(base, Path(tmp))
        timers = {name: KernelTimer(lib) for name, lib in libs.items()}
        for timer in timers.values():
            timer.wrap()
        runner = ModelRunner(model, RunnerConfig(num_slots=1, max_seq_len=context + max(widths) + 8))
        slot = runner.allocate()
        ids = torch.randint(
            10, min(30000, model.vocab_size), (context + max(widths),), generator=torch.Generator().manual_seed(0)
        ).tolist()
        runner.extend([slot], [ids[:context]])

        def forward(name: str, width: int) -> tuple[float, torch.Tensor]:
            use_library(model, libs[name])
            start = time.perf_counter()
            logits = runner.extend([slot], [ids[context : context + width]], all_logits=True)  # [1, w, V]
            seconds = time.perf_counter() - start
            runner.truncate(slot, context)
            return seconds, logits

        rows = []
        for width in widths:
            identical = torch.equal(forward("base", width)[1], forward("head", width)[1])
            for timer in timers.values():
                timer.seconds.clear()
            times: dict[str, list[float]] = {"base": [], "head": []}
            for _ in range(repeats):
                for name in times:
                    times[name].append(forward(name, width)[0])
            ratios = [h / b for h, b in zip(times["head"], times["base"])]
            # ms to the tenth of a microsecond: a small model's calls take microseconds, and must not round to 0.
            kernels = {
                key: {name: round(timers[name].seconds[key] / repeats * 1e3, 4) for name in timers}
                for key in sorted(timers["base"].seconds)
            }
            rows.append(
                {
                    "width": width,
                    "identical_logits": identical,
                    "ms": {name: round(statistics.median(t) * 1e3, 2) for name, t in times.items()},
                    "ratio_median": round(statistics.median(ratios), 3),
                    "kernel_ms": kernels,
                }
            )
            print(
                f"w={width}: base {rows[-1]['ms']['base']} ms, this checkout {rows[-1]['ms']['head']} ms, "
                f"ratio {rows[-1]['ratio_median']}, logits identical: {identical}",
                flush=True,
            )
            for key, ms in kernels.items():
                print(f"    {key}: {ms['base']} -> {ms['head']} ms", flush=True)
    return {
        "model": model_source,
        "quantization": quantization,
        "base": base,
        "context": context,
        "repeats": repeats,
        "threads": threads,
        "widths": rows,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TARGET)
    parser.add_argument("--quantization", default="none", help="none (the target), int8 or int4 (a draft)")
    parser.add_argument("--base", default="HEAD", help="git revision whose kernel sources are the baseline")
    parser.add_argument("--widths", default="1,2,3,5,9,17")
    parser.add_argument("--context", type=int, default=900)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    report = run(args.model, args.quantization, args.base, widths, args.context, args.repeats, args.threads)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
