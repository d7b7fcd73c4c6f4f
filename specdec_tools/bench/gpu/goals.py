"""The GPU engine's goals (its issue's), beside the figures measured: whether each is met. On a device other than a
GPU they do not apply: the figures are printed, the verdict is "n/a (not a GPU)"."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from specdec_tools.bench.gpu.costs import PairCosts
from specdec_tools.bench.gpu.shapes import read_limit_ms

NOT_A_GPU = "n/a (not a GPU)"


@dataclass(frozen=True)
class Goal:
    """One goal: the figure measured for it (None: not measured) and the most it may be."""

    pair: str  # the pair's key
    what: str
    figure: float | None
    limit: float
    unit: str  # "ms", or "x" for a ratio

    def verdict(self, on_gpu: bool) -> str:
        if self.figure is None:
            return "not measured"
        if not on_gpu:
            return NOT_A_GPU
        return "met" if self.figure <= self.limit else "NOT met"

    def line(self, on_gpu: bool) -> str:
        figure = "-" if self.figure is None else f"{self.figure:.3f} {self.unit}"
        return f"{self.what}: {figure}, goal <= {self.limit:g} {self.unit}: {self.verdict(on_gpu)}"

    def json(self, on_gpu: bool) -> dict[str, Any]:
        return asdict(self) | {"verdict": self.verdict(on_gpu)}


def _ms(costs: PairCosts, role: str, batch: int, width: int) -> float | None:
    cost = costs.get(role, batch, width)
    return None if cost is None else cost.ms


def _over(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def pair_goals(costs: PairCosts) -> list[Goal]:
    """The goals of `costs`' pair: the Qwen pair's step costs, the Llama target's step against its weights' read
    time, and every pair's host overhead per round at batch 1."""
    key, target, draft = costs.pair.key, costs.pair.target_name, costs.pair.draft_name
    step = _ms(costs, "target", 1, 1)
    goals = []
    if key == "qwen":
        goals += [
            Goal(key, f"{target} plain step (b=1)", step, 2.0, "ms"),
            Goal(key, f"{target} verify of 5 over the plain step", _over(_ms(costs, "target", 1, 5), step), 1.15, "x"),
            Goal(key, f"{draft} draft step (b=1)", _ms(costs, "draft", 1, 1), 1.2, "ms"),
        ]
    if key == "llama":
        weights = read_limit_ms(costs.weight_bytes["target"], costs.bandwidth)
        goals.append(Goal(key, f"{target} plain step over its weights' read time", _over(step, weights), 1.4, "x"))
    host = costs.windows["speculative"].host_per_round_ms if "speculative" in costs.windows else None
    return goals + [Goal(key, f"{target} + {draft} host overhead per round (b=1)", host, 0.3, "ms")]
