"""transformers' own generation, timed on the same prompts: plain `generate`, and assisted generation with the
draft model (`assistant_model=`) or, for a method without one (n-grams), prompt lookup (`prompt_lookup_num_tokens=`)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdec_core.models.loader import LoadedModel


def _load_hf(loaded: LoadedModel, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM, GgufConfig

    path = Path(loaded.path)
    if path.is_file():
        return AutoModelForCausalLM.from_pretrained(
            path.parent,
            gguf_file=path.name,
            dtype=dtype,
            quantization_config=GgufConfig(gguf_file=path.name, dequantize=True),
        ).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _generate_all(
    model: Any, prompts: list[list[int]], config: Any, bar: tqdm, **extra: Any
) -> tuple[int, float, list]:
    tokens, seconds, outputs = 0, 0.0, []
    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        kwargs: dict[str, Any] = dict(
            max_new_tokens=config.max_new_tokens, attention_mask=torch.ones_like(ids), pad_token_id=pad, **extra
        )
        if config.temperature > 0:
            kwargs.update(do_sample=True, temperature=config.temperature, top_k=0, top_p=1.0)
            torch.manual_seed(config.seed + i)
        else:
            kwargs.update(do_sample=False)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, **kwargs)
        seconds += time.perf_counter() - start
        new = out[0, len(prompt) :].tolist()
        tokens += len(new)
        outputs.append(new)
        bar.update(1)
    return tokens, seconds, outputs


def run_hf_comparison(
    config: Any, target: LoadedModel, draft: LoadedModel | None, prompts: list[list[int]], bar: tqdm
) -> dict[str, Any]:
    dtype = next(target.model.parameters()).dtype
    hf_target = _load_hf(target, dtype)
    if draft is None:  # model-free drafting: transformers' nearest is prompt lookup
        extra = {"prompt_lookup_num_tokens": config.prompt_lookup_num_tokens}
    else:
        assistant = _load_hf(draft, dtype)
        extra = {"assistant_model": assistant}
        if assistant.config.vocab_size != hf_target.config.vocab_size:
            # transformers treats differently padded embeddings as different tokenizers: it then needs both.
            extra.update(tokenizer=target.tokenizer, assistant_tokenizer=draft.tokenizer)
    _generate_all(hf_target, prompts[:1], replace(config, max_new_tokens=4), tqdm(disable=True))  # warm-up
    plain_tokens, plain_s, plain_out = _generate_all(hf_target, prompts, config, bar)
    assisted_tokens, assisted_s, _ = _generate_all(hf_target, prompts, config, bar, **extra)
    plain_tps, assisted_tps = plain_tokens / plain_s, assisted_tokens / assisted_s
    return {
        "hf_method": "prompt_lookup" if draft is None else "assistant_model",
        "hf_target_tokens_per_s": plain_tps,
        "hf_assisted_tokens_per_s": assisted_tps,
        "hf_assisted_speedup": assisted_tps / plain_tps,
        "hf_target_token_ids": plain_out,
    }
