"""`specdec bench methods`: plain decoding ("off") and every drafting method on the same workload, in one process
and one run, so that their ratios are measured side by side.

The models are loaded once; each method gets an engine of its own over them (its own KV caches and runners, the
weights shared), so nothing one method caches or learns reaches another. Requests go one at a time (batch size 1).

The workloads (`methods_workloads.py`): prompts, each once per method, or multi-turn sessions, each replayed once
per method with that method's own answers in the history; the headline of sessions is the decode speed of turns
>= 2. The figures: `methods_report.py`.

Request i of the run (prompt i, or turn i over all sessions) is sampled with seed + i by every method, so at
temperature 0 every method must give plain decoding's tokens: the report counts the requests where it did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdec_core.build import DraftSpec, build_engine
from specdec_core.chat import encode_prompt
from specdec_core.config import SamplingParams, parse_num_speculative_tokens
from specdec_core.drafters import registry
from specdec_core.engine import SpecEngine
from specdec_core.errors import InvalidArgument
from specdec_core.runner import RunnerConfig
from specdec_tools.bench.figures import run_settings
from specdec_tools.bench.methods_report import OFF, Record, hybrid_comparison, request_rows, results
from specdec_tools.bench.methods_workloads import (
    PromptsWorkload,
    Runner,
    SessionsWorkload,
    Workload,
    check_fits,
    run_request,
)
from specdec_tools.bench.offline import machine_info
from specdec_tools.bench.options import RunOptions
from specdec_tools.bench.pinned import PinnedDrafter, pin_this_thread
from specdec_tools.requests import read_prompt_texts, read_sessions

MAX_K = 16  # the largest k `auto` may choose, or a fixed k may ask for
WARM_UP_TOKENS = 8


def known_methods() -> tuple[str, ...]:
    """off, then every method the registry knows, in its order."""
    return (OFF, *(name for name in registry.choices() if name != registry.NONE))


def method_names(asked: Sequence[str] | None) -> tuple[str, ...]:
    """The methods to run, off first (every ratio is over it, so it always runs); None: all of them."""
    known = known_methods()
    if asked is None:
        return known
    unknown = [name for name in asked if name not in known]
    if unknown:
        raise InvalidArgument(
            "--methods", f"unknown method(s) {', '.join(map(repr, unknown))}; choose from {', '.join(known)}"
        )
    return (OFF, *dict.fromkeys(name for name in asked if name != OFF))


@dataclass(frozen=True)
class MethodsBenchConfig(RunOptions):
    """The workload and the methods; sampling and how the models run: `RunOptions` (keyword-only)."""

    target: str
    draft: str  # the draft model of the methods that run one (loaded only if one of those is asked for)
    max_new_tokens: int  # per request (per turn)
    prompts: Path | None = None  # exactly one of prompts and sessions
    sessions: Path | None = None
    limit: int | None = None  # the first N prompts or sessions
    methods: tuple[str, ...] | None = None  # None: all (`method_names`)
    # draft_model and hybrid (`DraftSpec.confidence_threshold`): each such method runs once per value, the first
    # under its own name, the others as NAME@VALUE (`engine_names`), side by side in the one run.
    draft_confidence_thresholds: tuple[float, ...] = (0.0,)
    overlap: bool = False  # also each method that runs a draft model with pre-drafting on, as METHOD+overlap
    # The engine's thread (the target) and the draft model's calls (`bench/pinned.py`) on cores of their own.
    target_cores: tuple[int, ...] | None = None
    draft_cores: tuple[int, ...] | None = None


OVERLAP_SUFFIX = "+overlap"


def _first(items: Sequence, limit: int | None, flag: str, path: Path) -> tuple:
    if limit is not None and not 0 < limit <= len(items):
        raise InvalidArgument(flag, f"must be in [1, {len(items)}] ({path} holds {len(items)}), got {limit}")
    return tuple(items[:limit])


def read_workload(config: MethodsBenchConfig) -> tuple:
    """The prompt texts or the sessions to run: read and checked before any model loads."""
    if (config.prompts is None) == (config.sessions is None):
        raise InvalidArgument("--prompts", "give exactly one of --prompts FILE and --sessions FILE")
    if config.prompts is not None:
        return _first(read_prompt_texts(config.prompts), config.limit, "--num-prompts", config.prompts)
    return _first(read_sessions(config.sessions), config.limit, "--num-sessions", config.sessions)


def encode_workload(config: MethodsBenchConfig, items: tuple, tokenizer: Any) -> Workload:
    if config.prompts is not None:
        return PromptsWorkload(config.prompts, tuple(tuple(encode_prompt(tokenizer, text)) for text in items))
    return SessionsWorkload(config.sessions, items, tokenizer)


# -- the run -------------------------------------------------------------------------------------------------------


def engine_names(
    methods: Sequence[str], thresholds: Sequence[float], overlap: bool = False
) -> dict[str, tuple[str, float, bool]]:
    """Each engine's name -> (method, draft confidence threshold, pre-drafting on): a method that runs a draft model
    runs once per threshold, as METHOD for the first and METHOD@T for the others, and with `overlap` each of those
    again with pre-drafting, as NAME+overlap; any other method once."""
    out: dict[str, tuple[str, float, bool]] = {}
    for m in methods:
        runs_draft = m != OFF and registry.resolve(m).runs_draft_model
        for i, t in enumerate(thresholds if runs_draft else thresholds[:1]):
            name = m if i == 0 else f"{m}@{t:g}"
            out[name] = (m, t, False)
            if runs_draft and overlap:
                out[name + OVERLAP_SUFFIX] = (m, t, True)
    return out


def build_engines(
    config: MethodsBenchConfig,
    engines: Mapping[str, tuple[str, float, bool]],
    workload: Workload,
    target: Any,
    draft: Any,
) -> dict[str, SpecEngine]:
    """An engine per name over the loaded models: each its own runners and caches; with `draft_cores`, each
    engine's draft model called on a thread pinned there."""
    # One slot each: requests go one at a time. The KV cache's size does not slow attention (it reads the keys
    # written so far), so every engine takes the whole --max-seq-len.
    runner_config = RunnerConfig(num_slots=1, prefix_caching=workload.prefix_caching, max_seq_len=config.max_seq_len)
    built = {}
    for name, (m, t, overlap) in engines.items():
        engine = build_engine(
            target,
            draft,
            DraftSpec(method=registry.NONE if m == OFF else m, confidence_threshold=t),
            runner_config=runner_config,
            max_speculative_tokens=MAX_K,
            overlap="on" if overlap else "off",
        )
        if config.draft_cores is not None and engine.drafter is not None and registry.resolve(m).runs_draft_model:
            engine.drafter = PinnedDrafter(engine.drafter, config.draft_cores)
        built[name] = engine
    return built


