"""Would verifying a tree of suffix proposals, instead of today's chain, speed up greedy decoding on this CPU?

SuffixDecoding (Oliaro et al., arXiv 2411.04975) proposes a tree: several continuations of the matched suffix,
verified in one forward under a tree attention mask (SpecInfer, Miao et al. 2024), each draft token attending to
the context and its ancestors only. At temperature 0 acceptance is deterministic: a branch is accepted as far as
it equals the target's greedy continuation, so what a tree would accept is exact offline, from the greedy outputs
a benchmark recorded. This script weighs that gain against the cost of the verify:

1. gain: replay `specdec bench methods` reports (sessions and prompts; every method's output is plain decoding's,
   so the `off` rows are the target's greedy continuations) through `SuffixDrafter` as the benchmark drove it
   (its per-request trie over prompt + output, its global trie over ended requests, salted as the benchmark
   salted them, requests in the benchmark's order). Each scheme runs at its own positions: a round commits its
   accepted tokens plus one, and the next starts there. Schemes: the chain the drafter proposes today (k = 16,
   the benchmark's largest; not the engine's per-label trimming), and trees of the top-b continuations per
   node grown best-first by path probability (the product of count ratios) to at most N nodes, under the
   drafter's depth rule and `min_prob` (then b = 1 is the chain), or free of both (`_free`: only k and N bound
   them, the most a tree of that budget finds).
2. cost: the target's verify forward of n tokens (the root, the last committed token, and n - 1 drafts) after a
   context, B = 1, timed three ways: the engine's path (C attention kernel: causal from positions, it takes no
   mask), torch attention with the causal mask, and torch attention with a tree mask (same GEMMs, only the mask
   differs). Median of the repeats.
3. verdict: each tree's decode tokens/s over the chain's = (tokens / sum over its rounds of cost(size + 1)) over
   the chain's, with the tree costed (a) as a chain of its size on the engine's path, a lower bound (no tree
   costs less than a chain of as many tokens: same GEMMs), and (b) at the torch tree-mask path's cost; with and
   without a per-round overhead (plain decoding's time per round in the report minus the measured 1-token
   verify: drafting, sampling and bookkeeping).

    PYTHONPATH=.:proto python scripts/tree_verify_gain.py --json docs/bench/tree_verify_gain.json

Each rebuilt prompt's length is checked against the report's `prompt_tokens`; a mismatch stops the run.
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from specdec_core.config import TokenShaping  # noqa: E402
from specdec_core.drafters.base import DraftRequest  # noqa: E402
from specdec_core.drafters.suffix import SuffixDrafter, SuffixTrie, _Node  # noqa: E402

TARGET = "qwen2.5-coder-1.5b-instruct"
MAX_K = 16  # `specdec bench methods`' largest k; the drafter's match rule caps a chain at max_depth // 2 = 16 too
QUIET = Path("/tmp/specdec_quiet")  # while it exists, other workers pause their CPU-heavy work
HEADLINES = {"sessions": "turns_2_plus", "prompts": "all"}


# -- trees and their acceptance ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tree:
    """Draft tokens below the root (the last committed token). Node i holds tokens[i]; its parent is node
    parents[i], or the root when -1. Parents come before children."""

    parents: tuple[int, ...]
    tokens: tuple[int, ...]

    @staticmethod
    def chain(tokens: Sequence[int]) -> "Tree":
        return Tree(tuple(range(-1, len(tokens) - 1)), tuple(tokens))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def branches(self) -> bool:
        """Some node (or the root) has two children: the verify needs a tree mask, not the causal one."""
        return len(set(self.parents)) < len(self.parents)

    def depths(self) -> list[int]:
        """Each node's depth, 1 right below the root."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out


def accepted_length(tree: Tree, target: Sequence[int]) -> int:
    """Greedy acceptance: the depth of the deepest node whose root-to-node path equals target[:depth], `target`
    being the target's own continuation after the root."""
    matched: list[bool] = []  # node i's path equals target[:depth(i)]
    best = 0
    for p, t, depth in zip(tree.parents, tree.tokens, tree.depths()):
        ok = (p < 0 or matched[p]) and depth <= len(target) and target[depth - 1] == t
        matched.append(ok)
        if ok:
            best = max(best, depth)
    return best


