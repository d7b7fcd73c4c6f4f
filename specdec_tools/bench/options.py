"""Flags the in-process side-by-side benchmarks (`bench methods`, `bench structured`) share: how requests are
sampled and how the models run, named and defaulted alike in both, and `RunOptions`, the part of their configs
those flags fill. The draft's flags (--draft-quantization, --draft-vocabulary) are declared here once for every
command that loads a draft in process (`bench offline`, `distill` too)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from specdec_core.build import load_pair
from specdec_core.hardware import DRAFT_QUANTIZATIONS
from specdec_core.models.loader import LoadedModel
from specdec_tools.loadgen.command import non_negative_float, non_negative_int, positive

QUANTIZATION_HELP = (
    "int8 weights and activations for the draft (CPU with AVX-512 VNNI or AVX2); int4: 4-bit weights "
    "in groups of 32; auto (default, as the service): int4 on AVX2 or AVX-512 VNNI, else none"
)


def comma_ints(minimum: int, what: str) -> Any:
    """An argparse type: `1,4` -> (1, 4), comma-separated integers of at least `minimum`, in order, each once;
    `what` names them in the error."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
        return tuple(dict.fromkeys(values))

    return parse


def add_draft_quantization(
    parser: argparse.ArgumentParser, help: str = QUANTIZATION_HELP, default: str = "auto"
) -> None:
    """--draft-quantization: none, int8, int4 or auto."""
    parser.add_argument("--draft-quantization", choices=DRAFT_QUANTIZATIONS, default=default, help=help)


def add_draft_vocabulary(parser: argparse.ArgumentParser) -> None:
    """--draft-vocabulary N: the draft's LM head cut to N ids (0: all)."""
    parser.add_argument(
        "--draft-vocabulary",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="the draft's LM head scores only the first N token ids (a BPE vocabulary's most "
        "frequent), the special tokens and the ids of each request's context; 0 (default): all",
    )


def add_run_options(parser: argparse.ArgumentParser, seed_help: str) -> None:
    """--temperature, --seed, --dtype, --device, --draft-quantization, --draft-vocabulary, --num-speculative-tokens,
    --max-seq-len (`RunOptions`), --json."""
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=non_negative_int, default=0, help=seed_help)
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    add_draft_quantization(parser)
    add_draft_vocabulary(parser)
    parser.add_argument("--num-speculative-tokens", default="auto", help="k, or auto")
    parser.add_argument(
        "--max-seq-len",
        type=positive(int),
        default=4096,
        help="tokens per sequence (prompt and output) each engine holds",
    )
    parser.add_argument("--json", required=True, type=Path, help="where to write the report")


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """The settings `add_run_options` declares, as the benchmarks' configs hold them (their base class)."""

    temperature: float = 0.0
    seed: int = 0
    dtype: str = "bfloat16"
    device: str = "cpu"
    draft_quantization: str = "auto"  # none, int8, int4, or auto: what this CPU runs best (`specdec_core.hardware`)
    draft_vocabulary: int = 0  # the draft head's first N ids plus the contexts' (`models.vocab_head`); 0: all
    num_speculative_tokens: int | str = "auto"
    max_seq_len: int = 4096
    progress: bool = True  # a progress bar on stderr; no flag: tests turn it off

    def load_models(self, target: str, draft: str | None) -> tuple[LoadedModel, LoadedModel | None]:
        """The target and the draft (None: none) as these options have them run."""
        return load_pair(
            target,
            draft,
            dtype=self.dtype,
            device=self.device,
            draft_quantization=self.draft_quantization,
            draft_vocabulary=self.draft_vocabulary,
        )


def run_options(args: argparse.Namespace) -> dict[str, Any]:
    """`RunOptions`'s fields as parsed by `add_run_options`, to pass to a config: `Config(..., **run_options(args))`."""
    return {f.name: getattr(args, f.name) for f in fields(RunOptions) if f.name != "progress"}
