"""What rules a serving engine can follow reach on a workload here, and what costs would reach 2.5x.

`hybrid_ceiling.py` bounds every policy by an oracle that knows where each proposal will be rejected. This script
replays rules that decide from what the engine sees before verifying, over the same exact outcomes: at temperature
0 the target's output is known (the report's `off` rows, which every method reproduced), so a round's result
follows from what each drafter proposes at that position:

- the draft model's chain: one teacher-forced pass of the draft (as the benchmark quantizes it, on the 4-bit
  kernel that single draft steps run) over prompt + output gives, at each output position, whether the draft's
  top token is the target's and the draft's probability of it (what `draft.confidence_threshold` reads);
- suffix's proposal there, replayed as the benchmark drove it (`hybrid_ceiling.suffix_accepted`).

Rules:

- `draft_model K`: up to K drafts, stopping after one whose probability is below 0.5 (the engine's rule at the
  benchmark's threshold);
- `draft_model cumulative`: up to 16 drafts, stopping after the one where the product of their probabilities
  falls below 0.5 (the chance, by the draft's word, that all of them are right);
- `hybrid K`: suffix's proposal where it offers at least 3 tokens (cut to 16), else `draft_model K`.

A round costs its draft forwards (the first reads two tokens: the last round's last draft and its bonus or
recovered token), the target's verify of its proposal plus one, and the engine's own time per round; a plain
step costs a verify of one token and the engine's time. Forward costs come from a `kernel_costs.py` report
(the same machine, one process per model, 600 tokens of context).

Approximations, each in the rules' favour: after a rejected draft the teacher-forced confidences stand in for
the draft's own (which follow its wrong token), and the draft never pays a catch-up read after suffix rounds.
The calibration rows put the replay's `draft_model` and `hybrid` beside the report's measured ones.

Sensitivity: the best `hybrid` rule again with every draft forward scaled by a factor, and with the verify's
cost beyond one token scaled, to say which cost would have to fall, and by how much, for a target speedup.

Limits (`--limits`, a `cpu_limits.py` report of the same machine): every rule again with both costs at what the
CPU allows at most, each never above what was measured: a draft forward at the time its 4-bit weights take to
read from memory (attention, norms and compute free), a verify's tokens past the first at the fp32 multiply-add
peak (2 flops a weight a token, the LM head included). No kernel can beat these, so a rule that stays below a
target here cannot reach it on this machine by faster kernels alone.

    PYTHONPATH=.:proto python scripts/kernel_costs.py --only target-kernels,draft-int4 \
        --target-widths 1,2,3,4,5,6,7,9,13,17 --draft-widths 1,2,3 --json COSTS
    PYTHONPATH=.:proto python scripts/cpu_limits.py --json LIMITS
    PYTHONPATH=.:proto python scripts/hybrid_replay.py --report docs/bench/methods_sessions_avx2_int4_int8rows_2.json \
        --costs COSTS --limits LIMITS --json docs/bench/hybrid_replay_sessions_avx2.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import hybrid_ceiling  # noqa: E402
import tree_verify_gain as replayed  # noqa: E402

DRAFT = "qwen2.5-coder-0.5b-instruct"
THRESHOLD = 0.5  # the benchmark's --draft-confidence-threshold
MIN_SUFFIX = 3  # hybrid takes suffix's proposal from this many tokens
MAX_K = 16
TARGET_SPEEDUP = 2.5


@dataclass(frozen=True)
class Drafts:
    """At each output position j >= 1: whether the draft's top token is output[j], and its probability."""

    right: list[bool]
    confidence: list[float]


@dataclass(frozen=True)
class Costs:
    verify: Callable[[int], float]  # ms of a verify of w tokens
    draft: Callable[[int], float]  # ms of a draft forward of w tokens
    round_ms: float  # the engine's own time per speculative round
    plain_round_ms: float  # ... per plain round (no draft call)


@dataclass
class Tally:
    tokens: int = 0
    ms: float = 0.0
    rounds: int = 0
    suffix_rounds: int = 0

    def add(self, tokens: int, ms: float, suffix: bool = False) -> int:
        self.tokens, self.ms, self.rounds = self.tokens + tokens, self.ms + ms, self.rounds + 1
        self.suffix_rounds += suffix
        return tokens

    def speedup(self, plain_ms: float) -> float:
        """Decode speed over plain decoding's, which takes `plain_ms` a token."""
        return round(plain_ms * self.tokens / self.ms, 3)


