"""`specdec bench peer`'s runs and what is made of them: the best of each sweep, ours over llama-server's, which
outputs equal their server's plain ones, the JSON report and the printed table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec_tools.bench import peer_llama as llama
from specdec_tools.bench.peer_client import Completion

LLAMA, SPECDEC = "llama-server", "specdec serve"
PROMPTS, EDIT, SESSIONS = "prompts", "edit prompts", "sessions, turns >= 2"
PLAIN, SPECULATIVE = "plain", "speculative"
ON = "on"  # our speculative setting on the prompts: the config's


@dataclass(frozen=True)
class Run:
    """One setting of one server over one workload at one concurrency."""

    system: str  # LLAMA or SPECDEC
    workload: str  # PROMPTS, EDIT or SESSIONS
    role: str  # PLAIN or SPECULATIVE
    setting: str  # llama-server's ("draft-simple n-max 5", "ngram-mod"); ours "off", "on" or the method
    concurrency: int
    seconds: float = 0.0
    completions: tuple[Completion, ...] = ()
    command: tuple[str, ...] = ()  # llama-server's command line
    request_fields: Mapping[str, Any] = field(default_factory=dict)  # ours: what the requests add to the body
    error: str = ""
    # Measured taking turns with the other server's run of the same role, chunk by chunk (the headline figures);
    # False: a sweep run of llama-server alone, which only picks its best setting.
    paired: bool = False

    @property
    def tokens(self) -> int:
        return sum(c.completion_tokens for c in self.completions)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


LABELS = {
    (PROMPTS, LLAMA, PLAIN): "llama-server, no draft",
    (PROMPTS, LLAMA, SPECULATIVE): "llama-server, draft-simple (best n-max)",
    (PROMPTS, SPECDEC, PLAIN): "specdec serve, off",
    (PROMPTS, SPECDEC, SPECULATIVE): "specdec serve, on",
    (EDIT, LLAMA, PLAIN): "llama-server, no draft",
    (EDIT, LLAMA, SPECULATIVE): "llama-server, n-gram (best type)",
    (EDIT, SPECDEC, PLAIN): "specdec serve, off",
    (EDIT, SPECDEC, SPECULATIVE): "specdec serve, on",
    (SESSIONS, LLAMA, PLAIN): "llama-server, no draft",
    (SESSIONS, LLAMA, SPECULATIVE): "llama-server, best draft n-max or n-gram type",
    (SESSIONS, SPECDEC, PLAIN): "specdec serve, off",
    (SESSIONS, SPECDEC, SPECULATIVE): "specdec serve, on",
}
RATIOS = {
    SPECULATIVE: "specdec on / llama-server best speculative",
    PLAIN: "specdec off / llama-server no draft",
}


def best_run(runs: Sequence[Run], workload: str, system: str, role: str, concurrency: int) -> Run | None:
    """The fastest of the runs that match (those that failed left out); None if none."""
    matching = [
        r
        for r in runs
        if (r.workload, r.system, r.role, r.concurrency) == (workload, system, role, concurrency) and not r.error
    ]
    return max(matching, key=lambda r: r.tokens_per_s, default=None)


def headline_run(runs: Sequence[Run], workload: str, system: str, role: str, concurrency: int) -> Run | None:
    """The run a table cell and its ratio show: the best paired run where there is one (measured taking turns with
    the other server, so that the machine's drift falls on both alike), else the best of all."""
    paired = [r for r in runs if r.paired]
    return best_run(paired, workload, system, role, concurrency) or best_run(runs, workload, system, role, concurrency)


def plain_of(runs: Sequence[Run], run: Run) -> Run | None:
    """The plain run `run` is compared with: its server's, on its workload, at its concurrency."""
    return headline_run(runs, run.workload, run.system, PLAIN, run.concurrency)


def identical_count(run: Run, plain: Run) -> int:
    """On how many prompts `run` generated exactly the ids `plain` did."""
    return sum(a.token_ids == b.token_ids for a, b in zip(run.completions, plain.completions, strict=True))


def table(runs: Sequence[Run], workloads: Sequence[str], concurrency: Sequence[int]) -> list[dict[str, Any]]:
    """A row per (workload, configuration): each concurrency's tokens/s and the setting that gave it (the best of a
    sweep); None where no run succeeded."""
    rows = []
    for (workload, system, role), label in LABELS.items():
        if workload not in workloads:
            continue
        cells: dict[str, Any] = {}
        for c in concurrency:
            run = headline_run(runs, workload, system, role, c)
            cells[str(c)] = None if run is None else {"tokens_per_s": run.tokens_per_s, "setting": run.setting}
        rows.append({"workload": workload, "configuration": label, "cells": cells})
    return rows


def ratios(runs: Sequence[Run], workloads: Sequence[str], concurrency: Sequence[int]) -> list[dict[str, Any]]:
    """Ours over llama-server's best, speculative and plain, per workload and concurrency (None: a side missing)."""
    rows = []
    for workload in workloads:
        for role, label in RATIOS.items():
            values: dict[str, float | None] = {}
            for c in concurrency:
                ours, theirs = (headline_run(runs, workload, s, role, c) for s in (SPECDEC, LLAMA))
                values[str(c)] = _ratio(ours, theirs)
            rows.append({"workload": workload, "ratio": label, "values": values})
    return rows


def _ratio(ours: Run | None, theirs: Run | None) -> float | None:
    if ours is None or theirs is None or theirs.tokens_per_s <= 0:
        return None
    return ours.tokens_per_s / theirs.tokens_per_s


def equality(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Each speculative run's prompts that equal its server's plain output, token for token."""
    rows = []
    for run in runs:
        plain = plain_of(runs, run)
        if run.role != SPECULATIVE or run.error or plain is None:
            continue
        rows.append(
            {
                "system": run.system,
                "workload": run.workload,
                "setting": run.setting,
                "concurrency": run.concurrency,
                "identical": identical_count(run, plain),
                "prompts": len(run.completions),
            }
        )
    return rows


def sweep(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """llama-server's sweep runs (alone, unpaired): what picked its best setting."""
    return [
        {
            "workload": r.workload,
            "setting": r.setting,
            "concurrency": r.concurrency,
            "tokens_per_s": None if r.error else r.tokens_per_s,
            "error": r.error or None,
        }
        for r in runs
        if r.system == LLAMA and not r.paired
    ]


def _all_identical(rows: Sequence[Mapping[str, Any]]) -> bool | None:
    """Every prompt of every row identical; None where there is no row (nothing was compared)."""
    return all(r["identical"] == r["prompts"] for r in rows) if rows else None


def run_record(run: Run) -> dict[str, Any]:
    return {
        "system": run.system,
        "workload": run.workload,
        "role": run.role,
        "setting": run.setting,
        "concurrency": run.concurrency,
        "paired": run.paired,
        "command": list(run.command) or None,
        "request_fields": dict(run.request_fields) or None,
        "error": run.error or None,
        "seconds": run.seconds,
        "completion_tokens": run.tokens,
        "tokens_per_s": run.tokens_per_s,
        "drafted": sum(c.drafted for c in run.completions),
        "accepted": sum(c.accepted for c in run.completions),
        "token_ids_from": sorted({c.ids_from for c in run.completions}),
        "outputs": [{"token_ids": list(c.token_ids), "text": c.text} for c in run.completions],
    }


def build_report(
    bench: Any,  # peer.PeerBenchConfig
    config: dict[str, Any],
    version: str,
    workloads: Mapping[str, list[list[int]]],
    runs: Sequence[Run],
    notes: Sequence[str],
) -> dict[str, Any]:
    names = list(workloads)
    same = equality(runs)
    files = {PROMPTS: bench.prompts, EDIT: bench.edit_prompts, SESSIONS: bench.sessions}
    return {
        "llama_cpp_version": version,
        "llama_server": str(bench.llama.binary),
        "target_gguf": str(bench.llama.target_gguf),
        "draft_ggufs": [str(path) for path in bench.llama.draft_ggufs],
        "threads": bench.llama.threads,
        "config_path": str(bench.config),
        "config": config,
        "max_new_tokens": bench.max_new_tokens,
        "concurrency": list(bench.concurrency),
        "draft_n_max": list(bench.draft_n_max),
        "workloads": {w: {"file": str(files[w]), "prompt_token_ids": ids} for w, ids in workloads.items()},
        "table": table(runs, names, bench.concurrency),
        "ratios": ratios(runs, names, bench.concurrency),
        "specdec_identical_to_plain": _all_identical([e for e in same if e["system"] == SPECDEC]),
        "identical_to_plain": same,
        "sweep": sweep(runs),
        "notes": list(notes),
        "runs": [run_record(r) for r in runs],
    }


CELL = 44  # characters a printed cell takes: a figure and the setting that made it


def format_table(report: Mapping[str, Any]) -> str:
    """The report's table, its ratios and the equality counts, as printed."""
    columns = [str(c) for c in report["concurrency"]]
    lines = [f"{'configuration':<44}" + "".join(f"{'tok/s c=' + c:>{CELL}}" for c in columns)]
    for workload in report["workloads"]:
        lines.append(f"-- {workload} --")
        for row in (r for r in report["table"] if r["workload"] == workload):
            lines.append(f"{row['configuration']:<44}" + "".join(_cell(row["cells"][c]) for c in columns))
        for row in (r for r in report["ratios"] if r["workload"] == workload):
            values = ("-" if row["values"][c] is None else f"{row['values'][c]:.2f}x" for c in columns)
            lines.append(f"{row['ratio']:<44}" + "".join(f"{v:>{CELL}}" for v in values))
    for e in report.get("sweep", ()):
        figure = "failed" if e["tokens_per_s"] is None else f"{e['tokens_per_s']:.2f} tok/s"
        lines.append(f"llama-server sweep, alone: {e['setting']} ({e['workload']}, c={e['concurrency']}): {figure}")
    lines.append(f"specdec speculative == plain, token for token: {report['specdec_identical_to_plain']}")
    for e in (e for e in report["identical_to_plain"] if e["system"] == LLAMA):
        lines.append(
            f"llama-server {e['setting']} == its plain ({e['workload']}, c={e['concurrency']}): "
            f"{e['identical']}/{e['prompts']} prompts"
        )
    lines += [f"note: {note}" for note in report["notes"]]
    return "\n".join(lines)


def _cell(cell: Mapping[str, Any] | None) -> str:
    if cell is None:
        return f"{'-':>{CELL}}"
    plain = cell["setting"] in (llama.NO_DRAFT, "off", ON)
    text = f"{cell['tokens_per_s']:.2f}" + ("" if plain else f" ({cell['setting']})")
    return f" {text:>{CELL - 1}}"  # a setting's name may fill the cell: one space between cells always
