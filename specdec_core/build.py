"""Assemble an engine from model names or paths: the one place that wires loaders, runners and drafters."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from specdec_core.config import AUTO
from specdec_core.drafters.base import Drafter
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.drafters.ngram import NgramDrafter
from specdec_core.engine import EngineConfig, SpecEngine
from specdec_core.errors import InvalidArgument
from specdec_core.kernels.cpu import quantize_draft_int8, use_cpu_kernels
from specdec_core.models.loader import LoadedModel, check_tokenizers_compatible, load_model, resolve_source
from specdec_core.parallel import shard_model
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.target import LocalTarget

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftSpec:
    """How to draft. `method`: draft_model (the loaded draft is passed to `build_engine`), ngram, or none."""

    method: str = "draft_model"
    ngram_max: int = 4
    ngram_min: int = 1


DRAFT_QUANTIZATIONS = ("none", "int8")


def prepare_model(
    source: str | Path,
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    shard: tuple[int, int] | None = None,
    quantization: str = "none",
) -> LoadedModel:
    """A model ready to run, built in this order, the only order that works:

    1. load: torch's own modules (`models.loader`);
    2. shard: keep rank r of `shard = (r, world_size)` (`parallel.shard_model`): it slices plain Linear weights;
    3. kernels: on the CPU in bf16, swap in the CPU kernels (`kernels.cpu`), which repack the (sharded) weights;
    4. quantization "int8" (a draft: cheaper drafts, the same output; only acceptance can move).
    """
    if quantization not in DRAFT_QUANTIZATIONS:
        raise InvalidArgument("quantization", f"choose one of {DRAFT_QUANTIZATIONS}, got {quantization!r}")
    loaded = load_model(source, dtype=dtype, device=device)
    if shard is not None:
        shard_model(loaded.model, *shard)
    param = next(loaded.model.parameters())
    if param.device.type == "cpu" and param.dtype == torch.bfloat16:
        swapped = use_cpu_kernels(loaded.model)
        log.debug("%d linear layers use the CPU bf16 kernel", swapped)
    if quantization == "int8" and quantize_draft_int8(loaded.model) == 0:
        log.warning("int8 draft quantization unavailable here (needs a bf16 CPU model and the CPU kernels)")
    return loaded


def prepare_draft(source: str | Path, target_tokenizer: Any, *, dtype: str = "bfloat16", device: str = "cpu",
                  quantization: str = "none") -> LoadedModel:
    """`prepare_model` for a draft, refused (`InvalidArgument`) when its tokenizer does not match the target's."""
    draft = prepare_model(source, dtype=dtype, device=device, quantization=quantization)
    check_tokenizers_compatible(target_tokenizer, draft.tokenizer)
    return draft


def load_pair(
    target: str,
    draft: str | None,
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    draft_quantization: str = "none",
) -> tuple[LoadedModel, LoadedModel | None]:
    """Load the target and (optionally) the draft model; a tokenizer mismatch fails here, at load time."""
    if draft_quantization not in DRAFT_QUANTIZATIONS:
        raise InvalidArgument("draft_quantization", f"choose one of {DRAFT_QUANTIZATIONS}, got {draft_quantization!r}")
    target_path = resolve_source(target)
    draft_path = None if draft is None else resolve_source(draft)  # both found before any weights are read
    target_model = prepare_model(target_path, dtype=dtype, device=device)
    if draft_path is None:
        return target_model, None
    return target_model, prepare_draft(draft_path, target_model.tokenizer, dtype=dtype, device=device,
                                       quantization=draft_quantization)


def _draft_model(spec: DraftSpec, draft: LoadedModel | None, runner_config: RunnerConfig, vocab: int) -> Drafter:
    if draft is None:
        raise InvalidArgument("draft.model", "method draft_model needs a draft model")
    return DraftModelDrafter(ModelRunner(draft.model, runner_config), vocab)


def _ngram(spec: DraftSpec, draft: LoadedModel | None, runner_config: RunnerConfig, vocab: int) -> Drafter:
    return NgramDrafter(max_n=spec.ngram_max, min_n=spec.ngram_min)


DRAFTERS: dict[str, Callable[[DraftSpec, LoadedModel | None, RunnerConfig, int], Drafter]] = {
    "draft_model": _draft_model,
    "ngram": _ngram,
}


def build_engine(
    target: LoadedModel,
    draft: LoadedModel | None,
    spec: DraftSpec,
    *,
    runner_config: RunnerConfig = RunnerConfig(),
    num_speculative_tokens: int | str = AUTO,
    max_speculative_tokens: int = 8,
) -> SpecEngine:
    """An engine over `target`, drafting as `spec` says (method "none": plain decoding only)."""
    runner = ModelRunner(target.model, runner_config)
    drafter = None
    if spec.method != "none":
        factory = DRAFTERS.get(spec.method)
        if factory is None:
            raise InvalidArgument("draft.method", f"unknown method {spec.method!r}; choose {sorted(DRAFTERS)} or none")
        drafter = factory(spec, draft, runner_config, runner.vocab_size)
    config = EngineConfig(max_speculative_tokens=max_speculative_tokens, num_speculative_tokens=num_speculative_tokens)
    return SpecEngine(LocalTarget(runner), drafter, target.tokenizer, target.eos_token_ids, config)
