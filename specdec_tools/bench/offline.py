"""`specdec bench offline`: target-only vs speculative decoding (and transformers' own) on the same prompts.

Everything runs in one process, one mode after another, over the same prompts and settings, so the ratios are
measured side by side. Throughput is completion tokens over wall time per request, prefill included (as when
timing transformers' `generate`); decode-only figures (after the first token) are reported beside it.
"""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdec_core.build import DraftSpec, build_engine, load_pair
from specdec_core.chat import encode_prompt
from specdec_core.config import SamplingParams, parse_num_speculative_tokens
from specdec_core.drafters import registry
from specdec_core.engine import SpecEngine
from specdec_core.errors import InvalidArgument
from specdec_core.kernels.library import kernel_info
from specdec_core.kernels.linear import Int4CPULinear, Int8CPULinear
from specdec_core.kernels.report import kernel_path, rows_batch_invariant
from specdec_core.models.loader import LoadedModel
from specdec_core.request import Request
from specdec_core.runner import RunnerConfig
from specdec_tools.requests import read_prompt_texts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OfflineBenchConfig:
    target: str
    draft: str | None  # the draft model, for a method that runs one
    method: str  # a drafting method (`specdec_core.drafters.registry`); --draft: draft_model, --ngram: ngram,
    # --suffix: suffix
    prompts: Path
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    dtype: str = "bfloat16"
    device: str = "cpu"
    num_speculative_tokens: int | str = "auto"
    compare_hf: bool = False
    prompt_lookup_num_tokens: int = 10
    max_seq_len: int = 4096
    draft_quantization: str = "auto"  # none, int8, int4, or auto: what this CPU runs best (`specdec_core.hardware`)
    draft_vocabulary: int = 0  # the draft head's first N ids plus the contexts' (`models.vocab_head`); 0: all


@dataclass
class ModeResult:
    """One mode's run over all prompts."""

    token_ids: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    decode_seconds: float = 0.0  # after each request's first token
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    round_tokens: int = 0  # tokens committed by rounds (all but each request's first)

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def decode_tokens_per_s(self) -> float:
        return self.round_tokens / self.decode_seconds if self.decode_seconds else 0.0


def run_one(
    engine: SpecEngine, request_id: str, prompt: list[int], params: SamplingParams, k: int | str, result: ModeResult
) -> None:
    """Generate one prompt alone (batch size 1), timing it into `result`."""
    tokens: list[int] = []
    start = time.perf_counter()
    first = None
    engine.add_request(Request(request_id, tuple(prompt), params, num_speculative_tokens=k))
    while engine.has_work:
        for out in engine.step():
            tokens += out.new_token_ids
            if first is None:
                first = time.perf_counter()
            elif out.round is not None:
                result.round_tokens += len(out.new_token_ids)
            if out.finished:
                result.rounds += out.stats.rounds
                result.proposed += out.stats.proposed
                result.accepted += out.stats.accepted
    end = time.perf_counter()
    result.seconds += end - start
    result.decode_seconds += end - (first or end)
    result.token_ids.append(tokens)


def run_side_by_side(
    plain_engine: SpecEngine,
    spec_engine: SpecEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    k: int | str,
    bar: tqdm | None = None,
) -> tuple[ModeResult, ModeResult]:
    """Each prompt target-only and speculatively, back to back, alternating which goes first: on a shared
    machine whose speed drifts, both modes see the same conditions."""
    plain, speculative = ModeResult(), ModeResult()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        runs = [(plain_engine, 0, plain), (spec_engine, k, speculative)]
        for engine, mode_k, result in runs if i % 2 == 0 else runs[::-1]:
            run_one(engine, f"bench-{i}", prompt, p, mode_k, result)
            if bar is not None:
                bar.update(1)
    return plain, speculative


def first_divergence(target: LoadedModel, prompt: list[int], expected: list[int], got: list[int]) -> dict | None:
    """Where speculative output first differs from target-only, with the target's top-1 minus top-2 logit margin
    there (a divergence at a margin within bf16 rounding is numerical; a wide one would be a bug)."""
    position = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    if position is None:
        if len(expected) == len(got):
            return None
        position = min(len(expected), len(got))
    from specdec_core.runner import ModelRunner

    runner = ModelRunner(target.model, RunnerConfig(num_slots=1, max_seq_len=len(prompt) + len(expected) + 1))
    slot = runner.allocate()
    logits = runner.extend([slot], [prompt + expected[:position]])[0]  # [V]
    top = torch.topk(logits.float(), 2).values
    return {"position": position, "margin": float(top[0] - top[1])}


