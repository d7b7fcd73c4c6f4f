"""`specdec bench structured --target T --draft D --prompts FILE.jsonl --json OUT`: structured output (JSON
extraction and forced tool calls) decoded plainly and speculatively under its constraint, and speculatively
without it, in one process and one run (`structured_run.py`): the speedup speculation brings to constrained
decoding, whether it keeps plain decoding's tokens, the share of tokens the grammar forces, the validity of the
outputs, and what the grammar costs a round. The engines load only when the command runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specdec_tools.bench.options import add_run_options, run_options
from specdec_tools.loadgen.command import positive


def register(modes: Any) -> None:
    parser = modes.add_parser(
        "structured",
        help="constrained plain vs constrained speculative vs unconstrained speculative decoding",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", required=True, help="target model: path, .gguf file or `specdec models` name")
    parser.add_argument("--draft", help="the draft model (for --method draft_model or hybrid)")
    parser.add_argument(
        "--method",
        default="draft_model",
        help="the drafting method of both speculative modes: draft_model (default), hybrid, suffix or ngram",
    )
    parser.add_argument(
        "--prompts",
        required=True,
        type=Path,
        help='JSONL: {"prompt": "...", "schema": {...}} or {"prompt": "...", "tools": [...], '
        '"tool_choice": {...}} per line (optional "id", "system")',
    )
    parser.add_argument("--max-new-tokens", required=True, type=positive(int), help="per request")
    parser.add_argument("--num-prompts", type=positive(int), default=None, help="the first N requests (default all)")
    add_run_options(parser, seed_help="request i is sampled with seed + i")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from specdec_tools.bench.structured_report import format_table
    from specdec_tools.bench.structured_run import StructuredBenchConfig, run_structured_bench
    from specdec_tools.reports import write_report

    config = StructuredBenchConfig(
        target=args.target,
        draft=args.draft,
        method=args.method,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        limit=args.num_prompts,
        **run_options(args),
    )
    report = run_structured_bench(config)
    write_report(report, args.json)
    print(format_table(report))
    print(f"report: {args.json}")
    return 0
