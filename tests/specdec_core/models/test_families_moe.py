"""Sparse mixture-of-experts families: Qwen3-MoE and Mixtral. Tiny random models built with transformers' own
config classes and saved with `save_pretrained` (per-expert tensors, as on the Hub), loaded by our loader."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec_core.build import load_pair
from specdec_core.errors import TokenizerMismatch
from specdec_core.models.families import args_from_hf_config
from specdec_core.models.loader import check_tokenizers_compatible, load_model
from specdec_core.models.moe import MoEArgs, SparseMoE, experts_touched, route
from specdec_core.models.tiny import build_tiny_model, build_tiny_tokenizer
from tests.helpers import perturbed
from tests.specdec_core.models import family_checks as checks

# Qwen3-MoE: 8 experts, 4 a token, renormalised (as Qwen3-30B-A3B); Mixtral: 4 experts, 2 a token (tiny.py).
FAMILIES = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module")
def moe_dirs(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {f: build_tiny_model(root / f, family=f, seed=31, tokenizer_dir=tiny_dir / "tokenizer") for f in FAMILIES}


@pytest.fixture(scope="module")
def moe_models(moe_dirs):
    return {f: load_model(path, dtype="float32") for f, path in moe_dirs.items()}


def test_checkpoints_hold_per_expert_tensors_under_the_hub_names(moe_dirs):
    from safetensors import safe_open

    names = {f: set(safe_open(p / "model.safetensors", "pt").keys()) for f, p in moe_dirs.items()}
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names["qwen3_moe"]
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names["mixtral"]


@pytest.mark.parametrize(
    "family,layers,overrides,sparse",
    [
        ("qwen3_moe", 2, {}, [0, 1]),
        ("qwen3_moe", 2, {"norm_topk_prob": False, "mlp_only_layers": [0]}, [1]),
        ("qwen3_moe", 3, {"decoder_sparse_step": 2}, [1]),
        ("mixtral", 2, {}, [0, 1]),
    ],
)
def test_logits_match_transformers(tmp_path, tiny_dir, family, layers, overrides, sparse):
    path = build_tiny_model(
        tmp_path / "m",
        family=family,
        seed=32,
        num_layers=layers,
        tokenizer_dir=tiny_dir / "tokenizer",
        config_overrides=overrides,
    )
    loaded = load_model(path, dtype="float32")
    assert [i for i, layer in enumerate(loaded.model.layers) if isinstance(layer.mlp, SparseMoE)] == sparse
    checks.assert_logits_match_transformers(loaded, checks.hf_model(path))


def test_the_tokens_are_routed_to_different_experts(moe_models):
    """Otherwise the logits test would check a dense model in disguise."""
    for loaded in moe_models.values():
        moe = loaded.model.layers[0].mlp
        x = loaded.model.embed_tokens(torch.tensor(checks.TOKENS))  # [T, D]
        assert experts_touched(moe.gate(x), moe.args) > moe.args.top_k


def test_fused_expert_tensors_load_too(tmp_path, moe_dirs, moe_models):
    """transformers >= 5 holds experts fused ([E, 2I, D] gate_up, [E, D, I] down): what it writes with
    `save_original_format=False` and hands over from a GGUF file loads into the same model."""
    from safetensors import safe_open

    for family, path in moe_dirs.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        hf.save_pretrained(tmp_path / family, save_original_format=False)
        build_tiny_tokenizer(tmp_path / family)
        saved = set(safe_open(tmp_path / family / "model.safetensors", "pt").keys())
        assert "model.layers.0.mlp.experts.gate_up_proj" in saved
        fused = load_model(tmp_path / family, dtype="float32").model.state_dict()
        per_expert = moe_models[family].model.state_dict()
        assert fused.keys() == per_expert.keys()
        assert all(torch.equal(fused[name], per_expert[name]) for name in fused)


@pytest.mark.parametrize("renormalize,model_dtype", [(True, False), (False, True)])
def test_routing_is_softmax_then_top_k_then_renormalised(renormalize, model_dtype):
    args = MoEArgs(4, 2, 8, (0,), renormalize=renormalize, weights_in_model_dtype=model_dtype)
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]], dtype=torch.bfloat16)
    weights, experts = route(logits, args)
    p = torch.tensor([2.0, 0.0, 1.0, -1.0]).softmax(-1)  # over all four experts
    want = p[[0, 2]] / (p[0] + p[2]) if renormalize else p[[0, 2]]
    assert experts.tolist() == [[0, 2]]
    assert weights.dtype == (torch.bfloat16 if model_dtype else torch.float32)
    torch.testing.assert_close(weights[0].float(), want, rtol=1e-2 if model_dtype else 1e-6, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_block_in_bf16_is_transformers_own_bit_for_bit(moe_dirs, family):
    """Routing in fp32, the weights rounded where the family rounds them, each token's experts summed in expert
    order, in bf16: the very output of transformers' per-expert loop (`experts_implementation="eager"`)."""
    ours = load_model(moe_dirs[family], dtype="bfloat16").model.layers[0].mlp
    hf = AutoModelForCausalLM.from_pretrained(moe_dirs[family], dtype=torch.bfloat16, experts_implementation="eager")
    x = torch.randn(2, 7, ours.gate.in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(ours(x), hf.model.layers[0].mlp(x))


def test_a_batch_of_rows_gives_each_row_what_it_gives_alone(moe_models):
    """The forward groups a B x T batch's rows by expert: each row's output is that of the row alone."""
    moe = moe_models["qwen3_moe"].model.layers[0].mlp
    x = torch.randn(3, 5, moe.gate.in_features, generator=torch.Generator().manual_seed(0))  # [B, T, D]
    together = moe(x)  # [B, T, D]
    alone = torch.stack([torch.stack([moe(x[b, t].view(1, 1, -1))[0, 0] for t in range(5)]) for b in range(3)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)  # fp32 GEMMs of other row counts


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_matches_transformers_generate(moe_models, moe_dirs, family):
    checks.assert_greedy_matches_generate(moe_models[family], checks.hf_model(moe_dirs[family]))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculation_with_a_draft_of_the_family_equals_plain_decoding(moe_models, family):
    target = moe_models[family]
    rate = checks.greedy_acceptance(target, perturbed(target.model, 0.2, seed=3))
    assert 0.0 < rate < 1.0, rate


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_with_speculation_follows_the_targets_law(moe_models, family):
    target = moe_models[family]
    checks.assert_sampling_follows_the_target(target, perturbed(target.model, 0.05, seed=4))


def test_mixtral_with_a_sliding_window_is_refused(moe_models):
    with pytest.raises(ValueError, match="sliding window"):
        args_from_hf_config({**moe_models["mixtral"].hf_config, "sliding_window": 4096})


def test_a_qwen3_draft_for_a_mixtral_target_of_another_vocabulary_is_refused(tmp_path, tiny_dir, moe_dirs):
    """The Mixtral target's tokenizer has two tokens more: `load_pair` refuses the pair before serving it; the same
    tokenizer under a Qwen3-MoE target is accepted."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_a>", "<tool_b>"]})
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    target = build_tiny_model(tmp_path / "mixtral", family="mixtral", seed=33, tokenizer_dir=tmp_path / "tokenizer")
    draft = build_tiny_model(tmp_path / "qwen3", family="qwen3", seed=34, tokenizer_dir=tiny_dir / "tokenizer")
    with pytest.raises(TokenizerMismatch, match="differ in size: target has 386 tokens, draft 384"):
        load_pair(str(target), str(draft), dtype="float32")
    loaded_target, loaded_draft = load_pair(str(moe_dirs["qwen3_moe"]), str(draft), dtype="float32")
    check_tokenizers_compatible(loaded_target.tokenizer, loaded_draft.tokenizer)  # the shared vocabulary passes
