"""The model shapes the costs are measured at (Hugging Face configs, random weights), and what a forward of each
must read from memory: the bytes that set its read limit.

The real models cannot be brought to a lent GPU machine, and a forward's cost does not depend on its weights'
values: a random-weight model of a real model's shape costs what the real one does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from specdec_core.models.families import args_from_hf_config
from specdec_core.models.transformer import Transformer

QWEN2 = dict(model_type="qwen2", rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768)
LLAMA3 = dict(
    model_type="llama",
    rope_theta=5e5,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    ),
)


def shape(
    family: dict[str, Any], hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, tied: bool
) -> dict[str, Any]:
    """A config of `family` with these sizes: hidden size, layers, attention heads, KV heads, MLP size, vocabulary."""
    return family | dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=ffn,
        vocab_size=vocab,
        tie_word_embeddings=tied,
    )


@dataclass(frozen=True)
class Pair:
    """A target and its draft, by shape. `key` names the pair in the goals, whatever its size (the --quick pairs
    share their keys with the real ones)."""

    key: str
    target_name: str
    draft_name: str
    target: Mapping[str, Any]
    draft: Mapping[str, Any]


PAIRS = (
    Pair(
        "qwen",
        "Qwen2.5-1.5B",
        "Qwen2.5-0.5B",
        shape(QWEN2, 1536, 28, 12, 2, 8960, 151936, tied=True),
        shape(QWEN2, 896, 24, 14, 2, 4864, 151936, tied=True),
    ),
    Pair(
        "llama",
        "Llama-3.1-8B",
        "Llama-3.2-1B",
        shape(LLAMA3, 4096, 32, 32, 8, 14336, 128256, tied=False),
        shape(
            LLAMA3 | dict(rope_scaling=LLAMA3["rope_scaling"] | dict(factor=32.0)), 2048, 16, 32, 8, 8192, 128256, True
        ),
    ),
)
# --quick on a CPU: both families, so that each adapter and a tied and an untied head run, at toy sizes.
TINY_PAIRS = (
    Pair(
        "qwen",
        "tiny qwen2",
        "tinier qwen2",
        shape(QWEN2, 64, 2, 4, 2, 128, 400, tied=True),
        shape(QWEN2, 32, 1, 2, 1, 64, 400, tied=True),
    ),
    Pair(
        "llama",
        "tiny llama",
        "tinier llama",
        shape(LLAMA3, 64, 2, 4, 2, 128, 512, tied=False),
        shape(LLAMA3, 32, 1, 2, 1, 64, 512, tied=True),
    ),
)


def random_model(config: Mapping[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0) -> Transformer:
    """A random-weight `Transformer` of `config` (a Hugging Face config), built directly on `device` in `dtype`, its
    weights drawn from `seed` (the global generators are left as they were)."""
    args = args_from_hf_config(dict(config))
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are made in `dtype`; the RoPE table stays float32
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
            torch.manual_seed(seed)
            model = Transformer(args)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def weight_bytes_read(model: Transformer) -> int:
    """Bytes of weights a forward reads: every parameter once (a tied head's table counted once), less an untied
    embedding table, of which a forward reads only its tokens' rows."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    embedding = model.embed_tokens.weight
    if model.lm_head.weight is not embedding:
        total -= embedding.numel() * embedding.element_size()
    return total


def kv_bytes_per_position(model: Transformer) -> int:
    """Bytes of keys and values one cached position holds over every layer: what attention reads per position."""
    args = model.args
    element = model.embed_tokens.weight.element_size()  # the cache is kept in the model's dtype
    return args.num_layers * 2 * args.num_kv_heads * args.head_dim * element


def read_limit_ms(nbytes: float, bandwidth: float) -> float:
    """The least time reading `nbytes` can take at `bandwidth` bytes/s: a forward's floor."""
    return 1000 * nbytes / bandwidth


def forward_bytes(weights: int, kv_per_position: int, batch: int, positions: int) -> int:
    """Bytes a forward of `batch` rows reads: the weights once, and each row's keys and values over `positions`."""
    return weights + batch * positions * kv_per_position