def teacher_forced(requests: Sequence[replayed.Replayed], quantization: str) -> tuple[list[Drafts], int]:
    """The draft's top token and its probability at every output position, one forward per request; and the bytes
    of quantized weights a draft step reads (`step_bytes`)."""
    os.environ["SPECDEC_DISABLE_INT8_ROWS"] = "1"  # the 4-bit kernel, as single draft steps run (rows independent)
    import torch

    from specdec_core.build import prepare_model
    from specdec_core.kv_cache import KVCache

    draft = prepare_model(DRAFT, dtype="bfloat16", device="cpu", quantization=quantization).model.eval()
    layer = draft.layers[0].self_attn
    out = []
    for r in requests:
        sequence = torch.tensor([r.prompt + r.output[:-1]])  # [1, L]
        length = sequence.shape[1]
        cache = KVCache(draft.args.num_layers, 1, layer.num_kv_heads, length, draft.args.head_dim, torch.bfloat16)
        index = torch.arange(len(r.prompt), length).view(1, -1)  # [1, n]: the logits predicting output 1..
        with torch.inference_mode():
            logits = draft(sequence, torch.arange(length).view(1, -1), cache, torch.tensor([0]), length, (0, 0),
                           index)[0]  # [n, V]
        top = logits.softmax(-1).max(-1)  # values, indices: [n] each
        right = (top.indices == torch.tensor(r.output[1:])).tolist()
        out.append(Drafts(right, top.values.tolist()))
    return out, step_bytes(draft)


def step_bytes(model: Any) -> int:
    """Bytes of quantized weights (and their biases) a step of `model` reads: every weight of its linear layers
    once, the LM head included; the embedding gives one row a token, and second copies kept for calls of many rows
    (`fbgemm_rows`) are not read by a step."""
    from specdec_core.kernels.cpu import Int4CPULinear, Int8CPULinear

    total = 0
    for module in model.modules():
        if isinstance(module, (Int4CPULinear, Int8CPULinear)):
            total += module.qweight.numel() * module.qweight.element_size()
            total += 0 if module.bias is None else module.bias.numel() * module.bias.element_size()
    return total


