"""`specdec bench structured --target T --draft D --prompts FILE.jsonl --json OUT`: structured output (JSON
extraction and forced tool calls) decoded plainly and speculatively under its constraint, and speculatively
without it, in one process and one run (`structured_run.py`): the speedup speculation brings to constrained
decoding, whether it keeps plain decoding's tokens, the share of tokens the grammar forces, the validity of the
outputs, and what the grammar costs a round. The engines load only when the command runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specdec_tools.loadgen.command import non_negative_float, non_negative_int, positive


def register(modes: Any) -> None:
    parser = modes.add_parser(
        "structured", help="constrained plain vs constrained speculative vs unconstrained speculative decoding",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="target model: path, .gguf file or `specdec models` name")
    parser.add_argument("--draft", help="the draft model (for --method draft_model or hybrid)")
    parser.add_argument("--method", default="draft_model",
                        help="the drafting method of both speculative modes: draft_model (default), hybrid, "
                             "suffix or ngram")
    parser.add_argument("--prompts", required=True, type=Path,
                        help='JSONL: {"prompt": "...", "schema": {...}} or {"prompt": "...", "tools": [...], '
                             '"tool_choice": {...}} per line (optional "id", "system")')
    parser.add_argument("--max-new-tokens", required=True, type=positive(int), help="per request")
    parser.add_argument("--num-prompts", type=positive(int), default=None, help="the first N requests (default all)")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="request i is sampled with seed + i")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--draft-quantization", choices=["none", "int8"], default="none",
                        help="int8 weights and activations for the draft (CPU with AVX-512 VNNI), as the demo config")
    parser.add_argument("--num-speculative-tokens", default="auto", help="k, or auto")
    parser.add_argument("--max-seq-len", type=positive(int), default=4096,
                        help="tokens per sequence (prompt and output) each engine holds")
    parser.add_argument("--json", required=True, type=Path, help="where to write the report")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from specdec_tools.bench.structured_report import format_table
    from specdec_tools.bench.structured_run import StructuredBenchConfig, run_structured_bench
    from specdec_tools.reports import write_report

    config = StructuredBenchConfig(
        target=args.target, draft=args.draft, method=args.method, prompts=args.prompts,
        max_new_tokens=args.max_new_tokens, limit=args.num_prompts, temperature=args.temperature, seed=args.seed,
        dtype=args.dtype, device=args.device, draft_quantization=args.draft_quantization,
        num_speculative_tokens=args.num_speculative_tokens, max_seq_len=args.max_seq_len)
    report = run_structured_bench(config)
    write_report(report, args.json)
    print(format_table(report))
    print(f"report: {args.json}")
    return 0
