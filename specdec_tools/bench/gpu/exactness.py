"""Part 2, the engine exact on the device: tiny random-weight models (`engines.py`: a qwen2 target, a smaller draft,
the target with noise on its weights as a "near" draft whose drafts are often right, and that draft again with its
LM head cut to 128 ids plus the contexts') loaded onto it.

First the calls that sample, each on its own (`components.py`). Then, for every drafting method of the registry
(the draft-model methods with each draft), several greedy prompts batched in one engine must give, token for token,
the output of plain decoding (method "none") on the same device, with drafts proposed and no warning logged. And
per method a mixed batch: greedy rows beside sampled ones (temperature 0.8, top-p 0.95) must still give the plain
output, the sampled rows must run to their length. A bfloat16 divergence at a near tie of the target's two best
logits is reported as such, not as a failure.

Then all of it again with the engine's CUDA graphs on (`RunnerConfig.cuda_graphs`; on a CPU the same static-shape
forwards run eagerly): each greedy row must equal both plain decoding's and the same run's with graphs off, and the
target's runner must have run forwards through its buckets, its counters reported (replays, eager calls), so that a
reader sees the graphs were used.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from specdec_core.build import prepare_model
from specdec_core.config import SamplingParams
from specdec_core.models.loader import LoadedModel
from specdec_tools.bench.gpu.compare import compare, divergence, graphs_verdict
from specdec_tools.bench.gpu.components import component_calls
from specdec_tools.bench.gpu.engines import (
    CUT_VOCABULARY,
    GRAPHS,
    PROMPTS,
    SAMPLED,
    Batch,
    K,
    drafting_runs,
    engine_run,
)
from specdec_tools.bench.gpu.report import Report, Warnings

RUNS = [("none", None), *drafting_runs()]


def workload(target: LoadedModel, max_tokens: int, prompts_used: int) -> tuple[dict[str, list[int]], Batch, Batch]:
    """The prompts' ids by greedy row id, the greedy batch, and the mixed batch (the greedy rows, then as many
    sampled ones, seeded)."""
    prompts = {f"p{i}": target.tokenizer(text)["input_ids"] for i, text in enumerate(PROMPTS[:prompts_used])}
    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = [(seq_id, ids, greedy) for seq_id, ids in prompts.items()]
    mixed = requests + [
        (f"s{seq_id}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i, **SAMPLED))
        for i, (seq_id, ids) in enumerate(prompts.items())
    ]
    return prompts, requests, mixed


def sampled_ok(entry: dict[str, Any], max_tokens: int, vocab_size: int) -> bool:
    """Every sampled row ran to its length, within the vocabulary."""
    rows = [r["tokens"] for seq_id, r in entry["rows"].items() if seq_id.startswith("s")]
    return all(len(t) == max_tokens and 0 <= min(t) and max(t) < vocab_size for t in rows)


def runs_clean(entry: dict[str, Any], method: str) -> bool:
    """No error, no warning, and drafts proposed (a drafter turned off by a failure proposes none)."""
    return not entry["errors"] and not entry["warnings"] and (method == "none" or entry["proposed"] > 0)


def engine_checks(
    report: Report,
    device: torch.device,
    dtype: torch.dtype,
    models: dict[str, Path],
    max_tokens: int,
    prompts_used: int,
) -> dict[str, Any]:
    """Part 2 in one dtype: the sampled calls on their own, then every drafting method against plain decoding, with
    greedy requests alone and in a batch with sampled ones, graphs off and then on."""
    label = str(dtype).removeprefix("torch.")
    print(f"engine on the device, {label} ({max_tokens} tokens, k={K}):", flush=True)
    loaded = {
        role: prepare_model(path, dtype=label, device=str(device), vocabulary=CUT_VOCABULARY.get(role, 0))
        for role, path in models.items()
    }
    out: dict[str, Any] = {"components": component_calls(report, label, loaded)}
    prompts, requests, mixed = workload(loaded["target"], max_tokens, prompts_used)
    warnings = Warnings()
    logging.getLogger("specdec_core").addHandler(warnings)
    try:
        run = Run(report, loaded, dtype, prompts, {"greedy": requests, "mixed": mixed}, warnings, max_tokens)
        out |= run.eager()
        out["graphs"] = run.graphed(device.type == "cuda")
        return out
    finally:
        logging.getLogger("specdec_core").removeHandler(warnings)


class Run:
    """One dtype's engine runs: graphs off first (kept, by (kind, method)), then graphs on against them."""

    def __init__(
        self,
        report: Report,
        loaded: dict[str, LoadedModel],
        dtype: torch.dtype,
        prompts: dict[str, list[int]],
        batches: dict[str, Batch],
        warnings: Warnings,
        max_tokens: int,
    ) -> None:
        self.report, self.loaded, self.dtype, self.prompts = report, loaded, dtype, prompts
        self.batches, self.warnings, self.max_tokens = batches, warnings, max_tokens
        self.label = str(dtype).removeprefix("torch.")
        self.target = loaded["target"]
        self.plain: dict[str, Any] = {}  # plain decoding of the greedy batch, graphs off: what every run must equal
        self.off: dict[tuple[str, str], dict[str, Any]] = {}

    def _run(self, kind: str, method: str, draft: str | None, graphs: bool) -> dict[str, Any]:
        entry = engine_run(self.loaded, method, draft, self.batches[kind], self.warnings, GRAPHS if graphs else None)
        assert self.target.model is not None  # a LoadedModel always carries its weights
        entry["sampled_ok"] = sampled_ok(entry, self.max_tokens, self.target.model.vocab_size)
        return entry | compare(self.target, self.prompts, self.plain["rows"], entry["rows"], self.dtype)

    def eager(self) -> dict[str, Any]:
        """Graphs off: plain decoding, then every method, greedy and mixed, against it."""
        self.plain = engine_run(self.loaded, "none", None, self.batches["greedy"], self.warnings)
        self.report.check(
            f"greedy {self.label}: plain decoding runs",
            not self.plain["errors"] and not self.plain["warnings"],
            f"{len(self.prompts)} prompts x {self.max_tokens} tokens in {self.plain['seconds']} s",
        )
        self.off[("greedy", "none")] = self.plain
        out: dict[str, Any] = {"plain": self.plain, "greedy": [], "mixed": []}
        for method, draft in RUNS:
            for kind in ("greedy", "mixed"):
                if kind == "greedy" and method == "none":
                    continue  # that is the plain run itself
                entry = self.off[(kind, method + (f"/{draft}" if draft else ""))] = self._run(
                    kind, method, draft, False
                )
                exact = entry["identical"] or (self.dtype != torch.float32 and entry["near_ties_only"])
                ok = exact and runs_clean(entry, method) and entry["sampled_ok"]
                out[kind].append(entry)
                what = "equals plain decoding" if kind == "greedy" else "greedy rows exact beside sampled rows"
                self.report.check(f"{kind} {self.label}: {entry['method']} {what}", ok, run_line(entry))
        return out

    def graphed(self, cuda: bool) -> list[dict[str, Any]]:
        """Graphs on: every method, greedy and mixed, against plain decoding and its own graphs-off run."""
        out = []
        for method, draft in RUNS:
            for kind in ("greedy", "mixed"):
                entry = self._run(kind, method, draft, True)
                verdict = graphs_verdict(
                    self.plain["rows"], self.off[(kind, entry["method"])]["rows"], entry["rows"], self._near_tie
                )
                entry["verdict"] = {"vs_plain": verdict.vs_plain, "vs_graphs_off": verdict.vs_graphs_off}
                entry["verdict"]["near_ties_only"] = verdict.near_ties_only
                replays = entry["graph_counters"].get("target", {}).get("replays", 0)
                ok = verdict.ok and runs_clean(entry, method) and entry["sampled_ok"] and replays > 0
                out.append(entry)
                what = "equals graphs off and plain decoding" + ("" if kind == "greedy" else ", beside sampled rows")
                line = graphs_line(entry, verdict.identical, cuda)
                self.report.check(f"{kind} {self.label} graphs on: {entry['method']} {what}", ok, line)
        return out

    def _near_tie(self, seq_id: str, expected: list[int], got: list[int]) -> bool:
        return divergence(self.target, self.prompts[seq_id], expected, got, self.dtype)["near_tie"]