def flops_per_token(args: Any) -> float:
    """2 flops (a multiply and an add) per weight of the linear layers, the LM head included, for one token."""
    attention = args.hidden_size * (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
    attention += args.num_heads * args.head_dim * args.hidden_size
    mlp = 3 * args.hidden_size * args.intermediate_size
    return 2.0 * (args.num_layers * (attention + mlp) + args.vocab_size * args.hidden_size)


def limit_costs(costs: Costs, read_gbs: float, fma_gflops: float, draft_bytes: int, target_flops: float) -> Costs:
    """`costs` at what the CPU allows: a draft forward at its weights' read time, a verify's tokens past the first
    at the multiply-add peak; never above what was measured."""
    draft_ms = draft_bytes / (read_gbs * 1e9) * 1e3
    token_ms = target_flops / (fma_gflops * 1e9) * 1e3
    one = costs.verify(1)
    return replace(costs, draft=lambda w: min(costs.draft(w), draft_ms),
                   verify=lambda w: min(costs.verify(w), one + token_ms * (w - 1)))


def cost_curve(ms: dict[str, float]) -> Callable[[int], float]:
    """Linear between measured widths, and along the last two beyond them."""
    points = sorted((int(w), m) for w, m in ms.items())

    def at(w: int) -> float:
        for (w0, m0), (w1, m1) in zip(points, points[1:]):
            if w <= w1:
                return m0 + (m1 - m0) * (w - w0) / (w1 - w0)
        (w0, m0), (w1, m1) = points[-2:]
        return m1 + (m1 - m0) * (w - w1) / (w1 - w0)

    return at


def chain(drafts: Drafts, p: int, limit: int, cumulative: bool) -> int:
    """How many drafts the rule makes at position p (output tokens committed), at most `limit`."""
    k, product = 0, 1.0
    while k < limit and p - 1 + k < len(drafts.right):
        q = drafts.confidence[p - 1 + k]
        product, k = product * q, k + 1
        if (product if cumulative else q) < THRESHOLD:
            break
    return k


def replay(drafts: Sequence[Drafts], offers: Sequence[list[list[int]]], costs: Costs, limit: int,
           cumulative: bool, suffix: bool) -> Tally:
    """Every request decoded by the rule; output token 0 is prefill's."""
    tally = Tally()
    for d, offer in zip(drafts, offers):
        length, p = len(d.right) + 1, 1
        while p < length:
            left = length - p
            if suffix and len(offer[p]) >= MIN_SUFFIX:
                n = min(len(offer[p]), MAX_K)
                p += tally.add(min(offer[p][n - 1] + 1, left), costs.verify(n + 1) + costs.round_ms, suffix=True)
                continue
            k = chain(d, p, limit, cumulative)
            accepted = next((i for i in range(k) if not d.right[p - 1 + i]), k)
            drafting = costs.draft(2) + (k - 1) * costs.draft(1) if k else 0.0
            engine = costs.round_ms if k else costs.plain_round_ms
            p += tally.add(min(accepted + 1, left), drafting + costs.verify(k + 1) + engine)
    return tally


RULES = {  # name -> (draft limit, cumulative, suffix)
    **{f"draft_model k={k}": (k, False, False) for k in (4, 5, 6, 8)},
    "draft_model cumulative": (MAX_K, True, False),
    **{f"hybrid k={k}": (k, False, True) for k in (4, 5, 6, 8)},
    "hybrid cumulative": (MAX_K, True, True),
}


def speedups(drafts: Sequence[Drafts], offers: Sequence[list[list[int]]], costs: Costs,
             plain_ms: float) -> dict[str, dict[str, float]]:
    out = {}
    for name, (limit, cumulative, suffix) in RULES.items():
        t = replay(drafts, offers, costs, limit, cumulative, suffix)
        out[name] = {"decode_speedup": t.speedup(plain_ms), "ms_per_token": round(t.ms / t.tokens, 1),
                     "tokens_per_round": round(t.tokens / t.rounds, 2), "rounds": t.rounds,
                     "suffix_rounds": t.suffix_rounds}
    return out


def sensitivity(drafts: Sequence[Drafts], offers: Sequence[list[list[int]]], costs: Costs, plain_ms: float,
                rule: str) -> dict[str, dict[str, float]]:
    """`rule`'s speedup with every draft forward scaled, and with a verify's cost beyond one token scaled."""
    limit, cumulative, suffix = RULES[rule]
    one = costs.verify(1)
    out: dict[str, dict[str, float]] = {"draft_forward": {}, "verify_beyond_one_token": {}}
    for factor in (1.0, 0.8, 0.6, 0.4):
        variants = {
            "draft_forward": replace(costs, draft=lambda w, f=factor: f * costs.draft(w)),
            "verify_beyond_one_token": replace(costs, verify=lambda w, f=factor: one + f * (costs.verify(w) - one)),
        }
        for what, scaled in variants.items():
            out[what][f"{factor:g}"] = replay(drafts, offers, scaled, limit, cumulative, suffix).speedup(plain_ms)
    return out


def measured(report: dict[str, Any], group: str) -> dict[str, float]:
    return {m: round(r[group]["decode_speedup"], 3) for m, r in report["results"].items()}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{result['group']} of {result['report']}: plain step {result['plain_ms']:.1f} ms "
             f"(verify of 1: {result['verify_1_ms']:.1f} ms, engine {result['round_ms']:.1f} ms a speculative round); "
             f"measured in the report: {result['measured']}"]
    lines += [f"  {name:24s} {r['decode_speedup']:.3f}x  {r['tokens_per_round']:.2f} tok/round  "
              f"{r['ms_per_token']:.1f} ms/token" for name, r in result["rules"].items()]
    for what, row in result["sensitivity"].items():
        lines.append(f"  {result['best_hybrid']} with {what} x " + ", ".join(f"{f}: {s:.3f}x" for f, s in row.items()))
    if "limits" in result:
        limits = result["limits"]
        lines.append(f"  at the CPU's limits ({limits['read_gbs']:.1f} GB/s read, {limits['fma_gflops']:.0f} GFLOP/s): "
                     f"draft forward {limits['draft_forward_ms']:.1f} ms, verify of 1/2/5/9/17 "
                     + "/".join(f"{ms:.0f}" for ms in limits["verify_ms"].values()) + " ms")
        lines += [f"    {name:22s} {r['decode_speedup']:.3f}x  {r['tokens_per_round']:.2f} tok/round"
                  for name, r in limits["rules"].items()]
        lines.append(f"    {limits['best_hybrid']} with only one cost at its limit: " + ", ".join(
            f"{what} {x:.3f}x" for what, x in limits["best_hybrid_one_limit"].items()))
    return "\n".join(lines)


