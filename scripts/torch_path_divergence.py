"""How often greedy speculative output departs from plain greedy decoding on torch's code paths, and where.

The CPU kernels compute each row the same way whatever else is in the call, so on them a verify of k + 1 rows gives
each row the logits a one-row decode gives, and greedy speculation reproduces plain decoding bit for bit. torch's
own paths (float16/float32, no AVX-512, no compiler, CUDA, or SPECDEC_DISABLE_CPU_KERNELS) pick their matmul and
attention kernels by shape, so the two round differently, and an argmax near a tie may flip. This measures it on a
real pair, with the kernels switched off (SPECDEC_DISABLE_CPU_KERNELS) unless `--kernels` is given:

- per prompt: plain and speculative greedy outputs (one request at a time), the first position where they differ,
  and the margin there: plain decoding's chosen logit minus the speculative token's, on plain decoding's own path
  (prefill, then one row per step), absolute and over the largest logit;
- over all prompts: the fraction that differ, and their first divergence positions;
- logits: at a few points of each plain output, a verify of the next `--verify-rows` tokens in one forward against
  one-row decodes of the same tokens after the same prefix: the largest difference, and how many rows are equal
  bit for bit.

    .venv/bin/python scripts/torch_path_divergence.py --target qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct --prompts benchmarks/prompts/code.jsonl --max-new-tokens 96 \\
        --json docs/bench/torch_path_divergence.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from specdec_core.build import DraftSpec, build_engine, load_pair
from specdec_core.chat import encode_prompt
from specdec_core.config import SamplingParams, parse_num_speculative_tokens
from specdec_core.drafters import registry
from specdec_core.kernels.cpu import kernel_path, rows_batch_invariant
from specdec_core.models.loader import LoadedModel
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_tools.bench.offline import ModeResult, run_one
from specdec_tools.reports import write_report
from specdec_tools.requests import read_prompt_texts

POINTS_PER_PROMPT = 3  # where along each plain output the logits are compared


def plain_path_logits(model: LoadedModel, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Plain decoding's path: `prompt` prefilled, then `tokens` one row per forward. [len(tokens) + 1, V]: the
    logits after the prompt, then after each token."""
    runner = ModelRunner(model.model, RunnerConfig(num_slots=1, max_seq_len=len(prompt) + len(tokens) + 1))
    slot = runner.allocate()
    rows = [runner.extend([slot], [prompt])[0]]
    rows += [runner.extend([slot], [[t]])[0] for t in tokens]
    return torch.stack(rows)


def verify_logits(model: LoadedModel, prefix: list[int], tokens: list[int]) -> torch.Tensor:  # [len(tokens), V]
    """A verify's path: `prefix` prefilled, then `tokens` in one forward; the logits at each."""
    runner = ModelRunner(model.model, RunnerConfig(num_slots=1, max_seq_len=len(prefix) + len(tokens) + 1))
    slot = runner.allocate()
    runner.extend([slot], [prefix])
    return runner.extend([slot], [tokens], all_logits=True)[0]


def first_divergence(model: LoadedModel, prompt: list[int], plain: list[int], speculative: list[int]) -> dict | None:
    """Where `speculative` first differs from `plain`, and the margin plain decoding chose by there."""
    at = next((i for i, (a, b) in enumerate(zip(plain, speculative)) if a != b), None)
    if at is None:
        return None if len(plain) == len(speculative) else {"position": min(len(plain), len(speculative)),
                                                             "margin": None, "relative_margin": None}
    logits = plain_path_logits(model, prompt, plain[:at])[-1]  # [V]: what plain decoding chose position `at` from
    margin = float(logits[plain[at]] - logits[speculative[at]])
    return {"position": at, "margin": margin, "relative_margin": margin / float(logits.abs().max())}


