"""Qwen3 (dense): per-head q/k RMSNorm before the rotary embedding, an explicit head dim, biases only with
`attention_bias`. Tiny random models built with transformers' `Qwen3Config`, loaded by our loader."""

from __future__ import annotations

import pytest

from specdec_core.models.families import args_from_hf_config
from specdec_core.models.loader import load_model
from specdec_core.models.tiny import build_tiny_model
from tests.helpers import perturbed
from tests.specdec_core.models import family_checks as checks

# head_dim 32 with 4 heads over a hidden size of 64: q_proj is wider than the model, as an explicit head_dim allows.
SHAPE = dict(family="qwen3", seed=21, config_overrides={"head_dim": 32})


@pytest.fixture(scope="module")
def qwen3_dir(tiny_dir, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("qwen3") / "m", tokenizer_dir=tiny_dir / "tokenizer", **SHAPE)


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    return load_model(qwen3_dir, dtype="float32")


def test_the_config_becomes_q_k_norm_and_the_explicit_head_dim(qwen3):
    args = qwen3.model.args
    assert args.qk_norm and args.head_dim == 32 and args.num_heads * args.head_dim == 2 * args.hidden_size
    assert not args.attention_bias and not args.output_bias and args.moe is None


@pytest.mark.parametrize("bias,tie", [(False, False), (True, True)])
def test_logits_match_transformers(tmp_path, tiny_dir, bias, tie):
    overrides = {**SHAPE["config_overrides"], "attention_bias": bias}
    path = build_tiny_model(
        tmp_path / "m",
        family="qwen3",
        seed=22,
        tie_word_embeddings=tie,
        tokenizer_dir=tiny_dir / "tokenizer",
        config_overrides=overrides,
    )
    loaded = load_model(path, dtype="float32")
    assert (loaded.model.layers[0].self_attn.o_proj.bias is not None) == bias  # with q/k/v's, as Qwen3 has it
    checks.assert_logits_match_transformers(loaded, checks.hf_model(path))


def test_greedy_decoding_matches_transformers_generate(qwen3, qwen3_dir):
    checks.assert_greedy_matches_generate(qwen3, checks.hf_model(qwen3_dir))


def test_a_sliding_window_is_refused_clearly(qwen3):
    cfg = {**qwen3.hf_config, "use_sliding_window": True, "sliding_window": 128}
    with pytest.raises(ValueError, match="sliding-window"):
        args_from_hf_config(cfg)


def test_greedy_speculation_with_a_qwen3_draft_equals_plain_decoding(qwen3, tiny_dir, tmp_path):
    """Two drafts of the family: the target with noise (accepted sometimes) and a smaller Qwen3 of its own."""
    rate = checks.greedy_acceptance(qwen3, perturbed(qwen3.model, 0.2, seed=3))
    assert 0.0 < rate < 1.0, rate
    small = build_tiny_model(
        tmp_path / "draft",
        family="qwen3",
        seed=23,
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        num_layers=1,
        intermediate_size=64,
        tokenizer_dir=tiny_dir / "tokenizer",
    )
    checks.greedy_acceptance(qwen3, load_model(small, dtype="float32").model)


def test_sampling_with_speculation_follows_the_targets_law(qwen3):
    checks.assert_sampling_follows_the_target(qwen3, perturbed(qwen3.model, 0.05, seed=4))