# -- proposals -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeShape:
    branch: int  # b: continuations offered per node
    budget: int  # N: nodes at most
    drafter_rules: bool = True  # the chain's depth rule and min_prob bound the tree too (`grow_tree`)

    @property
    def name(self) -> str:
        return f"b{self.branch}_n{self.budget}" + ("" if self.drafter_rules else "_free")


BN = ((2, 8), (2, 16), (3, 16), (4, 24), (4, 32))
# b1_n16_free is a chain freed of the drafter's rules: the free trees' gain over it is branching's alone.
SHAPES = (*(TreeShape(b, n) for b, n in BN), *(TreeShape(b, n, drafter_rules=False) for b, n in ((1, 16), *BN)))


def propose(drafter: SuffixDrafter, request: DraftRequest,
            shapes: Sequence[TreeShape]) -> tuple[list[int], dict[TreeShape, Tree]]:
    """The drafter's chain for `request` (its `_lookup`, which also grows the per-request trie), and a tree per
    shape, grown from the match the chain continues."""
    chain, _ = drafter._lookup(request)
    match = best_match(drafter, request)
    trees = {s: Tree((), ()) if match is None else grow_tree(drafter, *match, request.num_tokens, s) for s in shapes}
    return chain, trees


def best_match(drafter: SuffixDrafter, request: DraftRequest) -> tuple[SuffixTrie, _Node, int] | None:
    """The (trie, node, match length) that `SuffixDrafter._lookup` continues: the longest match over the
    request's trie and its salt's global one, ties to the higher score. Call after `_lookup`."""
    state = drafter._requests[request.seq_id]
    tries = [state.trie]
    if (shared := drafter.global_.tries.get(state.cache_salt)) is not None:
        tries.append(shared)
    best, found = (0, 0.0), None
    for trie in tries:
        m, node = trie.longest_match(request.token_ids, drafter.max_depth // 2)
        if m < drafter.min_match or node is None:
            continue
        _, score = drafter._follow(trie, node, m, min(request.num_tokens, m))
        if (m, score) > best:
            best, found = (m, score), (trie, node, m)
    return found


def grow_tree(drafter: SuffixDrafter, trie: SuffixTrie, node: _Node, match: int, num_tokens: int,
              shape: TreeShape) -> Tree:
    """Best-first: the open node of highest path probability joins the tree and offers its `shape.branch` most
    frequent continuations, until `shape.budget` nodes or no open node is likely enough. Under the drafter's
    rules depth is capped as the chain's length is, at min(k, match length), and a node needs a path probability
    >= `min_prob`: with branch 1 this is the drafter's chain. Without them only k and the budget bound it."""
    max_depth = min(num_tokens, match) if shape.drafter_rules else num_tokens
    min_prob = drafter.min_prob if shape.drafter_rules else 0.0
    parents: list[int] = []
    tokens: list[int] = []
    order = 0  # ties go to the earlier offered: with branch 1 that is the chain's `max` choice
    heap: list[tuple[float, int, int, int, _Node, int]] = []  # (-prob, order, parent, token, trie node, depth)

    def offer(parent: int, at: _Node, depth: int, prob: float) -> None:
        nonlocal order
        if depth >= max_depth:
            return
        children = trie.continuations(at, match + depth)
        total = sum(c.count for c in children.values())
        ranked = sorted(children.items(), key=lambda item: -item[1].count)[: shape.branch]  # stable on ties
        for t, child in ranked:
            heapq.heappush(heap, (-prob * child.count / total, order, parent, t, child, depth + 1))
            order += 1

    offer(-1, node, 0, 1.0)
    while heap and len(tokens) < shape.budget:
        neg_prob, _, parent, t, child, depth = heapq.heappop(heap)
        if -neg_prob < min_prob:
            break
        parents.append(parent)
        tokens.append(t)
        offer(len(tokens) - 1, child, depth, -neg_prob)
    return Tree(tuple(parents), tuple(tokens))


# -- the recorded benchmark ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replayed:
    item: str
    turn: int
    group: str
    prompt: list[int]
    output: list[int]  # the target's greedy output
    salt: str  # as the benchmark salted the suffix engine's requests


def _off_rows(report: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["item"], r["turn"]): r for r in report["requests"] if r["method"] == "off"}