def at_limits(limits: dict[str, Any], drafts: Sequence[Drafts], offers: Sequence[list[list[int]]], costs: Costs,
              plain_ms: float, draft_bytes: int) -> dict[str, Any]:
    """Every rule with both costs at the CPU's limits (`limit_costs`); plain decoding keeps its measured cost."""
    from specdec_core.models.families import args_from_hf_config
    from specdec_core.models.loader import resolve_source

    config = json.loads((resolve_source(replayed.TARGET) / "config.json").read_text())
    flops = flops_per_token(args_from_hf_config(config))
    limited = limit_costs(costs, limits["read_gbs"], limits["fma_gflops"], draft_bytes, flops)
    rules = speedups(drafts, offers, limited, plain_ms)
    best = max((n for n in rules if n.startswith("hybrid")), key=lambda n: rules[n]["decode_speedup"])
    alone = {"draft_forward": replace(costs, draft=limited.draft), "verify": replace(costs, verify=limited.verify)}
    return {"read_gbs": limits["read_gbs"], "fma_gflops": limits["fma_gflops"], "draft_bytes": draft_bytes,
            "target_flops_per_token": flops, "draft_forward_ms": round(limited.draft(1), 2),
            "verify_ms": {w: round(limited.verify(w), 1) for w in (1, 2, 5, 9, 17)}, "rules": rules,
            "best_hybrid": best,
            "best_hybrid_one_limit": {what: replay(drafts, offers, one, *RULES[best]).speedup(plain_ms)
                                      for what, one in alone.items()}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--report", type=Path, required=True, help="a `specdec bench methods` report (greedy)")
    parser.add_argument("--costs", type=Path, required=True, help="a `kernel_costs.py` report: the target's "
                        "verify widths and the draft's forwards of 1 and 2 tokens")
    parser.add_argument("--draft-run", default="draft int4, kernels", help="which of its draft runs")
    parser.add_argument("--quantization", default="int4", help="the draft's, as the benchmark ran it")
    parser.add_argument("--round-ms", type=float, default=14.0,
                        help="the engine's own time per speculative round, besides the models' forwards")
    parser.add_argument("--plain-round-ms", type=float, default=5.0,
                        help="the engine's own time per plain round, besides the target's forward")
    parser.add_argument("--limits", type=Path, help="a `cpu_limits.py` report of this machine: also replay every "
                        "rule with the draft forward and the verify's extra tokens at the CPU's limits")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from specdec_core.models.loader import load_tokenizer

    report = json.loads(args.report.read_text())
    if report.get("temperature", 0.0) != 0.0:
        raise SystemExit("the replay needs a greedy report (temperature 0)")
    runs = json.loads(args.costs.read_text())["runs"]
    costs = Costs(cost_curve(runs["target, kernels"]["ms"]), cost_curve(runs[args.draft_run]["ms"]), args.round_ms,
                  args.plain_round_ms)
    rebuild = replayed.sessions_requests if report["workload"] == "sessions" else replayed.prompts_requests
    group = report["headline_group"]
    requests = rebuild(report, load_tokenizer(replayed.TARGET).tokenizer)
    scored = [i for i, r in enumerate(requests) if group == "all" or r.group == group]
    offers = hybrid_ceiling.suffix_accepted(requests)  # in order: the global structure learns from every request
    drafts, draft_bytes = teacher_forced([requests[i] for i in scored], args.quantization)
    offers = [offers[i] for i in scored]
    plain_ms = costs.verify(1) + args.plain_round_ms
    rules = speedups(drafts, offers, costs, plain_ms)
    best = max((n for n in rules if n.startswith("hybrid")), key=lambda n: rules[n]["decode_speedup"])
    result = {"report": args.report.name, "costs": args.costs.name, "group": group, "draft_run": args.draft_run,
              "plain_ms": plain_ms, "verify_1_ms": costs.verify(1), "round_ms": args.round_ms,
              "draft_top1_rate": round(sum(sum(d.right) for d in drafts) / sum(len(d.right) for d in drafts), 4),
              "measured": measured(report, group), "rules": rules, "best_hybrid": best,
              "sensitivity": sensitivity(drafts, offers, costs, plain_ms, best), "target_speedup": TARGET_SPEEDUP}
    if args.limits is not None:
        result["limits"] = at_limits(json.loads(args.limits.read_text()), drafts, offers, costs, plain_ms, draft_bytes)
    print(format_table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
