"""Would verifying a tree of the draft model's proposals, instead of its chain, speed up greedy decoding here?

SpecInfer (Miao et al. 2024), Medusa, EAGLE-2 and Sequoia (Chen et al. 2024) verify a token tree: several of the
draft's top candidates per position, in one target forward under a tree attention mask. At temperature 0 a tree is
accepted along the path that equals the target's greedy continuation, and every node on that path is conditioned on
the target's own tokens, so what any tree accepts follows from one teacher-forced draft pass over the target's
output: at each output position, the rank of the target's token in the draft's distribution. A tree is a set of
rank paths closed under prefixes ((1,) is the draft's top token, (1, 2) its second choice after that, ...); a round
starting at position p accepts the longest prefix of (rank[p], rank[p + 1], ...) in the tree, then one more token.
The chain of k is the tree (1,), (1, 1), ..., (1,) * k.

1. ranks: the demo draft (int8, as the demo config runs it) teacher-forced over the prompt and the target's greedy
   output of every request of `specdec bench methods` reports (the `off` rows; every method's output equals them).
2. trees: Sequoia's rule, the N rank paths most frequent in the data (prefix-closed, as a prefix is at least as
   frequent as its extensions), from requests of the other half of the workload (two-fold, split by request or
   session), so no tree is fitted to the requests it is scored on; in-sample trees too, the most any tree finds.
3. cost of a round: the draft's forwards, one per tree level over that level's nodes that have children (a chain of
   k: k forwards of one token), the target's verify of the root and N nodes, and a per-round overhead (plain
   decoding's seconds per round in the report minus a 1-token verify). Verify costs are timed on the target as in
   `tree_verify_gain.py` (chain on the engine's path, and torch attention under a tree mask); draft forwards on
   the engine's path with w tokens (no tree mask: a lower bound, so the estimate favours trees).
4. verdict: per workload, the best chain (k = 1..12) and the best tree (N = 2..48), decode tokens/s over plain
   decoding's under the same costs, and the tree's over the chain's.

    PYTHONPATH=.:proto python scripts/draft_tree_gain.py --costs-from docs/bench/tree_verify_gain.json \
        --json docs/bench/draft_tree_gain.json

Not modelled (each favours the tree): compacting the accepted path's KV entries after a tree verify, the top-b
selection per node, and the tree mask's cost in the draft.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import tree_verify_gain as chain_costs  # noqa: E402  (the target's verify costs, the rebuilt requests)

DRAFT = "qwen2.5-coder-0.5b-instruct"
MAX_RANK = 8  # ranks above this never enter a tree
MAX_DEPTH = 12
CHAIN_KS = range(1, MAX_DEPTH + 1)
TREE_SIZES = (2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 47)  # the verify timed up to 48 = root + 47
WORKLOADS = {  # report stem -> (default report, how its requests were built, headline group)
    "sessions": ("methods_sessions.json", chain_costs.sessions_requests, "turns_2_plus"),
    "edit": ("methods_edit.json", chain_costs.prompts_requests, "all"),
    "code": ("methods_code.json", chain_costs.prompts_requests, "all"),
}


# -- trees over rank paths -----------------------------------------------------------------------------------------


Path_ = tuple[int, ...]


@dataclass(frozen=True)
class RankTree:
    """Rank paths below the root, closed under prefixes."""

    paths: frozenset[Path_]

    @staticmethod
    def chain(k: int) -> "RankTree":
        return RankTree(frozenset((1,) * d for d in range(1, k + 1)))

    def __len__(self) -> int:
        return len(self.paths)

    def level_widths(self) -> list[int]:
        """Tokens the draft forwards per level: the root, then each node that has a child in the tree."""
        parents = {p[:-1] for p in self.paths}
        depth = max((len(p) for p in parents), default=-1)
        return [sum(1 for p in parents if len(p) == d) for d in range(depth + 1)]

    def accepted(self, ranks: Sequence[int]) -> int:
        """The longest prefix of `ranks` that is a path of the tree."""
        n = 0
        while n < len(ranks) and tuple(ranks[: n + 1]) in self.paths:
            n += 1
        return n


def path_counts(rank_lists: Iterable[Sequence[int]]) -> Counter[Path_]:
    """How often each rank path starts a continuation, over every position of every request."""
    counts: Counter[Path_] = Counter()
    for ranks in rank_lists:
        for p in range(len(ranks)):
            path: Path_ = ()
            for r in ranks[p : p + MAX_DEPTH]:
                if r > MAX_RANK:
                    break
                path += (r,)
                counts[path] += 1
    return counts


def best_tree(counts: Counter[Path_], size: int) -> RankTree:
    """Sequoia's rule: the `size` most frequent paths; ties to the shorter, then to lower ranks, so that a path's
    prefixes always come first."""
    ranked = sorted(counts, key=lambda p: (-counts[p], len(p), p))
    return RankTree(frozenset(ranked[:size]))


# -- rounds --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replay:
    rounds: int
    tokens: int
    seconds: float

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds


def replay(tree: RankTree, rank_lists: Sequence[Sequence[int]], round_seconds: float) -> Replay:
    """Every request decoded with `tree` each round: output token 0 comes from prefill; rank_lists[i][j] is the
    draft's rank of output token j + 1."""
    rounds = tokens = 0
    for ranks in rank_lists:
        p = 0
        while p < len(ranks):
            step = min(tree.accepted(ranks[p:]) + 1, len(ranks) - p)
            rounds += 1
            tokens += step
            p += step
    return Replay(rounds, tokens, rounds * round_seconds)


