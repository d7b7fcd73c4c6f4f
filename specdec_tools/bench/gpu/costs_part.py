"""Part 4 as the command runs it: the copy bandwidth, then each pair measured (`costs.py`), its table printed as it
ends (what, ms, read-limit ms, ratio), the goals beside the figures (`goals.py`). A pair that fails is reported and
fails its check; the next still runs."""

from __future__ import annotations

import traceback
from dataclasses import asdict, dataclass
from typing import Any

import torch

from specdec_tools.bench.gpu.costs import FULL, QUICK, Cost, PairCosts, Sizes, pair_costs, release
from specdec_tools.bench.gpu.device import copy_bandwidth
from specdec_tools.bench.gpu.goals import pair_goals
from specdec_tools.bench.gpu.report import Report
from specdec_tools.bench.gpu.shapes import PAIRS, TINY_PAIRS


@dataclass(frozen=True)
class Measured:
    """The costs part's result: every pair measured, by key, and what it was measured at."""

    bandwidth: float  # bytes/s
    sizes: Sizes
    pairs: dict[str, PairCosts]
    on_gpu: bool
    errors: dict[str, str]  # by pair key: the traceback of a pair that failed

    def json(self) -> dict[str, Any]:
        goals = [g.json(self.on_gpu) for costs in self.pairs.values() for g in pair_goals(costs)]
        return {
            "copy_bandwidth_gb_per_s": self.bandwidth / 1e9,
            "sizes": asdict(self.sizes),
            "pairs": {key: costs.json() for key, costs in self.pairs.items()}
            | {key: {"error": tb} for key, tb in self.errors.items()},
            "goals": goals,
        }


def what(cost: Cost) -> str:
    if cost.role == "target":
        return (
            "plain step (b=1, w=1)" if (cost.batch, cost.width) == (1, 1) else f"verify b={cost.batch} w={cost.width}"
        )
    return "draft step (b=1, w=1)" if (cost.batch, cost.width) == (1, 1) else f"draft b={cost.batch} w={cost.width}"


def print_pair(costs: PairCosts, repeats: int, on_gpu: bool) -> None:
    pair = costs.pair
    print(
        f"costs: {pair.target_name} target, {pair.draft_name} draft ({costs.dtype}, random weights, context "
        f"{costs.context}, medians of {repeats}):",
        flush=True,
    )
    for role, capture in costs.captures.items():
        if capture is None:
            print(f"  {role}: not captured (no CUDA): its static-shape forwards ran eagerly", flush=True)
        else:
            print(
                f"  {role}: {len(capture['buckets'])} graphs captured in {capture['seconds']:.2f} s, "
                f"{capture['allocated_bytes'] / 2**20:.1f} MiB allocated, {capture['reserved_bytes'] / 2**20:.1f} MiB "
                f"reserved, {capture['static_bytes'] / 2**20:.1f} MiB of static buffers",
                flush=True,
            )
    print(f"  {'what':<24}{'ms':>9}{'read-limit ms':>15}{'ratio':>8}", flush=True)
    for cost in costs.forwards:
        print(f"  {what(cost):<24}{cost.ms:>9.3f}{cost.limit_ms:>15.3f}{cost.ratio:>8.2f}", flush=True)
    for name, window in costs.windows.items():
        unit = "round" if name == "speculative" else "step"
        roles = ", ".join(f"{role} {window.role_ms(role):.3f}" for role in ("draft", "target") if window.role_ms(role))
        print(
            f"  {name} {unit} through the engine (b=1), medians of {len(window.rounds)}: {window.round_ms:.3f} ms, "
            f"forwards {window.forwards_per_round_ms:.3f} ({roles}), host {window.host_per_round_ms:.3f} ms; "
            f"{window.tokens_per_round:.2f} tokens per {unit}"
            + (f"; {window.skipped} steps left out (no round, or an eager forward)" if window.skipped else ""),
            flush=True,
        )
    through = "replays" if on_gpu else "forwards through buckets (run eagerly: no CUDA)"
    counts = [
        f"{role} {c['replays']} {through}, {c['eager_prefill'] + c['eager_unfit']} eager"
        for role, c in costs.counters.items()
    ]
    print(f"  graph counters: {'; '.join(counts)}", flush=True)
    for goal in pair_goals(costs):
        print(f"  goal: {goal.line(on_gpu)}", flush=True)


def costs_part(report: Report, device: torch.device, quick: bool) -> Measured:
    """Part 4: bf16 on CUDA (float32 elsewhere), the real shapes, or with `quick` tiny ones."""
    sizes, pairs = (QUICK, TINY_PAIRS) if quick else (FULL, PAIRS)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    on_gpu = device.type == "cuda"
    bandwidth = copy_bandwidth(device, sizes.copy_bytes, sizes.repeats)
    print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (a {sizes.copy_bytes >> 20} MiB copy, read and written)")
    measured = Measured(bandwidth, sizes, {}, on_gpu, {})
    for pair in pairs:
        try:
            measured.pairs[pair.key] = pair_costs(pair, sizes, dtype, bandwidth, device)
            print_pair(measured.pairs[pair.key], sizes.repeats, on_gpu)
            report.check(f"costs {pair.target_name} + {pair.draft_name} measured", True)
        except Exception as exc:
            measured.errors[pair.key] = traceback.format_exc()
            report.check(
                f"costs {pair.target_name} + {pair.draft_name} measured", False, f"{type(exc).__name__}: {exc}"
            )
        finally:
            release(device)
    return measured
