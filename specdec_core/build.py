"""Assemble an engine from model names or paths: the one place that wires loaders, runners and drafters."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from specdec_core import environment
from specdec_core.config import AUTO
from specdec_core.drafters import registry
from specdec_core.drafters.base import DraftContext, DraftSpec
from specdec_core.engine import EngineConfig, SpecEngine
from specdec_core.errors import InvalidArgument
from specdec_core.hardware import DRAFT_QUANTIZATIONS, cpu_flags, resolve_draft_quantization
from specdec_core.huge_pages import back_with_huge_pages, log_huge_pages, move_into_huge_pages
from specdec_core.kernels.surgery import quantize_draft_int4, quantize_draft_int8, use_cpu_kernels
from specdec_core.models.loader import LoadedModel, check_tokenizers_compatible, load_model, resolve_source
from specdec_core.models.vocab_head import cut_vocabulary
from specdec_core.parallel import shard_model
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.target import LocalTarget

log = logging.getLogger(__name__)


def prepare_model(
    source: str | Path,
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    shard: tuple[int, int] | None = None,
    quantization: str = "none",
    vocabulary: int = 0,
) -> LoadedModel:
    """A model ready to run, built in this order, the only order that works:

    1. load: torch's own modules (`models.loader`); a draft's head cut to its first `vocabulary` ids (> 0), the
       special tokens and, per call, the contexts' ids (`models.vocab_head`);
    2. shard: keep rank r of `shard = (r, world_size)` (`parallel.shard_model`): it slices plain Linear weights;
    3. kernels: on the CPU in bf16, swap in the CPU kernels (`kernels.surgery`), which repack the (sharded) weights;
    4. quantization "int8" or "int4" (a draft: cheaper drafts, the same output; only acceptance can move);
       "auto": what this CPU runs best, else none (`hardware.resolve_draft_quantization`);
    5. on the CPU, huge pages (`huge_pages.py`): the weights as loaded are copied into memory advised for them
       before step 3, and what the steps since allocated is collapsed into them in place.
    """
    quantization = resolve_quantization(quantization, device=device, dtype=dtype)
    if vocabulary < 0:
        raise InvalidArgument("vocabulary", f"must be >= 0 (0: the whole vocabulary), got {vocabulary}")
    loaded = load_model(source, dtype=dtype, device=device)
    assert loaded.model is not None  # `load_model` always returns the weights
    if vocabulary and cut_vocabulary(loaded.model, vocabulary, special_ids(loaded)):
        log.debug("draft head: the first %d ids, the special tokens and the contexts'", loaded.model.lm_head.keep)
    if shard is not None:
        shard_model(loaded.model, *shard)
    param = next(loaded.model.parameters())
    if param.device.type == "cpu":
        move_into_huge_pages(loaded.model)
    if param.device.type == "cpu" and param.dtype == torch.bfloat16:
        swapped = use_cpu_kernels(loaded.model)
        log.debug("%d linear layers use the CPU bf16 kernel", swapped)
    quantize = {"int8": quantize_draft_int8, "int4": quantize_draft_int4}.get(quantization)
    if quantize is not None and quantize(loaded.model) == 0:
        log.warning("%s draft quantization unavailable here (needs a bf16 CPU model and the CPU kernels)", quantization)
    if param.device.type == "cpu":
        log_huge_pages(Path(source).name, back_with_huge_pages(loaded.model))
    return loaded


def special_ids(loaded: LoadedModel) -> set[int]:
    """Ids a cut head always scores: end-of-turn and other special or added tokens, wherever they are numbered."""
    tokenizer = loaded.tokenizer
    ids = set(loaded.eos_token_ids) | set(getattr(tokenizer, "all_special_ids", ()))
    added = getattr(tokenizer, "get_added_vocab", None)
    return ids | set(added().values()) if added is not None else ids


def resolve_quantization(setting: str, *, device: str, dtype: str) -> str:
    """`setting` ("none", "int8", "int4" or "auto") resolved for this machine; `InvalidArgument` for anything else."""
    if setting not in DRAFT_QUANTIZATIONS:
        raise InvalidArgument("quantization", f"choose one of {DRAFT_QUANTIZATIONS}, got {setting!r}")
    return resolve_draft_quantization(
        setting,
        device=device,
        dtype=dtype,
        cpu_flags=cpu_flags(),
        kernels_enabled=not environment.cpu_kernels_disabled(),
    )


def prepare_draft(
    source: str | Path,
    target_tokenizer: Any,
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    quantization: str = "auto",
    vocabulary: int = 0,
) -> LoadedModel:
    """`prepare_model` for a draft, refused (`InvalidArgument`) when its tokenizer does not match the target's."""
    draft = prepare_model(source, dtype=dtype, device=device, quantization=quantization, vocabulary=vocabulary)
    check_tokenizers_compatible(target_tokenizer, draft.tokenizer)
    return draft


def load_pair(
    target: str,
    draft: str | None,
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    draft_quantization: str = "auto",
    draft_vocabulary: int = 0,
) -> tuple[LoadedModel, LoadedModel | None]:
    """Load the target and (optionally) the draft model; a tokenizer mismatch fails here, at load time."""
    if draft_quantization not in DRAFT_QUANTIZATIONS:
        raise InvalidArgument("draft_quantization", f"choose one of {DRAFT_QUANTIZATIONS}, got {draft_quantization!r}")
    target_path = resolve_source(target)
    draft_path = None if draft is None else resolve_source(draft)  # both found before any weights are read
    target_model = prepare_model(target_path, dtype=dtype, device=device)
    if draft_path is None:
        return target_model, None
    return target_model, prepare_draft(
        draft_path,
        target_model.tokenizer,
        dtype=dtype,
        device=device,
        quantization=draft_quantization,
        vocabulary=draft_vocabulary,
    )


def build_engine(
    target: LoadedModel,
    draft: LoadedModel | None,
    spec: DraftSpec,
    *,
    runner_config: RunnerConfig = RunnerConfig(),
    num_speculative_tokens: int | str = AUTO,
    max_speculative_tokens: int = 8,
    overlap: str = "off",
) -> SpecEngine:
    """An engine over `target`, drafting as `spec` says (`drafters.registry`; method "none": plain decoding only).
    `draft`: the loaded draft model, for a method that runs one. `overlap`: `EngineConfig.overlap` (in one process
    the draft and the target share the cores, so it is off unless asked)."""
    assert target.model is not None  # a LoadedModel (`models.loader.load_model`) always carries its weights
    runner = ModelRunner(target.model, runner_config)
    method = registry.resolve(spec.method)
    drafter = None
    if method is not None:
        draft_runner = None
        if method.runs_draft_model:
            if draft is None:
                raise InvalidArgument("draft.model", f"method {method.name} needs a draft model")
            assert draft.model is not None  # as for the target
            draft_config = runner_config
            if overlap != "off":  # slots for the branches a pre-draft drafts for rejection outcomes
                branches = EngineConfig.overlap_alternatives
                draft_config = replace(runner_config, num_slots=runner_config.num_slots + branches)
            draft_runner = ModelRunner(draft.model, draft_config)
        context = DraftContext(spec, runner.vocab_size, draft_runner)
        drafter = registry.assemble(method, method.build(context), context)
    config = EngineConfig(
        max_speculative_tokens=max_speculative_tokens, num_speculative_tokens=num_speculative_tokens, overlap=overlap
    )
    return SpecEngine(LocalTarget(runner), drafter, target.tokenizer, target.eos_token_ids, config)