def round_cost(tree: RankTree, verify: Callable[[int], float], draft: Callable[[int], float],
               overhead: float) -> float:
    return sum(draft(w) for w in tree.level_widths()) + verify(len(tree) + 1) + overhead


# -- the draft's ranks of the target's tokens ----------------------------------------------------------------------


def draft_ranks(requests: Sequence[chain_costs.Replayed], draft: Any) -> list[list[int]]:
    """Per request, the draft's rank (1 = its top token) of output tokens 1.. given the prompt and the output
    before them, from one teacher-forced forward; ranks above MAX_RANK are MAX_RANK + 1."""
    import torch

    from specdec_core.kv_cache import KVCache

    out = []
    for r in requests:
        sequence = torch.tensor([r.prompt + r.output[:-1]])  # [1, L]
        length = sequence.shape[1]
        layer = draft.layers[0].self_attn
        cache = KVCache(draft.args.num_layers, 1, layer.num_kv_heads, length, draft.args.head_dim,
                        draft.embed_tokens.weight.dtype)
        first = len(r.prompt)  # the logits there predict output token 1
        index = torch.arange(first, length).view(1, -1)  # [1, n]
        with torch.inference_mode():
            logits = draft(sequence, torch.arange(length).view(1, -1), cache, torch.tensor([0]), length, (0, 0),
                           index)[0]  # [n, V]
        chosen = logits.gather(1, torch.tensor(r.output[1:]).view(-1, 1))  # [n, 1]
        ranks = (logits > chosen).sum(1) + 1  # [n]
        out.append(ranks.clamp(max=MAX_RANK + 1).tolist())
    return out


