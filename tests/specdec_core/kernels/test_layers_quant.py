"""A model's layers in one C call (bf16, 4-bit or int8 linears): bit for bit the module-by-module forward, the
cache written the same."""

from __future__ import annotations

import pytest
import torch

from specdec_core.build import prepare_model
from specdec_core.kernels import fbgemm_rows, layers_quant, library, surgery
from specdec_core.kernels.layers import CPUAttention
from specdec_core.kernels.linear import FastCPULinear, Int4CPULinear, Int8CPULinear
from specdec_core.models.transformer import run_in_turn
from specdec_core.runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.skipif(
    library.load_library() is None, reason="CPU kernels need AVX-512 or AVX2 with FMA, and a C compiler"
)


@pytest.fixture(scope="module", params=["none", "int4", "int8"])
def quantized(request, tiny_dir):
    """The tiny target as prepared with `quantization` none (bf16 linears), int4 or int8."""
    if request.param == "int8" and not library.load_library().specdec_has_int8():
        pytest.skip("AVX-512 kernels have the int8 draft kernel only with VNNI")
    return prepare_model(tiny_dir / "target", dtype="bfloat16", quantization=request.param).model


class _Loop:
    """The module-by-module forward, counting the calls it takes."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, layers, x, ctx):
        self.calls += 1
        return run_in_turn(layers, x, ctx)


def _runner(model) -> ModelRunner:
    return ModelRunner(model, RunnerConfig(num_slots=4, max_seq_len=256))


def _bits(model) -> set[int]:
    return {layer.qkv.bits for layer in model.run_layers._layers} | {
        layer.down.bits for layer in model.run_layers._layers
    }


def test_installed_for_the_kind_every_linear_has(tiny_dir, quantized):
    assert isinstance(quantized.run_layers, layers_quant.QuantLayers)
    assert _bits(quantized) == {
        {FastCPULinear: 16, Int4CPULinear: 4, Int8CPULinear: 8}[type(quantized.layers[0].mlp.down_proj)]
    }
    # The tiny draft's hidden size (32) is no multiple of the 4-bit kernel's 64: only its down projections (64 in)
    # are quantized, the other linears stay bf16, and the one call built over bf16 layers goes back to the loop.
    draft = prepare_model(tiny_dir / "draft", dtype="bfloat16", quantization="int4").model
    kinds = {type(draft.layers[0].mlp.down_proj), type(draft.layers[0].self_attn.qkv_proj)}
    assert kinds == {Int4CPULinear, FastCPULinear} and draft.run_layers is run_in_turn


def test_quantizing_rebuilds_the_one_call_over_the_new_linears(tiny_dir):
    model = prepare_model(tiny_dir / "target", dtype="bfloat16").model
    assert _bits(model) == {16}
    surgery.quantize_draft_int4(model)
    assert _bits(model) == {4}  # a one call over the bf16 weights would run the model it replaced
    assert model.run_layers.fallback is run_in_turn


def test_not_installed_on_a_tensor_parallel_shard(tiny_dir):
    # Its row-parallel layers all-reduce between ranks: the C layers know nothing of that.
    model = prepare_model(tiny_dir / "target", dtype="bfloat16", shard=(0, 2)).model
    assert isinstance(model.attention, CPUAttention) and model.run_layers is run_in_turn


def test_steps_and_cache_are_those_of_the_layer_by_layer_forward(quantized):
    """Two slots fed the same tokens, one through each path, step by step at the widths drafts and verifies use:
    every step's logits equal, and so is every key and value written."""
    fused = quantized.run_layers
    runner = _runner(quantized)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, quantized.vocab_size, (60,), generator=gen).tolist()
    a, b = runner.allocate(), runner.allocate()
    at = 0
    try:
        for width in (3, 1, 1, 2, 4, 1, 3, 2, 1):
            feed = tokens[at : at + width]
            quantized.run_layers = run_in_turn
            want = runner.extend([a], [feed], all_logits=True)  # [1, width, V]
            quantized.run_layers = fused
            got = runner.extend([b], [feed], all_logits=True)
            assert torch.equal(got, want), width
            at += width
    finally:
        quantized.run_layers = fused
    for keys, values in zip(runner.cache.keys, runner.cache.values):  # [slots, Hkv, capacity, hd]
        assert torch.equal(keys[a, :, :at], keys[b, :, :at]) and torch.equal(values[a, :, :at], values[b, :, :at])
        assert keys[a, :, :at].abs().sum() > 0


