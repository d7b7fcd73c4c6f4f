"""Flags the in-process side-by-side benchmarks (`bench methods`, `bench structured`) share: how requests are
sampled and how the models run, named and defaulted alike in both."""

from __future__ import annotations

import argparse
from pathlib import Path

from specdec_tools.loadgen.command import non_negative_float, non_negative_int, positive


def add_run_options(parser: argparse.ArgumentParser, seed_help: str) -> None:
    """--temperature, --seed, --dtype, --device, --draft-quantization, --draft-vocabulary, --num-speculative-tokens,
    --max-seq-len, --json."""
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=non_negative_int, default=0, help=seed_help)
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--draft-quantization", choices=["none", "int8", "int4", "auto"], default="auto",
                        help="int8 weights and activations for the draft (CPU with AVX-512 VNNI or AVX2); int4: "
                             "4-bit weights in groups of 32; auto (default, as the service): int8 on AVX-512 VNNI, "
                             "int4 on AVX2, else none")
    parser.add_argument("--draft-vocabulary", type=non_negative_int, default=0, metavar="N",
                        help="the draft's LM head scores only the first N token ids (a BPE vocabulary's most "
                             "frequent), the special tokens and the ids of each request's context; 0 (default): all")
    parser.add_argument("--num-speculative-tokens", default="auto", help="k, or auto")
    parser.add_argument("--max-seq-len", type=positive(int), default=4096,
                        help="tokens per sequence (prompt and output) each engine holds")
    parser.add_argument("--json", required=True, type=Path, help="where to write the report")
