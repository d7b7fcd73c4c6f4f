"""How much n-gram lookup could ever give on recorded outputs: the ceiling behind docs/benchmarks.md's n-gram runs.

Replays each prompt's target-only greedy output (from a `specdec bench offline --ngram` report) through prompt
lookup with hindsight: every round proposes the continuation of the longest suffix match (n <= 4) found earlier in
the context, and with width W > 1 the W most recent distinct continuations at once, as a tree verify would, and
keeps the longest that the output confirms. Each round is charged the measured cost of verifying all its proposed
tokens in one forward (c(1 + tokens) over c(1), timed here on the target). No drafter cost, no prefill, no
overhead: decode speedups no lossless n-gram drafter can beat on this machine.

Usage: .venv/bin/python scripts/ngram_ceiling.py REPORT.json PROMPTS.jsonl [--target NAME] [--max-k K ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specdec_core.build import prepare_model
from specdec_core.chat import encode_prompt
from specdec_core.models.loader import LoadedModel, resolve_source
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_tools.requests import read_prompt_texts

MAX_N = 4
MAX_VERIFY = 16  # tokens per row a verify may take (the runner's max_extend)


def verify_costs(model: LoadedModel, context: int = 300, reps: int = 9) -> list[float]:
    """c(t) / c(1) for t = 1..MAX_VERIFY: median seconds of a forward of t tokens after `context` tokens."""
    runner = ModelRunner(model.model, RunnerConfig(num_slots=1, max_seq_len=context + 2 * MAX_VERIFY))
    slot = runner.allocate()
    runner.extend([slot], [[1] * context])
    medians = []
    for t in range(1, MAX_VERIFY + 1):
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            runner.extend([slot], [[5] * t], all_logits=True)
            times.append(time.perf_counter() - start)
            runner.truncate(slot, context)
        medians.append(statistics.median(times))
    return [m / medians[0] for m in medians]


def candidates(context: list[int], k: int, width: int) -> list[list[int]]:
    """Continuations (at most k tokens) of the `width` most recent distinct earlier occurrences of the longest
    suffix of `context` (n <= MAX_N) that occurred before."""
    L = len(context)
    for n in range(min(MAX_N, L - 1), 0, -1):
        suffix = context[L - n :]
        ends = [e for e in range(L - 2, n - 2, -1) if context[e - n + 1 : e + 1] == suffix]
        found: list[list[int]] = []
        for end in ends:
            continuation = context[end + 1 : end + 1 + k]
            if continuation and continuation not in found:
                found.append(continuation)
            if len(found) == width:
                break
        if found:
            return found
    return []


def replay(prompts: list[list[int]], outputs: list[list[int]], costs: list[float], k: int, width: int) -> tuple[float, float]:
    """(tokens per round, decode speedup) with hindsight: the best of `width` candidates of up to k tokens."""
    tokens = rounds = 0
    spent = 0.0
    for prompt, output in zip(prompts, outputs):
        context, i = prompt + output[:1], 1
        while i < len(output):
            cands = candidates(context, min(k, len(output) - i - 1), width)
            best = 0
            for cand in cands:
                run = 0
                while run < len(cand) and cand[run] == output[i + run]:
                    run += 1
                best = max(best, run)
            emitted = best + 1
            context += output[i : i + emitted]
            i += emitted
            tokens, rounds = tokens + emitted, rounds + 1
            spent += costs[min(MAX_VERIFY, 1 + sum(len(c) for c in cands)) - 1]
    return tokens / rounds, tokens / spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path)
    parser.add_argument("prompts", type=Path)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--max-k", type=int, nargs="+", default=[4, 8, 10, 15])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    report = json.loads(args.report.read_text())
    model = prepare_model(resolve_source(args.target), dtype="bfloat16", device="cpu")
    prompts = [encode_prompt(model.tokenizer, p) for p in read_prompt_texts(args.prompts)]
    outputs = [p["target_only_token_ids"] for p in report["prompts"]]
    costs = verify_costs(model)
    print("verify cost over decode, t = 1..16:", " ".join(f"{c:.2f}" for c in costs))
    print(f"{'k':>3} {'width':>5} {'tokens/round':>12} {'decode speedup ceiling':>22}")
    for k in args.max_k:
        for width in args.widths:
            per_round, speedup = replay(prompts, outputs, costs, k, width)
            print(f"{k:>3} {width:>5} {per_round:>12.2f} {speedup:>22.2f}")


if __name__ == "__main__":
    main()
