"""Part 5 as the command runs it: the recorded reports (`--recorded`) priced at the Qwen pair's costs just measured
(the shapes of the models those reports ran: Qwen2.5-Coder 1.5B and 0.5B), one table per report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specdec_tools.bench.gpu.costs import PairCosts
from specdec_tools.bench.gpu.costs_part import Measured
from specdec_tools.bench.gpu.projection import Costs, load, project

PRICED_PAIR = "qwen"


def costs_of(pair: PairCosts) -> Costs:
    """The pair's costs at batch 1: its draft step, its verifies, and the host overheads measured through the engine
    (a negative one, timing noise where there is almost none, as 0)."""
    widths = sorted({c.width for c in pair.forwards if c.role == "target" and c.batch == 1})
    verify = {w: cost.ms for w in widths if (cost := pair.get("target", 1, w)) is not None}
    draft = pair.get("draft", 1, 1)
    if draft is None or 1 not in verify:
        raise ValueError(f"{pair.pair.target_name}: no plain step or draft step measured at batch 1")
    return Costs(
        draft_step_ms=draft.ms,
        verify_ms=verify,
        round_host_ms=max(0.0, pair.windows["speculative"].host_per_round_ms),
        plain_host_ms=max(0.0, pair.windows["plain"].host_per_round_ms),
    )


def describe(costs: Costs) -> str:
    verify = ", ".join(f"v({w}) {ms:.3f}" for w, ms in sorted(costs.verify_ms.items()))
    return (
        f"d {costs.draft_step_ms:.3f} ms, {verify} ms, host {costs.round_host_ms:.3f} ms a round and "
        f"{costs.plain_host_ms:.3f} ms a plain step"
    )


def print_report(path: Path, report: dict[str, Any], projected: dict[str, Any]) -> None:
    print(
        f"  {path.name} ({report.get('target')} + {report.get('draft')}, {report.get('workload')}, group "
        f"{report.get('headline_group')}, recorded on {report.get('device')}):",
        flush=True,
    )
    print(f"    {'method':<14}{'tok/round':>10}{'accept':>8}{'CPU x':>7}{'plain tok/s':>13}{'spec tok/s':>12}{'x':>7}")
    for method, row in projected.items():
        if "error" in row:
            print(f"    {method:<14}not priced: {row['error']}", flush=True)
            continue
        cpu = row["recorded_decode_speedup"]
        print(
            f"    {method:<14}{row['tokens'] / max(1, row['rounds']):>10.2f}{row['acceptance']:>8.2f}"
            f"{'-' if cpu is None else f'{cpu:.2f}':>7}{row['plain_tokens_per_s']:>13.1f}"
            f"{row['speculative_tokens_per_s']:>12.1f}{row['speedup']:>7.2f}",
            flush=True,
        )


def projection_part(measured: Measured | None, paths: Sequence[Path]) -> dict[str, Any]:
    """Part 5: each report in `paths` priced at the Qwen pair's costs of this run."""
    pair = None if measured is None else measured.pairs.get(PRICED_PAIR)
    if pair is None:
        raise RuntimeError("the Qwen pair's costs were not measured in this run: nothing to price at")
    costs = costs_of(pair)
    print(
        f"projection at the {pair.pair.target_name} + {pair.pair.draft_name} costs, batch 1 ({describe(costs)}):",
        flush=True,
    )
    if not paths:
        print("  no recorded reports (--recorded): nothing priced", flush=True)
    out: dict[str, Any] = {"costs": asdict(costs), "reports": {}}
    for path in paths:
        try:
            report = load(path)
            projected = project(report, costs)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"  {path}: not read: {type(exc).__name__}: {exc}", flush=True)
            out["reports"][str(path)] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        print_report(path, report, projected)
        out["reports"][str(path)] = projected
    return out
