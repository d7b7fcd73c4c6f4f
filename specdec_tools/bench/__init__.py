"""`specdec bench offline` (one process, offline.py), `stack`, `tp` and `tracing` (the served stack, stack.py),
`specdec bench serve`, the load generator (specdec_tools.loadgen), and `specdec bench sessions`, multi-turn
conversations with prefix caching on vs off (sessions.py), `specdec bench methods`, plain decoding and every
drafting method side by side in one process (methods.py), `specdec bench structured`, constrained decoding
plain and speculative, and speculative without the constraint, side by side (structured.py), `specdec bench
peer`, llama.cpp's llama-server against `specdec serve` over one HTTP client (peer.py, peer_llama.py), and `specdec
bench gpu`, the engine on a CUDA device: exactness with CUDA graphs off and on, the sampler's law, costs against the
device's read limit, and the CPU benchmarks' acceptance priced at them (gpu/)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec_tools.bench import gpu, methods, peer, sessions, stack, structured
from specdec_tools.bench.options import add_draft_quantization, add_draft_vocabulary
from specdec_tools.loadgen import cli as loadgen


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="benchmarks")
    modes = parser.add_subparsers(dest="bench_mode", required=True)
    offline = modes.add_parser(
        "offline", help="target-only vs speculative decoding (and transformers' own) in one process"
    )
    offline.add_argument("--target", required=True, help="target model: path, .gguf file or `specdec models` name")
    drafting = offline.add_mutually_exclusive_group(required=True)
    drafting.add_argument("--draft", help="draft model: path, .gguf file or `specdec models` name")
    drafting.add_argument("--ngram", action="store_true", help="draft by n-gram prompt lookup instead of a model")
    drafting.add_argument(
        "--suffix",
        action="store_true",
        help="draft by SuffixDecoding (this request's and earlier requests' tokens) instead of a model",
    )
    offline.add_argument("--prompts", required=True, type=Path, help='JSONL, one {"prompt": "..."} per line')
    offline.add_argument("--max-new-tokens", required=True, type=int)
    offline.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    offline.add_argument("--seed", type=int, default=0, help="prompt i is sampled with seed + i")
    offline.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    offline.add_argument("--device", default="cpu", help="cpu or cuda")
    offline.add_argument("--num-speculative-tokens", default="auto", help="k, or auto")
    offline.add_argument(
        "--compare-hf",
        action="store_true",
        help="also time transformers' generate and its assisted generation / prompt lookup",
    )
    offline.add_argument(
        "--prompt-lookup-num-tokens",
        type=int,
        default=10,
        help="transformers' prompt lookup length (with --compare-hf --ngram or --suffix)",
    )
    add_draft_quantization(offline)
    add_draft_vocabulary(offline)
    offline.add_argument("--json", required=True, type=Path, help="where to write the report")
    offline.set_defaults(func=_offline)
    loadgen.register(modes)
    sessions.register(modes)
    methods.register(modes)
    structured.register(modes)
    peer.register(modes)
    gpu.register(modes)
    stack.register_stack(modes)
    stack.register_tp(modes)
    stack.register_tracing(modes)


def _offline(args: argparse.Namespace) -> int:
    from specdec_tools.bench.offline import OfflineBenchConfig, run_offline_bench
    from specdec_tools.reports import write_report

    config = OfflineBenchConfig(
        target=args.target,
        # the flags name the registry's methods
        method="ngram" if args.ngram else "suffix" if args.suffix else "draft_model",
        draft=args.draft,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        num_speculative_tokens=args.num_speculative_tokens,
        compare_hf=args.compare_hf,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        draft_quantization=args.draft_quantization,
        draft_vocabulary=args.draft_vocabulary,
    )
    report = run_offline_bench(config)
    write_report(report, args.json)
    summary = {k: v for k, v in report.items() if not isinstance(v, (list, dict))}
    print(json.dumps(summary, indent=2))
    return 0
