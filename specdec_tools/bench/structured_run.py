"""`specdec bench structured`: structured output decoded three ways over the same requests, in one process and one
run, so that their ratios are measured side by side:

1. constrained_plain: the request's constraint, plain decoding (k = 0: forced tokens too go one per round);
2. constrained_spec: the constraint, speculative decoding with one drafting method (`auto` k by default), which
   verifies the tokens the grammar forces without a draft call;
3. unconstrained_spec: the same method without the constraint: what a speculative round costs without a grammar.

The models load once; each mode gets an engine of its own over them (its own caches and drafter state), and
requests go one at a time, the order of the modes rotated from request to request so that drift in the machine's
speed falls on all alike. Request i is sampled with seed + i in every mode: at temperature 0, (2) must give (1)'s
token ids, which the report counts. Figures: `structured_report.py`; timing: `structured_timing.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdec_core.build import DraftSpec, build_engine
from specdec_core.config import SamplingParams, parse_num_speculative_tokens
from specdec_core.drafters import registry
from specdec_core.engine import SpecEngine
from specdec_core.errors import InvalidArgument
from specdec_core.runner import RunnerConfig
from specdec_tools.bench.figures import run_settings
from specdec_tools.bench.methods_workloads import rotated
from specdec_tools.bench.offline import machine_info
from specdec_tools.bench.options import RunOptions
from specdec_tools.bench.structured_report import (
    ALL,
    COMPLETE,
    CONSTRAINED_PLAIN,
    MODES,
    UNCONSTRAINED_SPEC,
    Record,
    headline,
    request_rows,
    results,
)
from specdec_tools.bench.structured_timing import GrammarClock, grammar_clock, run_request
from specdec_tools.bench.structured_workload import SCHEMA, TOOL, StructuredRequest, encode, read_structured

MAX_K = 16  # the largest k `auto` may choose, or a fixed k may ask for (as `bench methods`)
WARM_UP_TOKENS = 8
DEFAULT_METHOD = "draft_model"


def drafting_methods() -> tuple[str, ...]:
    return tuple(name for name in registry.choices() if name != registry.NONE)


@dataclass(frozen=True)
class StructuredBenchConfig(RunOptions):
    """The workload and the drafting method; sampling and how the models run: `RunOptions` (keyword-only)."""

    target: str
    prompts: Path  # the workload (`structured_workload.py`)
    max_new_tokens: int  # per request: a constrained output usually ends before it
    draft: str | None = None  # the draft model, for a method that runs one
    method: str = DEFAULT_METHOD  # the drafting method of both speculative modes
    limit: int | None = None  # the first N requests


def check_config(config: StructuredBenchConfig) -> int | str:
    """Refuse bad settings before any model loads; the k every speculative request asks for."""
    if config.max_new_tokens <= 0:
        raise InvalidArgument("--max-new-tokens", f"must be > 0, got {config.max_new_tokens}")
    if config.method not in drafting_methods():
        raise InvalidArgument(
            "--method", f"unknown method {config.method!r}; choose from {', '.join(drafting_methods())}"
        )
    if registry.resolve(config.method).runs_draft_model and config.draft is None:
        raise InvalidArgument("--draft", f"method {config.method} runs a draft model: give --draft")
    SamplingParams(temperature=config.temperature, seed=config.seed, max_tokens=config.max_new_tokens)
    return parse_num_speculative_tokens(config.num_speculative_tokens, MAX_K)


def read_workload(config: StructuredBenchConfig) -> tuple:
    items = read_structured(config.prompts)
    if config.limit is not None and not 0 < config.limit <= len(items):
        raise InvalidArgument(
            "--num-prompts", f"must be in [1, {len(items)}] ({config.prompts} holds {len(items)}), got {config.limit}"
        )
    return items[: config.limit]


def build_engines(config: StructuredBenchConfig, target: Any, draft: Any) -> dict[str, SpecEngine]:
    """An engine per mode over the loaded models: each its own runners, caches and grammar compiler."""
    runner_config = RunnerConfig(num_slots=1, prefix_caching=False, max_seq_len=config.max_seq_len)
    method = {CONSTRAINED_PLAIN: registry.NONE}
    return {
        mode: build_engine(
            target,
            draft,
            DraftSpec(method=method.get(mode, config.method)),
            runner_config=runner_config,
            max_speculative_tokens=MAX_K,
        )
        for mode in MODES
    }


def check_fits(requests: Sequence[StructuredRequest], limit: int, max_new_tokens: int) -> None:
    """Refuse, before any work, a request that would not fit: else it fails minutes into the run."""
    for request in requests:
        need = len(request.prompt) + max_new_tokens
        if need > limit:
            raise InvalidArgument(
                "--max-seq-len",
                f"{request.name} needs {need} tokens with {max_new_tokens} new "
                f"tokens; the engines hold {limit} (--max-seq-len, at most the "
                "model's positions)",
            )


@dataclass(frozen=True)
class Runner:
    """What every request of the run shares."""

    config: StructuredBenchConfig
    engines: dict[str, SpecEngine]
    k: int | str
    clock: GrammarClock

    def params(self, mode: str, request: StructuredRequest, index: int, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.config.temperature,
            seed=self.config.seed + index,
            max_tokens=max_tokens,
            constraint=None if mode == UNCONSTRAINED_SPEC else request.constraint,
        )

    def warm_up(self, requests: Sequence[StructuredRequest]) -> None:
        """Per engine: its grammar compiler's tables and every constraint compiled first, as the server compiles
        a request's before queueing it; then one short request under a salt of its own, so that first-touch
        costs stay out of the figures and nothing it caches serves a measured request."""
        for mode, engine in self.engines.items():
            if mode != UNCONSTRAINED_SPEC:
                for request in requests:
                    engine.compile(request.constraint)
            first = requests[0]
            run_request(
                engine,
                f"{mode}-warm-up",
                list(first.prompt),
                self.params(mode, first, 0, WARM_UP_TOKENS),
                self.k,
                f"structured-{mode}-warm-up",
                self.clock,
            )

    def run(self, requests: Sequence[StructuredRequest], progress: Any) -> list[Record]:
        records = []
        for i, request in enumerate(requests):
            for mode in rotated(MODES, i):
                params = self.params(mode, request, i, self.config.max_new_tokens)
                run = run_request(
                    self.engines[mode],
                    f"{mode}-{request.name}",
                    list(request.prompt),
                    params,
                    self.k,
                    f"structured-{mode}",
                    self.clock,
                )
                problem = request.check.problem(run.text) if run.finish_reason in COMPLETE else None
                records.append(Record(mode, request.name, request.kind, run, problem))
                progress()
        return records


def run_structured_bench(config: StructuredBenchConfig) -> dict[str, Any]:
    """The three modes over the workload; the report as a dict (`structured_report` for its figures)."""
    k = check_config(config)
    items = read_workload(config)
    needs_draft = registry.resolve(config.method).runs_draft_model
    target, draft = config.load_models(config.target, config.draft if needs_draft else None)
    requests = [encode(item, target.tokenizer) for item in items]
    engines = build_engines(config, target, draft)
    check_fits(requests, engines[CONSTRAINED_PLAIN].target.max_seq_len, config.max_new_tokens)
    total = len(MODES) * len(requests)
    with (
        grammar_clock() as clock,
        tqdm(total=total, desc="bench structured", unit="req", disable=not config.progress) as bar,
    ):
        runner = Runner(config, engines, k, clock)
        runner.warm_up(requests)
        records = runner.run(requests, lambda: bar.update(1))
    return report(config, requests, records)


def report(
    config: StructuredBenchConfig, requests: Sequence[StructuredRequest], records: Sequence[Record]
) -> dict[str, Any]:
    kinds = [kind for kind in (SCHEMA, TOOL) if any(r.kind == kind for r in requests)]
    figures = results(records, (ALL, *kinds))
    return {
        **run_settings(config),
        "method": config.method,
        "workload_file": str(config.prompts),
        "num_prompts": len(requests),
        "num_by_kind": {kind: sum(r.kind == kind for r in requests) for kind in kinds},
        "modes": list(MODES),
        "groups": [ALL, *kinds],
        "machine": machine_info(),
        "results": figures,
        **headline(figures),
        "requests": request_rows(records),
    }