def sessions_requests(report: dict[str, Any], tokenizer: Any) -> list[Replayed]:
    """Each turn as `SessionsWorkload.replay` encoded it: the history with the earlier answers' text."""
    from specdec_core.chat import ChatMessage, encode_chat
    from specdec_tools.requests import read_sessions

    rows, out = _off_rows(report), []
    for session in read_sessions(ROOT / report["workload_file"]):
        history = [ChatMessage("system", session.system)]
        for turn, text in enumerate(session.turns, start=1):
            row = rows[(session.id, turn)]
            history.append(ChatMessage("user", text))
            out.append(Replayed(session.id, turn, row["group"], encode_chat(tokenizer, history), row["token_ids"],
                                f"methods-suffix-session-{session.id}"))
            history.append(ChatMessage("assistant", row["text"]))
    return _checked(out, rows)


def prompts_requests(report: dict[str, Any], tokenizer: Any) -> list[Replayed]:
    """Each prompt as `PromptsWorkload` encoded it; one salt for all (the suffix engine's)."""
    from specdec_core.chat import encode_prompt
    from specdec_tools.requests import read_prompt_texts

    rows = _off_rows(report)
    out = []
    for i, text in enumerate(read_prompt_texts(ROOT / report["workload_file"])):
        row = rows[(f"prompt-{i}", 1)]
        out.append(Replayed(row["item"], 1, row["group"], encode_prompt(tokenizer, text), row["token_ids"],
                            "methods-suffix"))
    return _checked(out, rows)


def _checked(requests: list[Replayed], rows: dict[tuple[str, int], dict[str, Any]]) -> list[Replayed]:
    if len(requests) != len(rows):
        raise SystemExit(f"rebuilt {len(requests)} requests, the report holds {len(rows)}")
    for r in requests:
        if len(r.prompt) != rows[(r.item, r.turn)]["prompt_tokens"]:
            raise SystemExit(f"{r.item} turn {r.turn}: rebuilt a prompt of {len(r.prompt)} tokens, the report's "
                             f"has {rows[(r.item, r.turn)]['prompt_tokens']}")
    return requests


# -- the replay ----------------------------------------------------------------------------------------------------


@dataclass
class Rounds:
    """One scheme over one group of requests: per round, the draft's size, whether it branches, and the tokens
    committed."""

    sizes: list[int] = field(default_factory=list)
    branched: list[bool] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)

    @property
    def tokens_per_round(self) -> float:
        return sum(self.committed) / len(self.committed) if self.committed else 0.0

    def seconds(self, chain_cost: Callable[[int], float], tree_cost: Callable[[int], float],
                overhead: float) -> float:
        """Decode time: per round, a verify of the root and the draft (at `tree_cost` where it branches, else at
        `chain_cost`: an engine would verify a chain-shaped draft on its causal path), and the overhead."""
        return sum((tree_cost if b else chain_cost)(size + 1) + overhead for size, b in zip(self.sizes, self.branched))


def replay(requests: Sequence[Replayed], shape: TreeShape | None, drafter: SuffixDrafter) -> dict[str, Rounds]:
    """{group: Rounds} of one scheme (shape None: the chain), requests one at a time in the given order. A
    request's rounds start after its first token (prefill's), each where the previous left off; the drafter sees
    what they commit. Mutates `drafter`."""
    shapes = [] if shape is None else [shape]
    out: dict[str, Rounds] = {}
    for number, r in enumerate(requests):
        rounds = out.setdefault(r.group, Rounds())
        seq_id = f"r{number}"
        tokens = list(r.prompt) + r.output[:1]  # the engine's live list: the drafter reads it, never copies it
        drafter.start(seq_id, tokens, r.salt)
        p = 1
        while p < len(r.output):
            chain, trees = propose(drafter, DraftRequest(seq_id, tokens, MAX_K, TokenShaping(), None), shapes)
            tree = Tree.chain(chain) if shape is None else trees[shape]
            step = min(accepted_length(tree, r.output[p:]) + 1, len(r.output) - p)
            rounds.sizes.append(len(tree))
            rounds.branched.append(tree.branches)
            rounds.committed.append(step)
            tokens.extend(r.output[p : p + step])
            p += step
        drafter.release(seq_id)
    return out


