"""The CPU kernels in Qwen3, Qwen3-MoE and Mixtral models, as `prepare_model` puts them in: the linears, norms (the
per-head q/k norms among them) and attention go to the kernels; the experts' routing stays on torch, each expert's
MLP on the kernels; the one-call layer path (`layers_quant`), which knows neither, is not taken."""

from __future__ import annotations

import pytest
import torch

from specdec_core.build import DraftSpec, build_engine, load_pair, prepare_model
from specdec_core.config import SamplingParams
from specdec_core.kernels.layers import CPUAttention, FastMLP, FastRMSNorm, FusedAttention
from specdec_core.kernels.layers_quant import QuantLayers
from specdec_core.models.loader import load_model
from specdec_core.models.moe import SparseMoE
from specdec_core.models.tiny import build_tiny_model
from specdec_core.models.transformer import run_in_turn
from tests.helpers import logits_after, one_torch_thread, run_to_completion
from tests.specdec_core.kernels.marks import needs_kernels

pytestmark = needs_kernels

FAMILIES = ["qwen3", "qwen3_moe", "mixtral"]
PROMPTS = ["def add(a, b):", "The quick brown fox", "for index, value in enumerate(range(10)):\n    print("]
# bf16 on both paths, rounded differently: where the best two logits are within a few bf16 steps the two may pick
# different tokens, and in a mixture of experts a router near tie sends a token to another expert (measured over
# three seeds: 0-6 of 96 positions per family, against every position for a layer computed wrongly).
AGREEMENT = 0.9


@pytest.fixture(scope="module")
def family_dirs(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("kernel_families")
    return {f: build_tiny_model(root / f, family=f, seed=41, tokenizer_dir=tiny_dir / "tokenizer") for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_kernels_go_where_they_apply_and_leave_the_rest_on_torch(family_dirs, family):
    model = prepare_model(family_dirs[family], dtype="bfloat16").model
    assert isinstance(model.attention, CPUAttention) and model.run_layers is run_in_turn
    for layer in model.layers:
        attn = layer.self_attn
        assert type(attn) is FusedAttention
        assert (type(attn.q_norm), type(attn.k_norm)) == (
            (FastRMSNorm,) * 2 if model.args.qk_norm else (type(None),) * 2
        )
        if model.args.moe is not None:
            assert type(layer.mlp) is SparseMoE and all(type(e) is FastMLP for e in layer.mlp.experts)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_with_the_kernels_are_those_without(family_dirs, family):
    """The kernels' greedy output, scored token by token by the torch path: the same argmax at nearly every
    position, and logits a bf16 rounding apart."""
    fast = prepare_model(family_dirs[family], dtype="bfloat16")
    plain = load_model(family_dirs[family], dtype="bfloat16")
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    agree, errors = [], []
    for text in PROMPTS:
        prompt = fast.tokenizer(text)["input_ids"]
        with one_torch_thread():
            engine = build_engine(fast, None, DraftSpec(method="none"))
            tokens = run_to_completion(engine, [("r", prompt, params, 0)])["r"][0]
        ours = logits_after(fast.model, prompt + tokens)[len(prompt) - 1 : -1]  # [32, V]: what predicts each
        torch_path = logits_after(plain.model, prompt + tokens)[len(prompt) - 1 : -1]  # [32, V]
        assert ours.argmax(-1).tolist() == tokens  # the engine's greedy tokens are the kernels' argmax
        agree += (torch_path.argmax(-1) == torch.tensor(tokens)).tolist()
        errors += ((ours - torch_path).norm(dim=-1) / torch_path.norm(dim=-1)).tolist()
    assert sum(agree) >= AGREEMENT * len(agree), sum(agree)
    assert torch.tensor(errors).median() < 3e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculation_on_the_kernels_with_a_4_bit_draft_is_exact(family_dirs, family):
    """The target on the bf16 kernels, its own 4-bit copy as the draft (which must not take the one-call path)."""
    path = str(family_dirs[family])
    target, draft = load_pair(path, path, draft_quantization="int4")
    assert not isinstance(draft.model.run_layers, QuantLayers)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    prompt = target.tokenizer(PROMPTS[0])["input_ids"]
    with one_torch_thread():
        plain = run_to_completion(build_engine(target, None, DraftSpec(method="none")), [("r", prompt, params, 0)])
        spec = run_to_completion(build_engine(target, draft, DraftSpec()), [("r", prompt, params, 3)])
    assert spec["r"][0] == plain["r"][0]
    assert spec["r"][2].stats.accepted > 0
