"""The most any per-round choice between plain decoding, the draft model and suffix could give on a workload here.

`hybrid` chooses, each round and for each request, plain decoding, the draft model's chain of some k, or suffix's
proposal (cut to what its label earns). At temperature 0 what each option would commit at each position follows
from the target's greedy output: the draft model's chain of k is accepted while the draft's teacher-forced rank of
the target's token is 1 (the ranks `draft_tree_gain.py` records), and suffix's proposal at a position is what
`SuffixDrafter` proposes there, replayed as the benchmark drove it (`tree_verify_gain.py`). With the measured cost
of each option (draft forwards, the target's verify of n tokens, the per-round overhead), a dynamic program over
positions finds the fastest sequence of rounds for each request: the choice an oracle that knew every outcome
would make. No policy over these options decodes faster, so if the oracle's speedup over plain decoding is below a
target, no tuning of `hybrid`'s policy reaches it with this pair on this machine.

Options per round: plain; the draft chain of k = 1..12; suffix's proposal cut to any length 1..16; and, as a
second ceiling, also the draft model's rank trees (`draft_tree_gain.py`, in-sample, the most they find) at the
torch tree mask's cost. Not modelled, each in the oracle's favour: the draft's catch-up forward over tokens that
suffix rounds committed, and the engine's costs of choosing.

    PYTHONPATH=.:proto python scripts/hybrid_ceiling.py --tree-report docs/bench/draft_tree_gain.json \
        --costs-from docs/bench/tree_verify_gain.json --json docs/bench/hybrid_ceiling.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import draft_tree_gain as trees  # noqa: E402
import tree_verify_gain as suffix_replay  # noqa: E402

from specdec_core.config import TokenShaping  # noqa: E402
from specdec_core.drafters.base import DraftRequest  # noqa: E402
from specdec_core.drafters.suffix import SuffixDrafter  # noqa: E402

MAX_K = 12  # the draft chain's longest
SUFFIX_K = suffix_replay.MAX_K


def suffix_accepted(requests: Sequence[suffix_replay.Replayed]) -> list[list[list[int]]]:
    """Per request and position p (output tokens committed, 1..L-1): suffix's proposal there, as the accepted
    length of each cut: [accepted if cut to 1, to 2, ...] (empty: no proposal)."""
    drafter = SuffixDrafter()
    out = []
    for number, r in enumerate(requests):
        seq_id = f"r{number}"
        tokens = list(r.prompt) + r.output[:1]
        drafter.start(seq_id, tokens, r.salt)
        per_position: list[list[int]] = [[]]  # position 0 is prefill's
        for p in range(1, len(r.output)):
            chain, _ = drafter._lookup(DraftRequest(seq_id, tokens, SUFFIX_K, TokenShaping(), None))
            target = r.output[p:]
            accepted, run = [], 0
            for i, t in enumerate(chain):
                run = run + 1 if run == i and i < len(target) and target[i] == t else run
                accepted.append(run)
            per_position.append(accepted)
            tokens.append(r.output[p])
        drafter.release(seq_id)
        out.append(per_position)
    return out


def fastest(length: int, options: Callable[[int], list[tuple[int, float, str]]]) -> tuple[float, dict[str, int]]:
    """Seconds of the fastest rounds from position 1 to `length` (output tokens), each position's options being
    (tokens committed, seconds, kind); and the rounds of each kind on that path."""
    best = [0.0] * (length + 1)
    choice: list[tuple[int, str]] = [(0, "")] * (length + 1)
    for p in range(length - 1, 0, -1):
        best[p], choice[p] = min((seconds + best[min(p + step, length)], (step, kind))
                                 for step, seconds, kind in options(p))
    kinds: dict[str, int] = {}
    p = 1
    while p < length:
        step, kind = choice[p]
        kinds[kind] = kinds.get(kind, 0) + 1
        p += step
    return best[1], kinds


def ceiling(requests: Sequence[suffix_replay.Replayed], ranks: Sequence[Sequence[int]],
            suffix: Sequence[list[list[int]]], group: str, verify: Callable[[int], float],
            tree_verify: Callable[[int], float], draft: Callable[[int], float], overhead: float,
            plain_step: float, rank_trees: Sequence[trees.RankTree]) -> dict[str, Any]:
    tree_costs = [(t, trees.round_cost(t, tree_verify, draft, overhead)) for t in rank_trees]

    def options(r: int, with_trees: bool) -> Callable[[int], list[tuple[int, float, str]]]:
        left_ranks, offers = ranks[r], suffix[r]

        def at(p: int) -> list[tuple[int, float, str]]:
            left = len(left_ranks) - (p - 1)  # output tokens still to come
            out = [(1, verify(1) + overhead, "plain")]
            run = 0
            while run < MAX_K and run < left and left_ranks[p - 1 + run] == 1:
                run += 1
            for k in range(1, MAX_K + 1):
                out.append((min(min(run, k) + 1, left), k * draft(1) + verify(k + 1) + overhead, "draft_model"))
            for cut, accepted in enumerate(offers[p], start=1):
                out.append((min(accepted + 1, left), verify(cut + 1) + overhead, "suffix"))
            if with_trees:
                for tree, seconds in tree_costs:
                    out.append((min(tree.accepted(left_ranks[p - 1 :]) + 1, left), seconds, "draft_tree"))
            return out

        return at

    scored = [i for i, r in enumerate(requests) if group == "all" or r.group == group]
    tokens = sum(len(requests[i].output) - 1 for i in scored)
    out: dict[str, Any] = {"group": group, "requests": len(scored), "decode_tokens": tokens}
    for name, with_trees in (("hybrid_options", False), ("with_draft_trees", True)):
        seconds, kinds = 0.0, {}
        for i in scored:
            s, k = fastest(len(requests[i].output), options(i, with_trees))
            seconds += s
            for kind, n in k.items():
                kinds[kind] = kinds.get(kind, 0) + n
        out[name] = {"decode_speedup": (tokens / seconds) / (1.0 / plain_step), "rounds": kinds,
                     "tokens_per_round": tokens / sum(kinds.values())}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reports", type=Path, default=ROOT / "docs/bench")
    parser.add_argument("--tree-report", type=Path, required=True, help="a draft_tree_gain.py --json report")
    parser.add_argument("--costs-from", type=Path, required=True, help="a tree_verify_gain.py --json report")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from specdec_core.models.loader import load_tokenizer

    tree_report = json.loads(args.tree_report.read_text())
    target_costs = json.loads(args.costs_from.read_text())["costs"]
    verify = suffix_replay.cost_curve(target_costs, "chain_engine")
    tree_verify = suffix_replay.cost_curve(target_costs, "tree_torch")
    draft = trees.curve(tree_report["draft_costs"]["median_seconds"])
    tokenizer = load_tokenizer(suffix_replay.TARGET).tokenizer
    result: dict[str, Any] = {"tree_report": args.tree_report.name, "target_costs": args.costs_from.name,
                              "workloads": {}}
    for name, (file, rebuild, group) in trees.WORKLOADS.items():
        report = json.loads((args.reports / file).read_text())
        requests = rebuild(report, tokenizer)
        rows = tree_report["ranks"][name]
        if [(r.item, r.turn) for r in requests] != [(x["item"], x["turn"]) for x in rows]:
            raise SystemExit(f"{name}: the tree report's ranks are of other requests")
        ranks = [x["ranks"] for x in rows]
        off = report["results"]["off"][group]
        plain_step = off["decode_seconds"] / off["rounds"]
        overhead = max(0.0, plain_step - verify(1))
        rank_trees = [trees.best_tree(trees.path_counts(ranks), n) for n in trees.TREE_SIZES]
        w = ceiling(requests, ranks, suffix_accepted(requests), group, verify, tree_verify, draft, overhead,
                    plain_step, rank_trees)
        w["engine_hybrid_decode_speedup"] = report["results"]["hybrid"][group]["decode_speedup"]
        result["workloads"][name] = w
        print(f"{name} ({group}): oracle over hybrid's options {w['hybrid_options']['decode_speedup']:.2f}x plain "
              f"({w['hybrid_options']['tokens_per_round']:.2f} tok/round, rounds {w['hybrid_options']['rounds']}); "
              f"with draft trees {w['with_draft_trees']['decode_speedup']:.2f}x; "
              f"hybrid measured {w['engine_hybrid_decode_speedup']:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