def run_line(entry: dict[str, Any], verdict: str | None = None) -> str:
    """A run's verdict (by default against plain decoding), its rounds, acceptance and time, its first error or
    warning."""
    if verdict is None:
        verdict = "identical" if entry["identical"] else ("near ties only" if entry["near_ties_only"] else "DIFFERENT")
    line = (
        f"{verdict}, {entry['rounds']} rounds, {entry['accepted']}/{entry['proposed']} accepted, {entry['seconds']} s"
    )
    if entry["errors"]:
        line += f"; errors: {entry['errors'][0][:200]}"
    if entry["warnings"]:
        line += f"; {len(entry['warnings'])} warnings, first: {entry['warnings'][0][:200]}"
    return line


def graphs_line(entry: dict[str, Any], identical: bool, cuda: bool) -> str:
    """`run_line` with what the graphs did: forwards through a bucket (replayed on CUDA; on a CPU run eagerly
    through the same static buffers) and forwards run eagerly (prefill; calls no bucket takes), per runner."""
    verdict = "identical" if identical else ("near ties only" if entry["verdict"]["near_ties_only"] else "DIFFERENT")
    through = "replayed" if cuda else "through buckets (run eagerly: no CUDA)"
    parts = []
    for role in ("target", "draft"):
        if (c := entry["graph_counters"].get(role)) is not None:
            parts.append(f"{role} {c['replays']} {through}, {c['eager_prefill'] + c['eager_unfit']} eager")
    if why := entry["graph_counters"].get("draft_eager_because"):
        parts.append(f"draft eager (not captured: {why.split(':')[0]})")
    return f"{run_line(entry, verdict)}; " + "; ".join(parts)
