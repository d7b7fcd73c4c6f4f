"""Gemma 3 (text, and the text part of multimodal checkpoints): our model against transformers' own, over contexts
longer than the sliding window and its ring; speculation with a Gemma 3 draft exact against plain decoding. Tiny
random models built with transformers' `Gemma3TextConfig` / `Gemma3Config`, loaded by our loader."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3Config, Gemma3TextConfig

from specdec_core.models.families import args_from_hf_config
from specdec_core.models.loader import load_model
from specdec_core.models.tiny import build_tiny_tokenizer
from specdec_core.models.transformer import TorchAttention
from specdec_core.models.variants import GatedMLP, SandwichDecoderLayer, UnitOffsetRMSNorm
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.sampling import processed_probs
from tests.helpers import (
    GEMMA3_LAYERS,
    build_tiny_gemma3,
    chi_square_p_value,
    one_torch_thread,
    perturbed,
)
from tests.specdec_core.models import family_checks as checks

# 40 positions, five times the window of 8 and past the ring (8 + 2 * max_extend 4 = 16), read as a prefill longer
# than the ring, a verify, decode steps, and more.
CONTEXT = [(7 * i * i + 3 * i + 11) % 380 for i in range(40)]
CHUNKS = [20, 5, 1, 1, 4, 9]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models are thousands of small ops: a second thread only contends for the cores (`one_torch_thread`)."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def gemma_dir(tiny_dir, tmp_path_factory):
    return build_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "m", tiny_dir / "tokenizer")


@pytest.fixture(scope="module")
def gemma(gemma_dir):
    return load_model(gemma_dir, dtype="float32")


def _logits_in_chunks(model, tokens, chunks=CHUNKS, max_extend=4):  # [T, V]
    runner = ModelRunner(model, RunnerConfig(num_slots=1, max_seq_len=64, max_extend=max_extend))
    assert runner.cache.ring is not None and runner.cache.ring.size == 16
    slot, out, at = runner.allocate(), [], 0
    for n in chunks:
        out.append(runner.extend([slot], [tokens[at : at + n]], all_logits=True)[0])
        at += n
    return torch.cat(out)


def _reference(hf, tokens):  # [T, V]
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0]


def test_the_config_becomes_gemmas_features(gemma):
    args, model = gemma.model.args, gemma.model
    assert args.windowed_layers == (0, 2) and args.sliding_window == 8
    assert args.rope_theta == 1e6 and args.rope_linear_factor == 2.0 and args.window_rope_theta == 1e4
    assert args.attention_scale == 24**-0.5 and args.embed_scale == 64**0.5
    assert args.qk_norm and args.norm_unit_offset and args.sandwich_norms and args.hidden_act == "gelu_tanh"
    assert not args.plain_attention
    layer = model.layers[1]
    assert type(layer) is SandwichDecoderLayer and type(layer.mlp) is GatedMLP
    assert type(layer.self_attn.q_norm) is UnitOffsetRMSNorm and type(model.norm) is UnitOffsetRMSNorm


def test_distillations_cacheless_forward_is_refused_not_computed_wrongly(gemma):
    from specdec_core.distill.forward import use_causal_attention

    with pytest.raises(ValueError, match="plain causal attention"):
        use_causal_attention(gemma.model)
    assert type(gemma.model.attention) is TorchAttention


# A multimodal config as the Hub's Gemma 3 4B has it: a few text fields, the rest transformers' defaults, RoPE in
# the older spelling with the full layers' linear scaling.
HUB_TEXT = {
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "model_type": "gemma3_text",
    "num_hidden_layers": 34,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
}


@pytest.mark.parametrize(
    "raw,expanded",
    [
        ({"model_type": "gemma3_text"}, lambda: Gemma3TextConfig().to_dict()),
        (
            {**HUB_TEXT, "rope_theta": 5e5, "rope_local_base_freq": 2e4, "sliding_window_pattern": 4},
            lambda: Gemma3TextConfig(
                **{**HUB_TEXT, "rope_theta": 5e5, "rope_local_base_freq": 2e4, "sliding_window_pattern": 4}
            ).to_dict(),
        ),
        (
            {"model_type": "gemma3", "text_config": HUB_TEXT},
            lambda: Gemma3Config(text_config=HUB_TEXT, vision_config={"model_type": "siglip_vision_model"}).to_dict(),
        ),
    ],
)
def test_hub_configs_read_as_transformers_reads_them(raw, expanded):
    """A config with fields left out (defaults), in the older RoPE spelling, or nested in a multimodal config gives
    the same `ModelArgs` as transformers' own reading of it, written out in full."""
    ours, theirs = args_from_hf_config(raw), args_from_hf_config(expanded())
    assert ours == theirs
    text = expanded().get("text_config") or expanded()
    assert [i for i, kind in enumerate(text["layer_types"]) if kind == "sliding_attention"] == list(
        ours.windowed_layers
    )


