"""`specdec bench gpu`: the engine on a CUDA device, in one command of a few minutes that writes one JSON report, for
a GPU machine lent for minutes. Five parts, each printed as it ends:

1. environment: torch, the device, the dtypes checked (`device.py`);
2. exactness: every drafting method on the device with tiny models, greedy rows equal to plain decoding's, alone
   and beside sampled rows, in float32 and (CUDA) bfloat16; then again with the engine's CUDA graphs on, equal to
   graphs off and to plain decoding, with the runners' graph counters (`exactness.py`);
3. sampler_law: the rejection sampler's output law by chi-square, and two wrong samplers that must fail it
   (`sampler_law.py`);
4. costs: through the engine's runner, graphs captured, random weights of Qwen2.5-1.5B / 0.5B and Llama-3.1-8B /
   3.2-1B shapes in bf16: the plain step, verifies at each captured width and batch bucket, the draft step, a
   speculative round and a plain step through the engine split into forwards and host overhead, capture time and
   memory; each forward against the device's read limit, and the GPU engine's goals beside them (`costs_part.py`);
5. projection: the recorded acceptance of the CPU benchmarks (`specdec bench methods` reports) priced at those
   costs: tokens/s plain and speculative per method (`projection.py`).

The exit status is 0 only if every check passes (the wrong samplers failing as they must); the last line sums up.
Goals are reported, not checked. `--device cpu --quick` runs it all on a CPU in seconds (tiny shapes; captures
become the same static-shape forwards run eagerly), to develop it without a GPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from specdec_core.errors import InvalidArgument
from specdec_tools.bench.gpu.projection import default_recorded
from specdec_tools.bench.gpu.run import PARTS, Options, run


def _parts(text: str) -> tuple[str, ...]:
    parts = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [p for p in parts if p not in PARTS]
    if not parts or unknown:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(PARTS)}, got {text!r}")
    return parts


def _paths(text: str) -> tuple[Path, ...]:
    return tuple(Path(p.strip()) for p in text.split(",") if p.strip())


def register(modes: Any) -> None:
    parser = modes.add_parser(
        "gpu",
        help="the engine on a CUDA device: exactness (graphs off and on), the sampler's law, costs against the read "
        "limit, and the CPU benchmarks' acceptance priced at them; one JSON report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes everywhere (to develop on a CPU)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", type=Path, required=True, help="where the JSON report goes")
    parser.add_argument(
        "--parts",
        type=_parts,
        default=PARTS,
        help=f"comma-separated parts to run (default all: {','.join(PARTS)}); the environment is always reported; "
        "projection prices at this run's costs, so it needs costs",
    )
    parser.add_argument(
        "--recorded",
        type=_paths,
        default=None,
        metavar="PATH[,PATH]",
        help="`specdec bench methods` reports whose acceptance the projection prices (default: docs/bench/"
        "methods_*.json)",
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument("--device", f"{args.device}: CUDA is not available here")
    if "projection" in args.parts and "costs" not in args.parts:
        raise InvalidArgument("--parts", "projection prices at this run's costs: list costs too")
    if args.threads:
        torch.set_num_threads(args.threads)
    recorded = default_recorded() if args.recorded is None else args.recorded
    return run(Options(device, args.quick, args.json, args.parts, recorded))
