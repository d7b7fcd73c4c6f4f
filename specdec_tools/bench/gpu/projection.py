"""Part 5, a projection: the speed the CPU benchmarks' recorded acceptance would give at the costs just measured.

A `specdec bench methods` report (`docs/bench/methods_*.json`) records, per request and per proposer of its rounds
(`by_method`: a drafting method's label, or "none" for a round without drafts), the rounds, the drafts proposed
and accepted, and the tokens committed. Greedy rounds' outcomes follow from the models alone, not from the machine,
so the same rounds are priced here at batch 1 with the costs of a GPU (`Costs`):

- plain:        every token a plain step:       tokens x (v(1) + h_plain)
- speculative:  each round verifies its drafts: rounds x (v(n + 1) + h_round) + drafts x d, the drafts' term only
                for a proposer that runs the draft model (the model-free ones' lookups are in h_round)

where v(w) is a verify of w tokens (interpolated between measured widths, flat beyond them), d a draft step, h the
host overhead measured per round and per plain step through the engine, and n = proposed / rounds, each proposer's
mean (the reports keep sums, not each round: exact where v is linear between its widths). A draft step is priced
per draft proposed, as the CPU's step loop runs them; the chain the engine drafts with on CUDA runs all k steps
even where the confidence threshold keeps fewer drafts, which this leaves out. Pre-drafting (METHOD+overlap) is
priced as sequential rounds: `benchmarks/overlap/replay.py` prices it.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specdec_core.drafters import registry
from specdec_tools.bench.methods_report import OFF

# The methods reports committed beside the code: the default --recorded.
RECORDED_DIR = Path(__file__).resolve().parents[3] / "docs" / "bench"
RECORDED_GLOB = "methods_*.json"


@dataclass(frozen=True)
class Costs:
    """What the engine's steps cost at batch 1, in ms."""

    draft_step_ms: float  # d
    verify_ms: Mapping[int, float]  # v(w), by width w
    round_host_ms: float  # h_round: a speculative round's host overhead
    plain_host_ms: float  # h_plain: a plain step's


@dataclass(frozen=True)
class Recorded:
    """One proposer's rounds in a recorded run."""

    label: str  # a drafting method's name, or "none"
    rounds: int
    proposed: int
    accepted: int
    tokens: int


def verify_at(costs: Costs, width: float) -> float:
    """v(width): the measured one, interpolated linearly between measured widths (flat beyond the ends)."""
    return interpolated(costs.verify_ms, width)


def interpolated(table: Mapping[int, float], x: float) -> float:
    """The table's value at x: linear between its nearest keys on either side, flat beyond its ends."""
    points = sorted(table.items())
    keys = [k for k, _ in points]
    i = bisect.bisect_left(keys, x)
    if i < len(points) and keys[i] == x:
        return points[i][1]
    if i == 0 or i == len(points):
        return points[min(i, len(points) - 1)][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def runs_draft_model(label: str) -> bool:
    method = registry.METHODS.get(label)
    return method is not None and method.runs_draft_model


def price(recorded: Sequence[Recorded], costs: Costs) -> dict[str, float]:
    """Tokens per second of the recorded rounds' tokens, plain and speculative, and the ratio (formulas above)."""
    tokens = sum(r.tokens for r in recorded)
    rounds = [r for r in recorded if r.rounds > 0]
    speculative = sum(
        r.rounds * (verify_at(costs, r.proposed / r.rounds + 1) + costs.round_host_ms)
        + (r.proposed * costs.draft_step_ms if runs_draft_model(r.label) else 0.0)
        for r in rounds
    )
    plain = tokens * (verify_at(costs, 1) + costs.plain_host_ms)
    return {
        "tokens": tokens,
        "rounds": sum(r.rounds for r in rounds),
        "plain_ms": plain,
        "speculative_ms": speculative,
        "plain_tokens_per_s": 1e3 * tokens / plain,
        "speculative_tokens_per_s": 1e3 * tokens / speculative,
        "speedup": plain / speculative,
    }


def recorded_methods(report: Mapping[str, Any]) -> dict[str, list[Recorded] | str]:
    """Per method of a `specdec bench methods` report (plain decoding aside), its rounds by proposer over the
    requests of the report's headline group; or why it cannot be priced."""
    group = report.get("headline_group")
    out: dict[str, list[Recorded] | str] = {}
    for method in report.get("methods", ()):
        if method == OFF:
            continue
        rows = [r for r in report.get("requests", ()) if r.get("method") == method and r.get("group", group) == group]
        if not rows:
            out[method] = "no requests recorded"
        elif any("by_method" not in r for r in rows):
            out[method] = "its requests do not record their rounds by proposer (by_method)"
        else:
            sums: dict[str, list[int]] = {}
            for row in rows:
                for label, part in row["by_method"].items():
                    acc = sums.setdefault(label, [0, 0, 0, 0])
                    for j, key in enumerate(("rounds", "proposed", "accepted", "tokens")):
                        acc[j] += int(part[key])
            out[method] = [Recorded(label, *acc) for label, acc in sums.items()]
    return out


def project(report: Mapping[str, Any], costs: Costs) -> dict[str, Any]:
    """Every method of one recorded report priced at `costs`, beside what the report measured on its CPU."""
    group = report.get("headline_group")
    results = report.get("results", {})
    out: dict[str, Any] = {}
    for method, recorded in recorded_methods(report).items():
        if isinstance(recorded, str):
            out[method] = {"error": recorded}
            continue
        measured = results.get(method, {}).get(group, {})
        proposed, accepted = sum(r.proposed for r in recorded), sum(r.accepted for r in recorded)
        out[method] = price(recorded, costs) | {
            "acceptance": accepted / proposed if proposed else 0.0,
            "recorded_decode_speedup": measured.get("decode_speedup"),
            "by_proposer": [asdict(r) for r in recorded],
        }
    return out


def default_recorded() -> tuple[Path, ...]:
    return tuple(sorted(RECORDED_DIR.glob(RECORDED_GLOB)))


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
