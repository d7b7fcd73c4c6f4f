"""The CPU kernels in a Gemma 3 model, as `prepare_model` puts them in: the linear layers only. Its windowed
attention, (1 + weight) norms, GeGLU and sandwich layers are not what the kernels compute, so they stay on torch's
code paths, and greedy output is what the torch path gives."""

from __future__ import annotations

import pytest

from specdec_core.build import DraftSpec, build_engine, load_pair, prepare_model
from specdec_core.config import SamplingParams
from specdec_core.kernels.linear import FastCPULinear, Int4CPULinear
from specdec_core.kernels.report import kernel_path, rows_batch_invariant
from specdec_core.models.loader import load_model
from specdec_core.models.transformer import TorchAttention, run_in_turn
from specdec_core.models.variants import GatedMLP, SandwichDecoderLayer, UnitOffsetRMSNorm
from tests.helpers import build_tiny_gemma3, one_torch_thread, run_to_completion
from tests.specdec_core.kernels.marks import needs_kernels

pytestmark = needs_kernels

PROMPTS = ["def add(a, b):", "The quick brown fox", "for index, value in enumerate(range(10)):\n    print("]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models are thousands of small ops: a second thread only contends for the cores (`one_torch_thread`)."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def gemma_dir(tiny_dir, tmp_path_factory):
    return build_tiny_gemma3(tmp_path_factory.mktemp("gemma3_kernels") / "m", tiny_dir / "tokenizer", seed=51)


def test_only_the_linear_layers_go_to_the_kernels(gemma_dir):
    model = prepare_model(gemma_dir, dtype="bfloat16").model
    assert type(model.attention) is TorchAttention and model.run_layers is run_in_turn
    assert kernel_path(model).endswith(" + torch attention") and not rows_batch_invariant(model)
    for layer in model.layers:
        assert type(layer) is SandwichDecoderLayer and type(layer.mlp) is GatedMLP
        norms = [layer.input_layernorm, layer.post_feedforward_layernorm, layer.self_attn.q_norm, model.norm]
        assert all(type(norm) is UnitOffsetRMSNorm for norm in norms)
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        assert all(type(linear) is FastCPULinear for linear in linears)


def test_greedy_output_with_the_kernels_is_the_torch_paths(gemma_dir):
    """40 tokens a prompt, past the window (8) and the rings (8 + 2 * 16)."""
    fast, plain = prepare_model(gemma_dir, dtype="bfloat16"), load_model(gemma_dir, dtype="bfloat16")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for text in PROMPTS:
        prompt = fast.tokenizer(text)["input_ids"]
        outputs = [
            run_to_completion(build_engine(loaded, None, DraftSpec(method="none")), [("r", prompt, params, 0)])
            for loaded in (fast, plain)
        ]
        assert outputs[0]["r"][0] == outputs[1]["r"][0], text


def test_greedy_speculation_on_the_kernels_with_a_4_bit_draft_is_exact(gemma_dir):
    """The target's linears on the bf16 kernels, its own 4-bit copy as the draft."""
    target, draft = load_pair(str(gemma_dir), str(gemma_dir), draft_quantization="int4")
    assert any(type(m) is Int4CPULinear for m in draft.model.modules())
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = target.tokenizer(PROMPTS[0])["input_ids"]
    plain = run_to_completion(build_engine(target, None, DraftSpec(method="none")), [("r", prompt, params, 0)])
    spec = run_to_completion(build_engine(target, draft, DraftSpec()), [("r", prompt, params, 3)])
    assert spec["r"][0] == plain["r"][0]
    assert 0 < spec["r"][2].stats.accepted < spec["r"][2].stats.proposed