def measure_draft_costs(context: int, widths: Sequence[int], repeats: int, threads: int,
                        quantization: str) -> dict[str, Any]:
    """Median seconds of a draft forward of w tokens after `context` tokens, on the engine's path."""
    import torch

    from specdec_core.build import prepare_model
    from specdec_core.kv_cache import KVCache

    torch.set_num_threads(threads)
    model = prepare_model(DRAFT, dtype="bfloat16", device="cpu", quantization=quantization).model.eval()
    layer = model.layers[0].self_attn
    cache = KVCache(model.args.num_layers, 1, layer.num_kv_heads, context + max(widths) + 8, model.args.head_dim,
                    torch.bfloat16)
    ids = torch.randint(1000, 30000, (1, context + max(widths)), generator=torch.Generator().manual_seed(0))

    def forward(w: int) -> Any:
        positions = (context + torch.arange(w)).view(1, w)
        return model(ids[:, context : context + w], positions, cache, torch.tensor([0]), context + w, (0, context))

    times: dict[int, list[float]] = {w: [] for w in widths}
    with torch.inference_mode():
        model(ids[:, :context], torch.arange(context).view(1, -1), cache, torch.tensor([0]), context, (0, 0),
              torch.tensor([[context - 1]]))
        for w in (1, max(widths)):
            forward(w)
        for _ in range(repeats):
            for w in widths:
                t0 = time.perf_counter()
                forward(w)
                times[w].append(time.perf_counter() - t0)
    return {"draft": DRAFT, "quantization": quantization, "threads": threads, "context": context,
            "repeats": repeats, "median_seconds": {str(w): statistics.median(v) for w, v in times.items()}}


def curve(median_seconds: dict[str, float]) -> Callable[[int], float]:
    return chain_costs.cost_curve({"median_seconds": {"x": median_seconds}}, "x")


# -- the verdict ---------------------------------------------------------------------------------------------------


def halves(requests: Sequence[chain_costs.Replayed]) -> list[int]:
    """Each request's fold, 0 or 1: by session (turns of a session together), alternating."""
    items = sorted({r.item for r in requests})
    fold = {item: i % 2 for i, item in enumerate(items)}
    return [fold[r.item] for r in requests]


def evaluate(requests: Sequence[chain_costs.Replayed], ranks: Sequence[list[int]], group: str,
             verify: Callable[[int], float], draft: Callable[[int], float], overhead: float,
             plain_step: float) -> dict[str, Any]:
    """Chains of every k and trees of every size, scored on the headline group's requests."""
    folds = halves(requests)
    scored = [i for i, r in enumerate(requests) if group == "all" or r.group == group]
    plain_tokens = sum(len(ranks[i]) for i in scored)
    plain_seconds = plain_tokens * plain_step

    def score(trees_for: Callable[[int], RankTree]) -> dict[str, Any]:
        """Each scored request decoded with the tree its fold gets."""
        total = Replay(0, 0, 0.0)
        sizes = []
        for i in scored:
            tree = trees_for(folds[i])
            r = replay(tree, [ranks[i]], round_cost(tree, verify, draft, overhead))
            total = Replay(total.rounds + r.rounds, total.tokens + r.tokens, total.seconds + r.seconds)
            sizes.append(len(tree))
        return {"tokens_per_round": total.tokens_per_round, "rounds": total.rounds,
                "seconds_per_round": total.seconds / total.rounds,
                "decode_speedup": (total.tokens / total.seconds) / (plain_tokens / plain_seconds)}

    counts = {f: path_counts(ranks[i] for i in range(len(requests)) if folds[i] != f) for f in (0, 1)}
    everything = path_counts(ranks)
    chains = {k: score(lambda f, k=k: RankTree.chain(k)) for k in CHAIN_KS}
    held_out = {n: score(lambda f, n=n: best_tree(counts[f], n)) for n in TREE_SIZES}
    in_sample = {n: score(lambda f, n=n: best_tree(everything, n)) for n in TREE_SIZES}
    best_chain = max(chains, key=lambda k: chains[k]["decode_speedup"])
    best_held = max(held_out, key=lambda n: held_out[n]["decode_speedup"])
    best_in = max(in_sample, key=lambda n: in_sample[n]["decode_speedup"])
    top = best_tree(everything, 16)
    return {
        "group": group,
        "requests": len(scored),
        "decode_tokens": plain_tokens,
        "top1_rate": sum(r == 1 for i in scored for r in ranks[i]) / plain_tokens,
        "top2_rate": sum(r <= 2 for i in scored for r in ranks[i]) / plain_tokens,
        "chains": {str(k): v for k, v in chains.items()},
        "trees_held_out": {str(n): v for n, v in held_out.items()},
        "trees_in_sample": {str(n): v for n, v in in_sample.items()},
        "best_chain_k": best_chain,
        "best_tree_held_out_size": best_held,
        "best_tree_in_sample_size": best_in,
        "tree_over_chain_held_out": held_out[best_held]["decode_speedup"] / chains[best_chain]["decode_speedup"],
        "tree_over_chain_in_sample": in_sample[best_in]["decode_speedup"] / chains[best_chain]["decode_speedup"],
        "tree_16_in_sample": sorted(top.paths, key=lambda p: (len(p), p)),
    }


