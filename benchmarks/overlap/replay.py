"""Sequential and overlapped speculation replayed at other costs: what pre-drafting (`draft.overlap`) would be worth
on other hardware, from the rounds of a recorded run.

Input: a `specdec bench methods --overlap` report. Each request row of an overlapped engine (`METHOD+overlap`)
carries its rounds' outcomes: drafts proposed, accepted, whether the proposal was a pre-drafted branch (no draft
call) and whether the round pre-drafted the next. Greedy rounds' outcomes follow from the models alone, so the same
rounds are priced three ways, at batch size 1, with a table of costs (a draft step d, a verify of w tokens v(w), a
call's round trip r):

- plain:       every token a verify of 1:                 tokens x (v(1) + r)
- sequential:  each round drafts, then verifies:          n d + r (if n > 0) + v(n + 1) + r
- overlapped:  a round with a branch drafts nothing; one that pre-drafts runs its draft steps beside the verify,
               as many as fit in it (the engine's bound: at least 2, the guess and one draft), so the next
               round's branch holds at most that many less one: that round's drafts and accepted drafts are cut
               alike. [n d + r unless pre-drafted] + max(v(n + 1) + r, s d + r), s = min(n + 1, max(2, v / d))

Assumed: the sequential engine would have proposed and accepted what the overlapped one did (true of greedy
outcomes for equal k; `auto` may choose k differently), and a draft call costs its steps (no catch-up reads).

    PYTHONPATH=.:proto python benchmarks/overlap/replay.py --report docs/bench/overlap_code_pinned.json \\
        --rpc-ms 0,0.2,1,5 --json docs/bench/overlap_replay.json

Cost tables: the presets below (milliseconds; a verify's width between two measured ones is interpolated), or
`--costs FILE.json` of the same form.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specdec_tools.bench.gpu.projection import interpolated

PRESETS: dict[str, dict[str, Any]] = {
    # docs/benchmarks.md "On a GPU": H100, Qwen2.5-1.5B / 0.5B shapes in bf16, forwards captured as CUDA graphs.
    "h100-graphs-measured": {"draft_step_ms": 2.6, "verify_ms": {"1": 3.8, "5": 4.9, "17": 5.1, "65": 5.5}},
    # The GPU engine's goals (its plain step <= 2.0 ms, a verify of 5 <= 1.15x it, a draft step <= 1.2 ms).
    "h100-graphs-goal": {"draft_step_ms": 1.2, "verify_ms": {"1": 2.0, "5": 2.3, "17": 2.6}},
}

Outcome = tuple[int, int, bool, bool]  # proposed, accepted, pre-drafted, pre-drafted the next


def verify_ms(costs: Mapping[str, Any], width: int) -> float:
    """v(width): the table's, interpolated linearly between measured widths (flat beyond the ends)."""
    return interpolated({int(w): float(ms) for w, ms in costs["verify_ms"].items()}, width)


def replay(rounds: Sequence[Outcome], costs: Mapping[str, Any], rpc_ms: float) -> dict[str, float]:
    """Tokens per second of the rounds' tokens: plain, sequential and overlapped."""
    d = float(costs["draft_step_ms"])
    tokens = sum(accepted + 1 for _, accepted, _, _ in rounds)
    plain = tokens * (verify_ms(costs, 1) + rpc_ms)
    sequential = overlapped = 0.0
    overlapped_tokens, branch_cap = 0, None
    for n, accepted, predrafted, branched in rounds:
        verify = verify_ms(costs, n + 1) + rpc_ms
        draft = n * d + rpc_ms if n > 0 else 0.0
        sequential += draft + verify
        if predrafted and branch_cap is not None:  # the branch the last round had time for
            n, accepted = min(n, branch_cap), min(accepted, branch_cap)
            verify = verify_ms(costs, n + 1) + rpc_ms
        overlapped_tokens += accepted + 1
        steps = min(n + 1, max(2, int(verify_ms(costs, n + 1) // d)))
        branch_cap = steps - 1 if branched else None
        ahead = steps * d + rpc_ms if branched else 0.0
        overlapped += (0.0 if predrafted else draft) + max(verify, ahead)
    return {
        "tokens": tokens,
        "plain_tokens_per_s": 1e3 * tokens / plain,
        "sequential_tokens_per_s": 1e3 * tokens / sequential,
        "overlapped_tokens_per_s": 1e3 * overlapped_tokens / overlapped,
        "overlapped_over_sequential": (overlapped_tokens / overlapped) / (tokens / sequential),
        "sequential_over_plain": plain / sequential,
    }


def recorded_rounds(report: Mapping[str, Any], method: str | None) -> tuple[str, list[Outcome]]:
    """The overlapped engine's rounds over every request of the report (`method`, else the first `+overlap`)."""
    names = [m for m in report["methods"] if m.endswith("+overlap")]
    name = method or (names[0] if names else None)
    if name is None:
        raise SystemExit("the report has no +overlap engine: run `specdec bench methods --overlap`")
    rounds = [tuple(o) for row in report["requests"] if row["method"] == name for o in row.get("round_outcomes", ())]
    if not rounds:
        raise SystemExit(f"no round outcomes for {name!r} in the report")
    return name, rounds  # type: ignore[return-value]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", type=Path, required=True, help="a `specdec bench methods --overlap` report")
    parser.add_argument("--method", help="the overlapped engine to replay (default: the first METHOD+overlap)")
    parser.add_argument("--costs", type=Path, help="a cost table (JSON, as the presets); default: every preset")
    parser.add_argument("--rpc-ms", default="0,0.2,1,5", help="round trips per call to replay at, comma-separated")
    parser.add_argument("--json", type=Path, help="where to write the figures")
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text())
    name, rounds = recorded_rounds(report, args.method)
    tables = {args.costs.stem: json.loads(args.costs.read_text())} if args.costs else PRESETS
    rpcs = [float(v) for v in args.rpc_ms.split(",") if v.strip()]
    hits = sum(pre for _, _, pre, _ in rounds) / max(1, sum(br for _, _, _, br in rounds))
    rows = [
        {"costs": label, "rpc_ms": rpc, **replay(rounds, costs, rpc)} for label, costs in tables.items() for rpc in rpcs
    ]
    print(f"{name}: {len(rounds)} rounds, branch hit rate {hits:.2f}")
    print(f"{'costs':<24}{'rpc ms':>8}{'plain':>9}{'seq':>9}{'overlap':>9}{'ovl/seq':>9}")
    for r in rows:
        print(
            f"{r['costs']:<24}{r['rpc_ms']:>8g}{r['plain_tokens_per_s']:>9.1f}{r['sequential_tokens_per_s']:>9.1f}"
            f"{r['overlapped_tokens_per_s']:>9.1f}{r['overlapped_over_sequential']:>8.2f}x"
        )
    if args.json:
        out = {"report": str(args.report), "method": name, "rounds": len(rounds), "hit_rate": hits, "rows": rows}
        out["cost_tables"] = tables
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