def simulate(requests: Sequence[Replayed], shapes: Sequence[TreeShape]) -> dict[str, dict[str, Rounds]]:
    """{scheme: {group: Rounds}}: "chain", and one per shape (by name); each with a fresh drafter of the
    service's defaults, as each method's engine had its own."""
    out = {"chain": replay(requests, None, SuffixDrafter())}
    for shape in shapes:
        out[shape.name] = replay(requests, shape, SuffixDrafter())
    return out


# -- the cost of a verify ------------------------------------------------------------------------------------------


class TreeMaskAttention:
    """Torch attention (`TorchAttention`) under a given mask instead of the causal one the model builds from
    positions (tree tokens share positions, by depth). The cache is written at consecutive slots: pass
    `single` = (slot, context length) to the forward."""

    needs_tables = True

    def __init__(self, mask: Any) -> None:
        from specdec_core.models.transformer import TorchAttention

        self.mask = mask  # [1, 1, T, S]
        self._attention = TorchAttention()

    def __call__(self, q, k, v, ctx, layer: int):  # q [B, T, H, hd] -> [B, T, H, hd]
        return self._attention(q, k, v, replace(ctx, mask=self.mask), layer)


def verify_tree(n: int) -> Tree:
    """A balanced binary tree of n - 1 drafts (the verify's input is its root and them): the mask's shape is
    what costs, not the tree's."""
    return Tree(tuple((i - 1) // 2 - 1 for i in range(1, n)), tuple(range(1, n)))  # input i: parent (i - 1) // 2


def tree_mask(tree: Tree, context: int):
    """[1, 1, T, S]: the T = len(tree) + 1 new tokens see the whole context, themselves and their ancestors."""
    import torch

    T = len(tree) + 1
    mask = torch.zeros(T, context + T, dtype=torch.bool)
    mask[:, :context] = True
    mask[0, context] = True
    for i, p in enumerate(tree.parents, start=1):
        mask[i] = mask[p + 1] if p >= 0 else mask[0]
        mask[i, context + i] = True
    return mask.view(1, 1, T, context + T)


def measure_costs(context: int, ns: Sequence[int], repeats: int, threads: int) -> dict[str, Any]:
    """Median seconds of a verify forward of n tokens after `context` tokens, per path; and a check that the tree
    mask computes what a chain does along one branch."""
    import torch

    from specdec_core.build import prepare_model
    from specdec_core.kernels.cpu import kernel_path
    from specdec_core.kv_cache import KVCache
    from specdec_core.models.transformer import TorchAttention

    torch.set_num_threads(threads)
    model = prepare_model(TARGET, dtype="bfloat16", device="cpu").model.eval()
    engine_attention = model.attention
    layer = model.layers[0].self_attn
    cache = KVCache(model.args.num_layers, 1, layer.num_kv_heads, context + max(ns) + 8, model.args.head_dim,
                    torch.bfloat16)
    ids = torch.randint(1000, 30000, (1, context + max(ns)), generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([0])

    def forward(attention: Any, n: int, depths: Sequence[int] | None = None) -> torch.Tensor:
        model.attention = attention
        offsets = torch.arange(n) if depths is None else torch.tensor([0, *depths])
        positions = (context + offsets).view(1, n)  # [1, n]
        return model(ids[:, context : context + n], positions, cache, slots, context + n, (0, context))  # [1, n, V]

    with torch.inference_mode():
        model.attention = engine_attention
        model(ids[:, :context], torch.arange(context).view(1, -1), cache, slots, context, (0, 0),
              torch.tensor([[context - 1]]))
        paths: dict[str, Callable[[int], Any]] = {
            "chain_engine": lambda n: forward(engine_attention, n),
            "chain_torch": lambda n: forward(TorchAttention(), n),
            "tree_torch": lambda n: forward(TreeMaskAttention(tree_mask(verify_tree(n), context)), n,
                                            verify_tree(n).depths()),
        }
        check = _check_tree_mask(forward, ids, context, paths)
        for n in (1, max(ns)):  # warm-up: first-touch costs out of the figures
            for run in paths.values():
                run(n)
        times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in ns} for name in paths}
        start = time.perf_counter()
        for _ in range(repeats):  # interleaved: drift in the machine's speed falls on every path alike
            for n in ns:
                for name, run in paths.items():
                    t0 = time.perf_counter()
                    run(n)
                    times[name][n].append(time.perf_counter() - t0)
        seconds = time.perf_counter() - start
    return {"target": TARGET, "dtype": "bfloat16", "threads": threads, "context": context, "repeats": repeats,
            "kernel_path": kernel_path(model), "timing_seconds": seconds, "tree_mask_check": check,
            "median_seconds": {name: {str(n): statistics.median(v) for n, v in per.items()}
                               for name, per in times.items()}}


def _check_tree_mask(forward: Callable, ids: Any, context: int, paths: dict[str, Callable]) -> dict[str, Any]:
    """The tree path's logits along its deepest branch against a causal forward of that branch alone."""
    import torch

    from specdec_core.models.transformer import TorchAttention

    n = 16
    tree = verify_tree(n)
    tree_logits = paths["tree_torch"](n)[0]  # [n, V]
    branch, i = [], n - 2  # node indices, deepest last
    while i >= 0:
        branch.insert(0, i)
        i = tree.parents[i]
    rows = [0, *(b + 1 for b in branch)]  # in the verify's input
    saved = ids[:, context : context + n].clone()
    ids[:, context : context + len(rows)] = saved[:, rows]
    chain_logits = forward(TorchAttention(), len(rows))[0]  # [len(rows), V]
    ids[:, context : context + n] = saved
    diff = (tree_logits[rows] - chain_logits).abs().max().item()
    same = bool((tree_logits[rows].argmax(-1) == chain_logits.argmax(-1)).all())
    return {"n": n, "branch_tokens": len(rows), "max_abs_logit_diff": diff, "same_argmax": same}


# -- the verdict ---------------------------------------------------------------------------------------------------


def cost_curve(costs: dict[str, Any], path: str) -> Callable[[int], float]:
    """Seconds of a verify of n tokens on `path`, linear between the measured n."""
    points = sorted((int(n), s) for n, s in costs["median_seconds"][path].items())

    def cost(n: int) -> float:
        for (n0, s0), (n1, s1) in zip(points, points[1:]):
            if n0 <= n <= n1:
                return s0 + (s1 - s0) * (n - n0) / (n1 - n0)
        if n < points[0][0]:
            return points[0][1]
        raise ValueError(f"no cost measured at n >= {n}")

    return cost


def verdict(sim: dict[str, dict[str, Rounds]], group: str, costs: dict[str, Any],
            overhead: float) -> dict[str, Any]:
    """Per scheme: tokens per round, draft sizes, and decode tokens/s over the chain's (see the module)."""
    engine, tree_torch = cost_curve(costs, "chain_engine"), cost_curve(costs, "tree_torch")
    chain = sim["chain"][group]
    base = {o: sum(chain.committed) / chain.seconds(engine, engine, o) for o in (0.0, overhead)}
    out = {}
    for name, groups in sim.items():
        r = groups[group]
        tokens = sum(r.committed)
        out[name] = {
            "rounds": len(r.sizes),
            "decode_tokens": tokens,
            "tokens_per_round": r.tokens_per_round,
            "tokens_per_round_vs_chain": r.tokens_per_round / chain.tokens_per_round,
            "mean_draft_size": sum(r.sizes) / len(r.sizes),
            "max_draft_size": max(r.sizes),
            "branched_rounds": sum(r.branched),
            "verify_seconds_per_round_lower_cost": r.seconds(engine, engine, 0.0) / len(r.sizes),
            "verify_seconds_per_round_torch_mask": r.seconds(engine, tree_torch, 0.0) / len(r.sizes),
            "speed_vs_chain_lower_cost": tokens / r.seconds(engine, engine, 0.0) / base[0.0],
            "speed_vs_chain_lower_cost_with_overhead": tokens / r.seconds(engine, engine, overhead) / base[overhead],
            "speed_vs_chain_torch_mask_with_overhead": tokens / r.seconds(engine, tree_torch, overhead) / base[overhead],
        }
    return out


def round_overhead(report: dict[str, Any], group: str, costs: dict[str, Any]) -> float:
    """Plain decoding's seconds per round in the report minus the measured 1-token verify (>= 0)."""
    off = report["results"]["off"][group]
    return max(0.0, off["decode_seconds"] / off["rounds"] - cost_curve(costs, "chain_engine")(1))


def format_table(result: dict[str, Any]) -> str:
    lines = []
    for workload, w in result["workloads"].items():
        lines.append(f"{workload} ({w['group']}): overhead {w['overhead_seconds'] * 1e3:.1f} ms/round; speed = decode "
                     "tok/s over the chain's, the tree at the cost of a chain as long (lb) or of the torch tree mask")
        lines.append(f"  {'scheme':<14} {'tok/rnd':>7} {'vs chain':>8} {'mean size':>9} {'branched':>8} "
                     f"{'speed lb':>8} {'lb+ovh':>7} {'mask+ovh':>8}")
        for name, v in w["schemes"].items():
            lines.append(f"  {name:<14} {v['tokens_per_round']:>7.3f} {v['tokens_per_round_vs_chain']:>8.3f} "
                         f"{v['mean_draft_size']:>9.2f} {v['branched_rounds'] / v['rounds']:>8.0%} "
                         f"{v['speed_vs_chain_lower_cost']:>8.3f} {v['speed_vs_chain_lower_cost_with_overhead']:>7.3f} "
                         f"{v['speed_vs_chain_torch_mask_with_overhead']:>8.3f}")
    costs = result["costs"]
    c = costs["median_seconds"]
    lines.append(f"verify ms after {costs['context']} tokens (engine chain / torch chain / torch tree): " + ", ".join(
        f"n={n}: {c['chain_engine'][n] * 1e3:.0f}/{c['chain_torch'][n] * 1e3:.0f}/{c['tree_torch'][n] * 1e3:.0f}"
        for n in ("1", "2", "3", "5", "9", "17", "25", "33", "48") if n in c["chain_engine"]))
    lines.append(f"tree mask check: {costs['tree_mask_check']}")
    return "\n".join(lines)


def parse_ns(text: str) -> list[int]:
    """"1-17,20,24": the sizes n to time."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions-report", type=Path, default=ROOT / "docs/bench/methods_sessions.json")
    parser.add_argument("--prompts-report", type=Path, default=ROOT / "docs/bench/methods_edit.json")
    parser.add_argument("--context", type=int, default=600, help="tokens before the verified ones")
    parser.add_argument("--ns", type=parse_ns, default=parse_ns("1-48"), help="verify sizes to time")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--costs-from", type=Path, help="reuse the costs of an earlier --json instead of timing")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from specdec_core.models.loader import load_tokenizer

    tokenizer = load_tokenizer(TARGET).tokenizer
    reports = {"sessions": (args.sessions_report, sessions_requests), "prompts": (args.prompts_report,
                                                                                  prompts_requests)}
    sims, loaded = {}, {}
    for workload, (path, rebuild) in reports.items():
        loaded[workload] = json.loads(path.read_text())
        sims[workload] = simulate(rebuild(loaded[workload], tokenizer), SHAPES)
    if args.costs_from is not None:
        costs = json.loads(args.costs_from.read_text())["costs"]
    else:
        QUIET.touch()
        try:
            costs = measure_costs(args.context, args.ns, args.repeats, args.threads)
        finally:
            QUIET.unlink(missing_ok=True)
    result: dict[str, Any] = {
        "settings": {"drafter": "SuffixDrafter defaults (max_depth 32, min_match 2, min_prob 0.1)", "k": MAX_K,
                     "shapes": [vars(s) | {"name": s.name} for s in SHAPES], "temperature": 0.0},
        "costs": costs,
        "workloads": {},
    }
    for workload, (path, _) in reports.items():
        group = HEADLINES[workload]
        overhead = round_overhead(loaded[workload], group, costs)
        result["workloads"][path.stem] = {
            "report": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
            "group": group,
            "overhead_seconds": overhead,
            "engine_suffix_tokens_per_round": loaded[workload]["results"]["suffix"][group]["tokens_per_round"],
            "schemes": verdict(sims[workload], group, costs, overhead),
        }
    print(format_table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
