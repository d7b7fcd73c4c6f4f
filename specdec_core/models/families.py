"""Per-architecture adapters: a Hugging Face config becomes `ModelArgs`.

Every family supported here (Llama, Qwen2, Mistral, Qwen3, Qwen3-MoE, Mixtral) shares the Llama layer layout
(RMSNorm, RoPE, SwiGLU MLP, grouped-query attention), so one `Transformer` serves them all; what differs (q/k/v
biases, RoPE base and scaling, tied embeddings, q/k norm, experts) is read from the config here and nowhere else,
and so are the few checkpoint names that differ from ours (`CHECKPOINT_RENAMES`). Gemma 3 (text, and the text
part of its multimodal checkpoints) adds features of its own, read by its adapter (`gemma3.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from specdec_core.models import gemma3
from specdec_core.models.moe import MoEArgs
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
    bias = bool(cfg.get("attention_bias", False))  # on o_proj too, as on q/k/v
    return replace(_llama_like(cfg, attention_bias=bias), output_bias=bias)


def _qwen2(cfg: dict[str, Any]) -> ModelArgs:
    return _llama_like(cfg, attention_bias=True)


def _mistral(cfg: dict[str, Any]) -> ModelArgs:
    if cfg.get("sliding_window"):
        raise ValueError("mistral with a sliding window is not supported")
    return _llama_like(cfg, attention_bias=False)


def _qwen3(cfg: dict[str, Any]) -> ModelArgs:
    if cfg.get("use_sliding_window") or any(t != "full_attention" for t in cfg.get("layer_types") or ()):
        raise ValueError(f"{cfg['model_type']} with sliding-window attention layers is not supported")
    bias = bool(cfg.get("attention_bias", False))
    return replace(_llama_like(cfg, attention_bias=bias), output_bias=bias, qk_norm=True)


def _num_experts(cfg: dict[str, Any]) -> int:
    # Hub configs name it `num_experts` (Qwen3-MoE) or `num_local_experts` (Mixtral); transformers >= 5 saves both
    # families' as `num_local_experts`.
    return int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"])


def _qwen3_moe(cfg: dict[str, Any]) -> ModelArgs:
    layers, experts = cfg["num_hidden_layers"], _num_experts(cfg)
    dense, step = set(cfg.get("mlp_only_layers") or ()), cfg.get("decoder_sparse_step", 1)
    moe = MoEArgs(
        num_experts=experts,
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"],
        layers=tuple(i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0),
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        weights_in_model_dtype=True,
    )
    return replace(_qwen3(cfg), moe=moe if moe.layers else None)


def _mixtral(cfg: dict[str, Any]) -> ModelArgs:
    if cfg.get("sliding_window"):
        raise ValueError("mixtral with a sliding window is not supported")
    moe = MoEArgs(
        num_experts=_num_experts(cfg),
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["intermediate_size"],
        layers=tuple(range(cfg["num_hidden_layers"])),
        renormalize=True,
        weights_in_model_dtype=False,
    )
    return replace(_llama_like(cfg, attention_bias=False), moe=moe)


FAMILIES: dict[str, Callable[[dict[str, Any]], ModelArgs]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "mistral": _mistral,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
    "gemma3_text": gemma3.gemma3_text,
    "gemma3": gemma3.gemma3,
}

# Checkpoint name fragments a family's Hub checkpoints spell differently from our modules, in order (plain
# substring replacement). Mixtral's expert MLPs are `w1` (gate), `w3` (up) and `w2` (down) under `block_sparse_moe`.
CHECKPOINT_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "mixtral": (
        (".block_sparse_moe.", ".mlp."),
        (".w1.weight", ".gate_proj.weight"),
        (".w3.weight", ".up_proj.weight"),
        (".w2.weight", ".down_proj.weight"),
    ),
    "gemma3": gemma3.CHECKPOINT_RENAMES,
}
# Checkpoint names (after renaming) a family's checkpoints hold that no text model loads: a vision tower.
CHECKPOINT_SKIPS: dict[str, tuple[str, ...]] = {"gemma3": gemma3.CHECKPOINT_SKIPS}


def args_from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    """Translate a Hugging Face `config.json` dict; unknown families are a clear error."""
    model_type = cfg.get("model_type")
    adapter = FAMILIES.get(model_type)
    if adapter is None:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)}")
    return adapter(cfg)
