"""The engines the exactness part runs: tiny random-weight models written to disk and loaded onto the device, an
engine per drafting method (with each draft model), with the engine's CUDA graphs off or on, and a batch of
requests run to the end in it.

Graphs off, the engine comes from `build.build_engine`, as every in-process benchmark builds it. Graphs on, from
`engine_over`: the same assembly over runners made here, because the draft whose head is cut to part of the
vocabulary cannot be captured (`cuda_graphs.unsupported`: its ids change with every call) and then keeps an eager
runner beside the target's graphed one, as a served draft worker with `vocabulary` > 0 does.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from specdec_core.build import build_engine
from specdec_core.config import SamplingParams
from specdec_core.cuda_graphs import GraphConfig, unsupported
from specdec_core.drafters import registry
from specdec_core.drafters.base import DraftContext, DraftSpec
from specdec_core.engine import EngineConfig, SpecEngine
from specdec_core.models.loader import LoadedModel
from specdec_core.models.tiny import build_tiny_pair
from specdec_core.request import Request
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.stopping import FinishReason
from specdec_core.target import LocalTarget
from specdec_tools.bench.gpu.report import Warnings

PROMPTS = (
    "def add(a, b):",
    "The quick brown fox",
    "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n",  # repeats: n-gram and suffix lookups find matches
    "for index, value in enumerate(range(10)):\n    print(",
)
SAMPLED = dict(temperature=0.8, top_p=0.95)  # the sampled rows beside greedy ones
K = 4  # drafts per round in the engine checks
RUNNER = RunnerConfig(num_slots=8, max_seq_len=256)
# Verifies of K + 1, a draft's steps of 1 or 2 (the catch-up token, then one a step), and room above: a round at
# batch 1 to 8 runs through a bucket; prefill, wider, runs eagerly.
GRAPHS = GraphConfig(max_batch=8, widths=(1, 2, 3, 5, 9))
# The near draft again with its LM head cut to its first 128 ids and the contexts' (`models.vocab_head`).
CUT_VOCABULARY = {"near_cut": 128}

Batch = list[tuple[str, list[int], SamplingParams]]  # (seq_id, prompt ids, params) of each request


def build_tiny_models(root: Path) -> dict[str, Path]:
    """The tiny target and draft (`build_tiny_pair`), and the target with noise on its weights: the near draft,
    whose drafts are often right (a far draft's are rarely accepted, which would leave acceptance paths untried)."""
    from safetensors.torch import load_file, save_file

    build_tiny_pair(root)
    near = root / "near"
    shutil.copytree(root / "target", near)
    gen = torch.Generator().manual_seed(7)
    for file in near.glob("*.safetensors"):
        noisy = {
            k: (v + torch.randn(v.shape, generator=gen) * 0.05 * v.float().std().clamp(min=1e-3)).to(v.dtype)
            for k, v in load_file(file).items()
        }
        save_file(noisy, file, metadata={"format": "pt"})
    return {"target": root / "target", "draft": root / "draft", "near": near, "near_cut": near}


def drafting_runs() -> list[tuple[str, str | None]]:
    """(method, draft) for every registered method: those that run a draft model once with each draft."""
    return [
        (name, draft)
        for name, method in registry.METHODS.items()
        for draft in (("draft", "near", "near_cut") if method.runs_draft_model else (None,))
    ]


def engine_over(
    target: ModelRunner, draft: ModelRunner | None, method: str, tokenizer: Any, eos: frozenset[int]
) -> SpecEngine:
    """What `build.build_engine` assembles for `method` at k = K, over runners already made (`draft`: the draft
    model's, for a method that runs one)."""
    spec = DraftSpec(method=method)
    found = registry.resolve(method)
    drafter = None
    if found is not None:
        context = DraftContext(spec, target.vocab_size, draft if found.runs_draft_model else None)
        drafter = registry.assemble(found, found.build(context), context)
    return SpecEngine(LocalTarget(target), drafter, tokenizer, eos, EngineConfig(num_speculative_tokens=K))


def graphed_runners(
    target: LoadedModel, draft: LoadedModel | None, graphs: GraphConfig
) -> tuple[ModelRunner, ModelRunner | None, str | None]:
    """The target's runner with `graphs` (captured at once on CUDA), the draft's too unless graphs refuse its model
    (then eager), and why they refused (None: they did not)."""
    assert target.model is not None  # a LoadedModel always carries its weights
    target_runner = ModelRunner(target.model, replace(RUNNER, cuda_graphs=graphs))
    if draft is None or draft.model is None:
        return target_runner, None, None
    why = unsupported(draft.model)
    config = RUNNER if why else replace(RUNNER, cuda_graphs=graphs)
    return target_runner, ModelRunner(draft.model, config), why


def generate(engine: SpecEngine, requests: Batch) -> dict[str, dict[str, Any]]:
    """Run `requests` to the end in one engine: per id its tokens, end and stats."""
    for seq_id, ids, params in requests:
        engine.add_request(Request(seq_id, tuple(ids), params, num_speculative_tokens=K))
    out: dict[str, dict[str, Any]] = {seq_id: {"tokens": []} for seq_id, _, _ in requests}
    while engine.has_work:
        for step in engine.step():
            row = out[step.seq_id]
            row["tokens"] += step.new_token_ids
            if step.finish_reason is not None:
                row.update(
                    finish=step.finish_reason.value,
                    error=None if step.error is None else str(step.error),
                    rounds=step.stats.rounds,
                    proposed=step.stats.proposed,
                    accepted=step.stats.accepted,
                )
    return out


def totals(rows: dict[str, dict]) -> dict[str, Any]:
    """Rounds, drafts proposed and accepted over a run's rows, and every row that did not run to its length."""
    errors = [f"{k}: {r.get('error')}" for k, r in rows.items() if r.get("finish") != FinishReason.LENGTH.value]
    return {
        "rounds": sum(r.get("rounds", 0) for r in rows.values()),
        "proposed": sum(r.get("proposed", 0) for r in rows.values()),
        "accepted": sum(r.get("accepted", 0) for r in rows.values()),
        "errors": errors,
    }


def _engine(
    loaded: dict[str, LoadedModel], method: str, draft: str | None, graphs: GraphConfig | None
) -> tuple[SpecEngine, dict[str, Any]]:
    """The engine for one run, and (graphs on) its runners, to read their counters after the run."""
    target, draft_model = loaded["target"], loaded[draft] if draft else None
    if graphs is None:
        engine = build_engine(
            target, draft_model, DraftSpec(method=method), runner_config=RUNNER, num_speculative_tokens=K
        )
        return engine, {}
    target_runner, draft_runner, why = graphed_runners(target, draft_model, graphs)
    engine = engine_over(target_runner, draft_runner, method, target.tokenizer, target.eos_token_ids)
    return engine, {"target": target_runner, "draft": draft_runner, "draft_eager_because": why}


def counters(runners: dict[str, Any]) -> dict[str, Any]:
    """Each runner's graph counters: forwards through a bucket (graph replays on CUDA) and those run eagerly."""
    why = runners.get("draft_eager_because")
    roles = ("target",) if why else ("target", "draft")
    out = {role: asdict(runners[role].graph_counters()) for role in roles if runners.get(role)}
    return out | {"draft_eager_because": why}


def engine_run(
    loaded: dict[str, LoadedModel],
    method: str,
    draft: str | None,
    batch: Batch,
    warnings: Warnings,
    graphs: GraphConfig | None = None,
) -> dict[str, Any]:
    """`batch` run to the end by an engine drafting with `method` (and the `draft` model), its forwards captured
    as `graphs` (None: eager): rows, totals, warnings logged, and with graphs the runners' counters."""
    warnings.messages.clear()
    t0 = time.perf_counter()
    runners: dict[str, Any] = {}
    try:
        engine, runners = _engine(loaded, method, draft, graphs)
        rows = generate(engine, batch)
    except Exception as exc:  # the engine turns most failures into ended requests: this one it did not
        rows = {
            seq_id: {"tokens": [], "finish": "raised", "error": f"{type(exc).__name__}: {exc}"}
            for seq_id, _, _ in batch
        }
    entry = {
        "method": method + (f"/{draft}" if draft else ""),
        "graphs": graphs is not None,
        **totals(rows),
        "warnings": list(warnings.messages),
        "seconds": round(time.perf_counter() - t0, 2),
        "rows": rows,
    }
    return entry | ({"graph_counters": counters(runners)} if graphs is not None else {})