def format_table(result: dict[str, Any]) -> str:
    lines = []
    for name, w in result["workloads"].items():
        c, h, i = w["best_chain_k"], w["best_tree_held_out_size"], w["best_tree_in_sample_size"]
        chain, held, ins = w["chains"][str(c)], w["trees_held_out"][str(h)], w["trees_in_sample"][str(i)]
        lines.append(f"{name} ({w['group']}, {w['requests']} requests, top-1 {w['top1_rate']:.2f}, "
                     f"top-2 {w['top2_rate']:.2f}):")
        for label, v in ((f"chain k={c}", chain), (f"tree N={h} (held out)", held), (f"tree N={i} (in sample)", ins)):
            lines.append(f"  {label:<24} {v['tokens_per_round']:.2f} tok/round  {v['seconds_per_round'] * 1e3:.0f} "
                         f"ms/round  {v['decode_speedup']:.2f}x plain")
        lines.append(f"  tree / chain: {w['tree_over_chain_held_out']:.3f} held out, "
                     f"{w['tree_over_chain_in_sample']:.3f} in sample")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reports", type=Path, default=ROOT / "docs/bench", help="folder of the methods reports")
    parser.add_argument("--costs-from", type=Path, required=True,
                        help="the target's verify costs: a tree_verify_gain.py --json report")
    parser.add_argument("--quantization", default="int8", help="the draft's, as the demo config runs it")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from specdec_core.build import prepare_model
    from specdec_core.models.loader import load_tokenizer

    target_costs = json.loads(args.costs_from.read_text())["costs"]
    verify = {"lower_cost": chain_costs.cost_curve(target_costs, "chain_engine"),
              "torch_mask": chain_costs.cost_curve(target_costs, "tree_torch")}
    chain_costs.QUIET.touch()
    try:
        draft_costs = measure_draft_costs(target_costs["context"], range(1, 33), args.repeats, args.threads,
                                          args.quantization)
    finally:
        chain_costs.QUIET.unlink(missing_ok=True)
    draft_cost = curve(draft_costs["median_seconds"])
    tokenizer = load_tokenizer(chain_costs.TARGET).tokenizer
    draft = prepare_model(DRAFT, dtype="bfloat16", device="cpu", quantization=args.quantization).model.eval()
    result: dict[str, Any] = {"settings": {"draft": DRAFT, "quantization": args.quantization, "max_rank": MAX_RANK,
                                           "max_depth": MAX_DEPTH, "temperature": 0.0},
                              "target_costs": args.costs_from.name, "draft_costs": draft_costs, "workloads": {},
                              "ranks": {}}
    for name, (file, rebuild, group) in WORKLOADS.items():
        report = json.loads((args.reports / file).read_text())
        requests = rebuild(report, tokenizer)
        ranks = draft_ranks(requests, draft)
        result["ranks"][name] = [{"item": r.item, "turn": r.turn, "group": r.group, "ranks": x}
                                 for r, x in zip(requests, ranks)]
        off = report["results"]["off"][group]
        plain_step = off["decode_seconds"] / off["rounds"]
        overhead = max(0.0, plain_step - verify["lower_cost"](1))
        for cost, curve_ in verify.items():
            w = evaluate(requests, ranks, group, curve_, draft_cost, overhead, plain_step)
            w["engine_draft_model"] = {k: report["results"]["draft_model"][group][k]
                                       for k in ("tokens_per_round", "acceptance_rate", "decode_speedup")}
            result["workloads"][f"{name} ({cost})"] = w
    print(format_table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1, default=list) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