@pytest.mark.parametrize(
    "change,words",
    [
        ({"use_bidirectional_attention": True}, "bidirectional"),
        ({"hidden_activation": "gelu"}, "activation"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"layer_types": ["sliding_attention", "chunked_attention"], "num_hidden_layers": 2}, "layer_types"),
    ],
)
def test_configs_we_cannot_serve_are_refused_clearly(change, words):
    with pytest.raises(ValueError, match=words):
        args_from_hf_config({"model_type": "gemma3_text", **change})


@pytest.mark.parametrize("tie,caps", [(True, (None, None)), (False, (20.0, 15.0))])
def test_logits_match_transformers_past_the_window(tmp_path, tiny_dir, tie, caps):
    """fp32, both sides: within `family_checks.LOGITS_TOLERANCE`. Tied embeddings, as Gemma's; and soft-capping
    set (no released Gemma 3 has it): the final logits' is applied; the attention scores', which transformers'
    Gemma 3 never applies (its eager attention, the one that could, included), is not."""
    attn_cap, final_cap = caps
    path = build_tiny_gemma3(
        tmp_path / "m",
        tiny_dir / "tokenizer",
        seed=33,
        tie=tie,
        attn_logit_softcapping=attn_cap,
        final_logit_softcapping=final_cap,
    )
    ours = load_model(path, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    got = _logits_in_chunks(ours.model, CONTEXT)
    tol = checks.LOGITS_TOLERANCE
    torch.testing.assert_close(got, _reference(hf, CONTEXT), rtol=tol, atol=tol)


def test_greedy_generation_matches_transformers_past_the_window(gemma, gemma_dir):
    """40 new tokens: five windows, past the ring of the default runner (8 + 2 * 16 positions)."""
    checks.assert_greedy_matches_generate(gemma, checks.hf_model(gemma_dir), new_tokens=40)


def test_a_multimodal_checkpoint_serves_its_text_part(tmp_path):
    """Gemma3ForConditionalGeneration saved by transformers (`language_model.model.*`, a vision tower and a
    projector): we load the text weights only, and give its text-only logits."""
    from transformers import Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = Gemma3TextConfig(
        vocab_size=400,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=GEMMA3_LAYERS,
        sliding_window=8,
        query_pre_attn_scalar=16,
        initializer_range=0.2,
    )
    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=399,
        boi_token_index=397,
        eoi_token_index=398,
    )
    torch.manual_seed(34)
    Gemma3ForConditionalGeneration(config).eval().save_pretrained(tmp_path / "mm")
    build_tiny_tokenizer(tmp_path / "mm")
    ours = load_model(tmp_path / "mm", dtype="float32")
    hf = Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "mm", dtype=torch.float32).eval()
    assert ours.model.args.windowed_layers == (0, 2)
    tol = checks.LOGITS_TOLERANCE
    torch.testing.assert_close(_logits_in_chunks(ours.model, CONTEXT), _reference(hf, CONTEXT), rtol=tol, atol=tol)


def test_greedy_speculation_with_a_gemma3_draft_is_exact_past_the_window(gemma):
    """Plain decoding against a target verifying a perturbed Gemma 3 draft's proposals, 32 tokens past prompts of
    up to 20: rollbacks of rejected drafts in both models' rings, which wrap (8 + 2 * 16 positions)."""
    rate = checks.greedy_acceptance(gemma, perturbed(gemma.model, 0.1, seed=35), k=3)
    assert 0.0 < rate < 1.0, rate


SAMPLED, SAMPLES = checks.SAMPLED, checks.SAMPLES  # what `checks.sampled_counts` samples with
PROMPT = [(5 * i * i + i + 7) % 380 for i in range(44)]  # past the ring: 44 > 8 + 2 * 16


def _exact_law(model) -> dict[tuple[int, ...], float]:
    """P(t1 t2 t3) = prod p(t_i | PROMPT, t_<i), enumerated prefix by prefix (as test_statistical.py does)."""
    runner = ModelRunner(model, RunnerConfig(num_slots=1, max_seq_len=64))
    law = {(): 1.0}
    for _ in range(SAMPLED["max_tokens"]):
        grown = {}
        for prefix, mass in law.items():
            slot = runner.allocate()
            logits = runner.extend([slot], [PROMPT + list(prefix)]).double()  # [1, V]
            runner.release(slot)
            p = processed_probs(logits, torch.tensor([1.0]), torch.tensor([3]), torch.tensor([1.0]))[0]
            for token in torch.nonzero(p).flatten().tolist():
                grown[prefix + (token,)] = mass * p[token].item()
        law = grown
    return law


def test_sampling_with_a_gemma3_draft_follows_the_target(gemma):
    """Seeded requests after a prompt past the ring, k = 2: the outputs follow the target's exact law (chi-square),
    and the same counts reject the draft's law, so the test can tell the two apart."""
    draft = perturbed(gemma.model, 0.1, seed=36)
    counts, acceptance = checks.sampled_counts(gemma, draft, PROMPT)
    assert 0.2 < acceptance < 0.95, acceptance
    assert chi_square_p_value(counts, _exact_law(gemma.model), SAMPLES) > 1e-3
    assert chi_square_p_value(counts, _exact_law(draft), SAMPLES) < 1e-6