def run_offline_bench(config: OfflineBenchConfig) -> dict[str, Any]:
    if config.max_new_tokens <= 0:
        raise InvalidArgument("max_new_tokens", f"must be > 0, got {config.max_new_tokens}")
    method = registry.resolve(config.method)
    if method is None or method.runs_draft_model != (config.draft is not None):
        raise InvalidArgument("draft", "give exactly one of --draft PATH|NAME, --ngram or --suffix")
    k = parse_num_speculative_tokens(config.num_speculative_tokens, 16)
    SamplingParams(temperature=config.temperature, seed=config.seed, max_tokens=config.max_new_tokens)
    texts = read_prompt_texts(config.prompts)
    target, draft = load_pair(
        config.target,
        config.draft,
        dtype=config.dtype,
        device=config.device,
        draft_quantization=config.draft_quantization,
        draft_vocabulary=config.draft_vocabulary,
    )
    prompts = [encode_prompt(target.tokenizer, text) for text in texts]
    params = [
        SamplingParams(temperature=config.temperature, seed=config.seed + i, max_tokens=config.max_new_tokens)
        for i in range(len(prompts))
    ]
    runner_config = RunnerConfig(
        num_slots=1, max_seq_len=min(config.max_seq_len, max(map(len, prompts)) + config.max_new_tokens + 1)
    )
    spec = DraftSpec(method=config.method)
    plain_engine = build_engine(target, None, DraftSpec(method=registry.NONE), runner_config=runner_config)
    spec_engine = build_engine(target, draft, spec, runner_config=runner_config, max_speculative_tokens=16)

    modes = 2 + (2 if config.compare_hf else 0)
    with tqdm(total=modes * len(prompts) + 2, desc="bench offline", unit="req") as bar:
        _warm_up(plain_engine, spec_engine, prompts[0], k)
        bar.update(2)
        plain, speculative = run_side_by_side(plain_engine, spec_engine, prompts, params, k, bar)
        report = _report(config, target, prompts, plain, speculative)
        report.update(kernel_report(target, draft))
        del plain_engine, spec_engine
        if config.compare_hf:
            from specdec_tools.bench.hf import run_hf_comparison

            report.update(run_hf_comparison(config, target, draft, prompts, bar))
    return report


def _warm_up(plain: SpecEngine, speculative: SpecEngine, prompt: list[int], k: int | str) -> None:
    """One short request per engine: kernel compilation and first-touch costs stay out of the figures."""
    params = SamplingParams(max_tokens=8)
    run_one(plain, "warm-up", prompt, params, 0, ModeResult())
    run_one(speculative, "warm-up", prompt, params, k, ModeResult())


def kernel_report(target: LoadedModel, draft: LoadedModel | None) -> dict[str, Any]:
    """What computed the run: the kernel path of each model (`kernels.report.kernel_path`), the draft quantization
    `auto` settled on, and whether the target computes every row alike whatever the batch (the CPU kernels): only
    then is greedy speculative output identical to target-only output by construction. On torch's paths it is
    identical except where rounding flips a near-tie (`first_divergence` gives the margin there)."""
    return {
        "target_kernels": kernel_path(target.model),
        "draft_kernels": None if draft is None else kernel_path(draft.model),
        "draft_quantization_used": None if draft is None else _quantization_used(draft.model),
        "rows_batch_invariant": rows_batch_invariant(target.model),
    }


def _quantization_used(model: torch.nn.Module) -> str:
    """Which quantized layers the draft runs: int8, int4, or none (a layer the kernels cannot take stays bf16)."""
    kinds = {type(m) for m in model.modules()}
    return "int8" if Int8CPULinear in kinds else "int4" if Int4CPULinear in kinds else "none"


def machine_info() -> dict[str, Any]:
    """What a report says of the machine: figures from different machines (or kernels) do not compare."""
    return {"cpus": torch.get_num_threads(), "processor": platform.processor() or platform.machine(), **kernel_info()}


def _report(
    config: OfflineBenchConfig,
    target: LoadedModel,
    prompts: list[list[int]],
    plain: ModeResult,
    speculative: ModeResult,
) -> dict[str, Any]:
    per_prompt = []
    for prompt, expected, got in zip(prompts, plain.token_ids, speculative.token_ids):
        per_prompt.append(
            {
                "prompt_tokens": len(prompt),
                "target_only_token_ids": expected,
                "speculative_token_ids": got,
                "first_divergence": first_divergence(target, prompt, expected, got),
            }
        )
    return {
        "target": config.target,
        "draft": config.draft if config.draft is not None else config.method,
        "draft_quantization": config.draft_quantization,
        "draft_vocabulary": config.draft_vocabulary,
        "dtype": config.dtype,
        "device": config.device,
        "temperature": config.temperature,
        "seed": config.seed,
        "max_new_tokens": config.max_new_tokens,
        "num_speculative_tokens": config.num_speculative_tokens,
        "num_prompts": len(prompts),
        "machine": machine_info(),
        "target_only_tokens_per_s": plain.tokens_per_s(),
        "speculative_tokens_per_s": speculative.tokens_per_s(),
        "speedup": speculative.tokens_per_s() / plain.tokens_per_s(),
        "target_only_decode_tokens_per_s": plain.decode_tokens_per_s(),
        "speculative_decode_tokens_per_s": speculative.decode_tokens_per_s(),
        "decode_speedup": speculative.decode_tokens_per_s() / plain.decode_tokens_per_s(),
        "acceptance_rate": speculative.accepted / speculative.proposed if speculative.proposed else 0.0,
        "mean_tokens_per_round": speculative.round_tokens / speculative.rounds if speculative.rounds else 0.0,
        "rounds": speculative.rounds,
        "proposed": speculative.proposed,
        "accepted": speculative.accepted,
        "identical_to_target": all(p["first_divergence"] is None for p in per_prompt),
        "prompts": per_prompt,
    }