def compare_logits(model: LoadedModel, prompt: list[int], plain: list[int], rows: int) -> tuple[float, float, int, int]:
    """(max |verify - decode|, the same over the largest logit, bit-equal rows, rows) at a few points of `plain`."""
    worst = worst_relative = 0.0
    equal = total = 0
    last = len(plain) - rows
    for point in sorted({max(0, last * i // max(1, POINTS_PER_PROMPT - 1)) for i in range(POINTS_PER_PROMPT)}):
        prefix, tokens = prompt + plain[:point], plain[point : point + rows]
        if len(tokens) < 2:
            continue
        decoded, verified = plain_path_logits(model, prefix, tokens)[1:], verify_logits(model, prefix, tokens)
        difference = float((verified - decoded).abs().max())
        worst = max(worst, difference)
        worst_relative = max(worst_relative, difference / float(decoded.abs().max()))
        equal += sum(bool(torch.equal(a, b)) for a, b in zip(decoded, verified))
        total += len(tokens)
    return worst, worst_relative, equal, total


def run(args: argparse.Namespace) -> dict[str, Any]:
    k = parse_num_speculative_tokens(args.num_speculative_tokens, 16)
    texts = read_prompt_texts(args.prompts)[: args.num_prompts]
    target, draft = load_pair(args.target, args.draft, dtype=args.dtype, device=args.device)
    assert draft is not None
    prompts = [encode_prompt(target.tokenizer, text) for text in texts]
    runner_config = RunnerConfig(num_slots=1, max_seq_len=max(map(len, prompts)) + args.max_new_tokens + 1)
    plain_engine = build_engine(target, None, DraftSpec(method=registry.NONE), runner_config=runner_config)
    spec_engine = build_engine(target, draft, DraftSpec(method="draft_model"), runner_config=runner_config,
                               max_speculative_tokens=16)
    params = SamplingParams(max_tokens=args.max_new_tokens)
    per_prompt, proposed, accepted = [], 0, 0
    worst = worst_relative = 0.0
    equal_rows = rows = 0
    for i, prompt in enumerate(prompts):
        plain, speculative = ModeResult(), ModeResult()
        run_one(plain_engine, f"plain-{i}", prompt, params, 0, plain)
        run_one(spec_engine, f"spec-{i}", prompt, params, k, speculative)
        proposed, accepted = proposed + speculative.proposed, accepted + speculative.accepted
        expected, got = plain.token_ids[0], speculative.token_ids[0]
        divergence = first_divergence(target, prompt, expected, got)
        a, b, c, d = compare_logits(target, prompt, expected, args.verify_rows)
        worst, worst_relative, equal_rows, rows = max(worst, a), max(worst_relative, b), equal_rows + c, rows + d
        per_prompt.append({"prompt_tokens": len(prompt), "plain_token_ids": expected, "speculative_token_ids": got,
                           "first_divergence": divergence})
        print(f"prompt {i}: " + ("identical" if divergence is None else
                                 f"differs from position {divergence['position']} (margin {divergence['margin']})"))
    positions = [p["first_divergence"]["position"] for p in per_prompt if p["first_divergence"] is not None]
    return {
        "target": args.target, "draft": args.draft, "dtype": args.dtype, "device": args.device,
        "kernels": "on" if args.kernels else "off (SPECDEC_DISABLE_CPU_KERNELS)",
        "target_kernels": kernel_path(target.model), "draft_kernels": kernel_path(draft.model),
        "rows_batch_invariant": rows_batch_invariant(target.model),
        "threads": torch.get_num_threads(), "num_speculative_tokens": args.num_speculative_tokens,
        "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts),
        "diverging_prompts": len(positions), "diverging_fraction": len(positions) / len(prompts),
        "first_divergence_positions": positions,
        "median_first_divergence": statistics.median(positions) if positions else None,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "verify_rows": args.verify_rows,
        "logits_max_abs_difference": worst, "logits_max_relative_difference": worst_relative,
        "logits_bit_equal_rows": equal_rows, "logits_rows": rows,
        "prompts": per_prompt,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="path or `specdec models` name")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="path or `specdec models` name")
    parser.add_argument("--prompts", type=Path, default=Path("benchmarks/prompts/code.jsonl"))
    parser.add_argument("--num-prompts", type=int, default=None, help="the first N prompts (default all)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-speculative-tokens", default="auto", help="k, or auto")
    parser.add_argument("--verify-rows", type=int, default=4, help="rows of each logits comparison (k + 1)")
    parser.add_argument("--kernels", action="store_true", help="keep the CPU kernels on (the control: no divergence)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    if not args.kernels:
        os.environ["SPECDEC_DISABLE_CPU_KERNELS"] = "1"  # read when the kernels first load, below
    report = run(args)
    write_report(report, args.json)
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, (list, dict))}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
