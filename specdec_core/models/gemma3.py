"""Gemma 3's adapter: its text config becomes `ModelArgs`; a multimodal ("gemma3") checkpoint serves its text part.

Gemma 3 is the Llama layout plus features `ModelArgs` names (`variants.py`, `window.py`): (1 + weight) RMSNorms in
float32, embeddings scaled by sqrt(hidden_size), GeGLU (gelu, tanh approximation), sandwich norms, a per-head
q/k norm, scores scaled by query_pre_attn_scalar ** -0.5, tied embeddings, soft-capped final logits where set
(never in the released models; `attn_logit_softcapping` transformers' Gemma 3 reads and never applies, so neither
do we), and sliding-window layers interleaved with full ones (`layer_types`, or every
`sliding_window_pattern`-th layer full), each kind with its own RoPE: the full layers' base (1e6) with linear
scaling in the 4B+ models, the windowed layers' (`rope_local_base_freq`, 1e4) unscaled.

Configs on the Hub often leave fields at transformers' defaults (a multimodal config's `text_config` names a
handful): `TEXT_DEFAULTS` are those of `Gemma3TextConfig`. Both spellings of RoPE are read: transformers 5's
`rope_parameters` per layer kind, and the older `rope_theta` / `rope_local_base_freq` / `rope_scaling`.
"""

from __future__ import annotations

import logging
from typing import Any

from specdec_core.models.transformer import ModelArgs

log = logging.getLogger(__name__)

TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}  # transformers' name -> ours (`variants.ACTIVATIONS`)
LAYER_KINDS = ("sliding_attention", "full_attention")

# A multimodal checkpoint's names, as transformers saves them (`language_model.model.layers...`, the Hub's) or holds
# them (`model.language_model.layers...`), mapped onto ours; the vision tower and projector are not loaded.
CHECKPOINT_RENAMES = (("language_model.model.", ""), ("language_model.lm_head.", "lm_head."), ("language_model.", ""))
CHECKPOINT_SKIPS = ("vision_tower.", "multi_modal_projector.")


def gemma3_text(cfg: dict[str, Any]) -> ModelArgs:
    """`model_type` "gemma3_text" (Gemma3ForCausalLM: 270M, 1B, and text-only checkpoints)."""
    return _text_args({**TEXT_DEFAULTS, **cfg})


def gemma3(cfg: dict[str, Any]) -> ModelArgs:
    """`model_type` "gemma3" (Gemma3ForConditionalGeneration, 4B+): its `text_config`; the embeddings are tied as
    the top-level config says (transformers ties them by that one)."""
    text = {**TEXT_DEFAULTS, **(cfg.get("text_config") or {})}
    return _text_args({**text, "tie_word_embeddings": cfg.get("tie_word_embeddings", True)})


def _text_args(cfg: dict[str, Any]) -> ModelArgs:
    if cfg["attn_logit_softcapping"] is not None:
        # Gemma 3 replaced Gemma 2's score soft-capping by the q/k norm; transformers reads the field and never
        # applies it. We compute what transformers computes, and say so.
        log.warning("gemma3: attn_logit_softcapping is ignored, as transformers' Gemma 3 ignores it")
    if cfg["use_bidirectional_attention"]:
        raise ValueError("gemma3 with bidirectional attention (an embedding model) is not supported")
    activation = ACTIVATIONS.get(cfg["hidden_activation"])
    if activation is None:
        raise ValueError(
            f"gemma3 activation {cfg['hidden_activation']!r} is not supported; supported: {list(ACTIVATIONS)}"
        )
    layers = cfg["num_hidden_layers"]
    kinds = _layer_kinds(cfg, layers)
    windowed = tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    if windowed and not cfg["sliding_window"]:
        raise ValueError("gemma3 with sliding layers but no sliding_window is not supported")
    full_theta, factor = _rope(cfg, "full_attention")
    local_theta, local_factor = _rope(cfg, "sliding_attention")
    if local_factor != 1.0:
        raise ValueError("gemma3 with scaled RoPE in its sliding-window layers is not supported")
    hidden, bias = cfg["hidden_size"], bool(cfg["attention_bias"])
    return ModelArgs(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=layers,
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=full_theta,
        max_position_embeddings=cfg["max_position_embeddings"],
        attention_bias=bias,
        output_bias=bias,
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        qk_norm=True,
        norm_unit_offset=True,
        hidden_act=activation,
        sandwich_norms=True,
        embed_scale=hidden**0.5,
        attention_scale=cfg["query_pre_attn_scalar"] ** -0.5,
        final_logit_softcap=cfg["final_logit_softcapping"],
        rope_linear_factor=factor,
        sliding_window=cfg["sliding_window"] if windowed else None,
        windowed_layers=windowed,
        window_rope_theta=local_theta,
    )


def _layer_kinds(cfg: dict[str, Any], layers: int) -> list[str]:
    kinds = cfg.get("layer_types")
    if kinds is None:  # older configs: every `pattern`-th layer is full
        pattern = cfg.get("_sliding_window_pattern", cfg["sliding_window_pattern"])
        kinds = [LAYER_KINDS[(i + 1) % pattern == 0] for i in range(layers)]
    if len(kinds) != layers or not set(kinds) <= set(LAYER_KINDS):
        raise ValueError(f"gemma3 layer_types must be {layers} of {LAYER_KINDS}, got {kinds}")
    return list(kinds)


def _rope(cfg: dict[str, Any], kind: str) -> tuple[float, float]:
    """(base, linear scaling factor) of one layer kind's RoPE; other scalings are refused."""
    nested = cfg.get("rope_parameters") or {}
    if kind in nested:
        params = dict(nested[kind] or {})
    elif kind == "full_attention":
        params = {"rope_theta": cfg["rope_theta"], **(cfg.get("rope_scaling") or {})}
    else:
        params = {"rope_theta": cfg["rope_local_base_freq"]}
    theta = float(
        params.get("rope_theta", TEXT_DEFAULTS["rope_theta" if kind == "full_attention" else "rope_local_base_freq"])
    )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("gemma3 with a partial rotary embedding is not supported")
    if rope_type == "default":
        return theta, 1.0
    if rope_type == "linear":
        return theta, float(params["factor"])
    raise ValueError(f"gemma3 rope type {rope_type!r} ({kind}) is not supported; supported: default, linear")