def test_a_batch_of_rows_of_different_lengths_matches(quantized):
    fused = quantized.run_layers
    runner = _runner(quantized)
    prompts = [[5, 9, 14, 30, 2, 8], [7, 3], [11, 12, 13, 40, 41]]
    slots = [runner.allocate() for _ in prompts]
    for slot, prompt in zip(slots, prompts):
        runner.extend([slot], [prompt])
    feeds = [[21], [22, 23], [24]]  # padded to 2 a row: 6 rows, past FROM_ROWS where fbgemm takes them
    lengths = [runner.length(s) for s in slots]
    outs = []
    for run_layers in (run_in_turn, fused):
        quantized.run_layers = run_layers
        outs.append(runner.extend(slots[:2], feeds[:2], all_logits=True))  # 4 rows: one call
        outs.append(runner.extend(slots, feeds, all_logits=True))
        for slot, length in zip(slots, lengths):
            runner.truncate(slot, length)
    quantized.run_layers = fused
    assert torch.equal(outs[2], outs[0]) and torch.equal(outs[3], outs[1])


def test_rows_that_fbgemm_takes_go_through_the_loop(quantized):
    down = quantized.layers[0].mlp.down_proj
    if not getattr(down, "fbgemm_rows", False):
        pytest.skip("int8 weights, or no fbgemm here: the one call takes every width")
    # The one call takes what the int8 kernel takes (in C too), or what the 4-bit kernel takes.
    most = fbgemm_rows.INT8_KERNEL_MAX_ROWS if down.int8_kernel else fbgemm_rows.FROM_ROWS - 1
    fused = quantized.run_layers
    loop = _Loop()
    quantized.run_layers = layers_quant.QuantLayers(quantized, library.load_library(), quantized.attention, loop, 4)
    try:
        runner = _runner(quantized)
        slot = runner.allocate()
        runner.extend([slot], [list(range(1, most + 1))])
        assert loop.calls == 0
        runner.truncate(slot, 0)
        runner.extend([slot], [list(range(1, most + 2))])
        assert loop.calls == 1
    finally:
        quantized.run_layers = fused


def test_the_one_call_runs_many_rows_on_the_int8_kernel_as_the_layers_do(quantized):
    """A 4-bit model's calls of FROM_ROWS rows and more in one C call take the same kernel as its modules' calls
    (the int8 kernel with VNNI): bit for bit the loop's logits at every width up to the one call's limit."""
    down = quantized.layers[0].mlp.down_proj
    if not getattr(down, "int8_kernel", False):
        pytest.skip("no int8 kernel for a 4-bit model's rows here (int8 or bf16 weights, or no VNNI)")
    fused = quantized.run_layers
    runner = _runner(quantized)
    slot = runner.allocate()
    runner.extend([slot], [[3, 1, 4]])
    outs = {}
    for name, run_layers in (("loop", run_in_turn), ("fused", fused)):
        quantized.run_layers = run_layers
        outs[name] = [runner.extend([slot], [list(range(5, 5 + n))], all_logits=True) for n in (4, 5, 9, 40)]
        for _ in outs[name]:
            runner.truncate(slot, 3)
    quantized.run_layers = fused
    assert all(torch.equal(a, b) for a, b in zip(outs["loop"], outs["fused"]))
    assert not torch.equal(outs["fused"][1][0, :4], outs["fused"][0][0])  # 5 rows: not the 4-bit kernel
