"""Per-architecture adapters: a Hugging Face config becomes `ModelArgs`.

Every family supported here shares the Llama layer layout (RMSNorm, RoPE, SwiGLU MLP, grouped-query attention),
so one `Transformer` serves them all; what differs (q/k/v biases, RoPE base and scaling, tied embeddings) is
read from the config here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specdec_core.models.transformer import ModelArgs


def _rope(cfg: dict[str, Any]) -> tuple[float, tuple[tuple[str, float], ...] | None]:
    # transformers >= 5 nests RoPE settings in `rope_parameters`; older configs use rope_theta/rope_scaling.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return theta, tuple((k, float(params[k])) for k in keys)
    raise ValueError(f"rope type {rope_type!r} is not supported")


def _llama_like(cfg: dict[str, Any], *, attention_bias: bool) -> ModelArgs:
    heads = cfg["num_attention_heads"]
    theta, scaling = _rope(cfg)
    return ModelArgs(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        attention_bias=attention_bias,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
    )


def _llama(cfg: dict[str, Any]) -> ModelArgs:
    return _llama_like(cfg, attention_bias=bool(cfg.get("attention_bias", False)))


def _qwen2(cfg: dict[str, Any]) -> ModelArgs:
    return _llama_like(cfg, attention_bias=True)


def _mistral(cfg: dict[str, Any]) -> ModelArgs:
    if cfg.get("sliding_window"):
        raise ValueError("mistral with a sliding window is not supported")
    return _llama_like(cfg, attention_bias=False)


FAMILIES: dict[str, Callable[[dict[str, Any]], ModelArgs]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "mistral": _mistral,
}


def args_from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    """Translate a Hugging Face `config.json` dict; unknown families are a clear error."""
    model_type = cfg.get("model_type")
    adapter = FAMILIES.get(model_type)
    if adapter is None:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)}")
    return adapter(cfg)