def pin_target(config: MethodsBenchConfig) -> None:
    """The engine's thread on the target's cores, and torch's threads per forward the fewer of the two sides'."""
    if config.target_cores is None or config.draft_cores is None:
        return
    import torch

    pin_this_thread(config.target_cores)
    torch.set_num_threads(min(len(config.target_cores), len(config.draft_cores)))


def warm_up(runner: Runner, workload: Workload) -> None:
    """One short request per engine under its own salt: kernel compilation and first-touch costs stay out of the
    figures, and nothing it leaves in a cache can serve a measured request."""
    prompt, params = workload.warm_up_prompt(), SamplingParams(max_tokens=WARM_UP_TOKENS)
    for method, engine in runner.engines.items():
        run_request(engine, f"{method}-warm-up", prompt, params, runner.k, f"methods-{method}-warm-up")
        runner.progress()


def run_methods_bench(config: MethodsBenchConfig) -> dict[str, Any]:
    """Every method over the workload; the report as a dict (`methods_report` for its figures)."""
    if config.max_new_tokens <= 0:
        raise InvalidArgument("--max-new-tokens", f"must be > 0, got {config.max_new_tokens}")
    thresholds = config.draft_confidence_thresholds
    if not thresholds or not all(0.0 <= t < 1.0 for t in thresholds) or len(set(thresholds)) < len(thresholds):
        raise InvalidArgument(
            "--draft-confidence-threshold", f"must be distinct values in [0, 1), got {', '.join(map(str, thresholds))}"
        )
    asked = method_names(config.methods)
    k = parse_num_speculative_tokens(config.num_speculative_tokens, MAX_K)
    SamplingParams(temperature=config.temperature, seed=config.seed, max_tokens=config.max_new_tokens)
    items = read_workload(config)
    needs_draft = any(m != OFF and registry.resolve(m).runs_draft_model for m in asked)
    target, draft = config.load_models(config.target, config.draft if needs_draft else None)
    workload = encode_workload(config, items, target.tokenizer)
    names = engine_names(asked, thresholds, config.overlap)
    methods = tuple(names)
    pin_target(config)
    engines = build_engines(config, names, workload, target, draft)
    check_fits(workload, engines[OFF].target.max_seq_len, config.max_new_tokens)
    total = len(methods) * (1 + workload.num_requests)
    with tqdm(total=total, desc="bench methods", unit="req", disable=not config.progress) as bar:
        runner = Runner(engines, k, config.temperature, config.seed, config.max_new_tokens, lambda: bar.update(1))
        warm_up(runner, workload)
        records = workload.run(runner, methods)
    return report(config, methods, workload, records)


def report(
    config: MethodsBenchConfig, methods: Sequence[str], workload: Workload, records: Sequence[Record]
) -> dict[str, Any]:
    figures = results(records, methods, workload.groups)
    headline = workload.groups[-1]  # all prompts; turns >= 2 of sessions
    return {
        **run_settings(config),
        "draft_confidence_thresholds": list(config.draft_confidence_thresholds),
        "target_cores": None if config.target_cores is None else list(config.target_cores),
        "draft_cores": None if config.draft_cores is None else list(config.draft_cores),
        "prefix_caching": workload.prefix_caching,
        **workload.describe(),
        "methods": list(methods),
        "groups": list(workload.groups),
        "headline_group": headline,
        "machine": machine_info(),
        "results": figures,
        "headline_decode_speedup": {m: figures[m][headline]["decode_speedup"] for m in methods},
        "all_identical": all(g["identical"] == g["requests"] for f in figures.values() for g in f.values()),
        "hybrid": hybrid_comparison(figures, headline),
        "hybrid_by_threshold": {
            f"@{t:g}": hybrid_comparison(figures, headline, f"@{t:g}") for t in config.draft_confidence_thresholds[1:]
        },
        "requests": request_rows(records),
    }
