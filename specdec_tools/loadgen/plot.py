"""The report as a PNG: output throughput, and p50 / p99 TPOT, against load; speculation on and off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdec_tools.loadgen.client import Concurrency, RequestRate

KINDS = {Concurrency.key: "concurrency (streams in flight)", RequestRate.key: "request rate (requests/s)"}
COLORS = {"speculative": "C0", "off": "C1"}  # a mode keeps its colour; in the TPOT panel p50 is solid, p99 dotted


def plot_report(report: dict[str, Any], path: Path) -> None:
    """One row per kind of load point in the report (concurrency, request rate), two panels each."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A request rate of "inf" has no place on an axis.
    placed = {
        kind: sorted((p for p in report["points"] if isinstance(p.get(kind), (int, float))), key=lambda p: p[kind])
        for kind in KINDS
    }
    kinds = [kind for kind in KINDS if placed[kind]] or list(KINDS)[:1]
    figure = Figure(figsize=(11, 4 * len(kinds)), layout="constrained")
    FigureCanvasAgg(figure)  # Agg, without pyplot's global state
    axes = figure.subplots(len(kinds), 2, squeeze=False)  # [rows, 2]
    for row, kind in zip(axes, kinds):
        points = placed[kind]
        loads = [p[kind] for p in points]
        throughput, tpot = row
        for mode, color in COLORS.items():
            if not any(mode in p for p in points):
                continue
            figures = [p[mode] for p in points]
            throughput.plot(loads, [f["output_tokens_per_s"] for f in figures], "-o", color=color, label=mode)
            tpot.plot(loads, [f["median_tpot_ms"] for f in figures], "-o", color=color, label=f"{mode} p50")
            tpot.plot(loads, [f["p99_tpot_ms"] for f in figures], ":^", color=color, label=f"{mode} p99")
        throughput.set(xlabel=KINDS[kind], ylabel="output tokens/s", title="output throughput")
        tpot.set(xlabel=KINDS[kind], ylabel="ms", title="time per output token")
        for ax in row:
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
            if points:
                ax.set_xticks(loads)
                ax.legend()
    model = Path(report["server"].get("target_model") or report["server"].get("id", "")).name
    figure.suptitle(f"specdec bench serve: {report['address']}, {model}")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
