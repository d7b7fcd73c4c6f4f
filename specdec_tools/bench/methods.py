"""`specdec bench methods --target T --draft D (--prompts | --sessions) FILE.jsonl --json OUT`: plain decoding and
every drafting method on the same workload, in one process and one run (`methods_run.py`), so their ratios are
measured side by side. The engines load only when the command runs: `specdec --help` stays quick."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specdec_core.errors import InvalidArgument
from specdec_tools.bench.options import add_run_options, comma_ints, run_options
from specdec_tools.loadgen.command import positive


def register(modes: Any) -> None:
    parser = modes.add_parser(
        "methods",
        help="plain decoding and every drafting method side by side, in one process",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", required=True, help="target model: path, .gguf file or `specdec models` name")
    parser.add_argument(
        "--draft", required=True, help="the draft model of the methods that run one (draft_model, hybrid)"
    )
    workload = parser.add_mutually_exclusive_group(required=True)
    workload.add_argument("--prompts", type=Path, help='JSONL, one {"prompt": "..."} per line: each once per method')
    workload.add_argument(
        "--sessions",
        type=Path,
        help='JSONL, one {"system": "...", "turns": ["...", ...]} per line: each replayed per method',
    )
    parser.add_argument(
        "--methods",
        type=lambda text: tuple(m.strip() for m in text.split(",") if m.strip()),
        default=None,
        help="comma-separated, e.g. off,suffix,draft_model (default: off and every "
        "registered method; off, the baseline, always runs)",
    )
    parser.add_argument("--max-new-tokens", required=True, type=positive(int), help="per request (per turn)")
    parser.add_argument("--num-prompts", type=positive(int), default=None, help="the first N prompts (default all)")
    parser.add_argument("--num-sessions", type=positive(int), default=None, help="the first N sessions (default all)")
    parser.add_argument(
        "--draft-confidence-threshold",
        default=(0.0,),
        type=lambda text: tuple(float(v) for v in text.split(",") if v.strip()),
        help="draft_model and hybrid: a row stops drafting after a draft the draft model gives less "
        "than this probability (draft.confidence_threshold; default 0: off). Several, "
        "comma-separated: those methods run once per value, side by side, as METHOD for the "
        "first and METHOD@VALUE for the others",
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="also run each method that runs a draft model with pre-drafting during verify (draft.overlap: on), "
        "as METHOD+overlap; pays only with the draft on cores of its own (--draft-cores)",
    )
    parser.add_argument(
        "--target-cores",
        type=cores,
        metavar="ID,...",
        help="CPU ids for the target: this process's thread that runs the engine and the target's forwards",
    )
    parser.add_argument(
        "--draft-cores",
        type=cores,
        metavar="ID,...",
        help="CPU ids for the draft model: every draft call runs on a thread pinned there (a draft device of its "
        "own, `bench/pinned.py`); with --target-cores, disjoint from them. Torch threads: the fewer of the two",
    )
    add_run_options(
        parser, seed_help="request i of the run (prompt i, or turn i over all sessions) is sampled with seed + i"
    )
    parser.set_defaults(func=main)


cores = comma_ints(0, "CPU ids")


def main(args: argparse.Namespace) -> int:
    from specdec_tools.bench.methods_report import format_table
    from specdec_tools.bench.methods_run import MethodsBenchConfig, run_methods_bench
    from specdec_tools.reports import write_report

    if args.num_prompts is not None and args.prompts is None:
        raise InvalidArgument("--num-prompts", "goes with --prompts")
    if args.num_sessions is not None and args.sessions is None:
        raise InvalidArgument("--num-sessions", "goes with --sessions")
    if (args.target_cores is None) != (args.draft_cores is None):
        raise InvalidArgument("--draft-cores", "give both --target-cores and --draft-cores, or neither")
    if args.target_cores is not None and set(args.target_cores) & set(args.draft_cores):
        raise InvalidArgument("--draft-cores", "must not share a core with --target-cores")
    config = MethodsBenchConfig(
        target=args.target,
        draft=args.draft,
        max_new_tokens=args.max_new_tokens,
        prompts=args.prompts,
        sessions=args.sessions,
        limit=args.num_prompts or args.num_sessions,
        methods=args.methods,
        draft_confidence_thresholds=args.draft_confidence_threshold,
        overlap=args.overlap,
        target_cores=args.target_cores,
        draft_cores=args.draft_cores,
        **run_options(args),
    )
    report = run_methods_bench(config)
    write_report(report, args.json)
    print(format_table(report))
    print(f"report: {args.json}")
    return 0
