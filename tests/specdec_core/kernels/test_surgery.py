"""The kernels put into a built model (`surgery.py`): in place, agreeing with torch, and exact where speculation
needs it (verify against decode, a cached prefix against a full prefill, a quantized draft's greedy output)."""

from __future__ import annotations

import pytest
import torch

from specdec_core.kernels import library
from specdec_core.kernels.layers import FastMLP, FusedAttention
from specdec_core.kernels.linear import Int4CPULinear, Int8CPULinear
from specdec_core.models.transformer import TorchAttention
from specdec_core.runner import ModelRunner, RunnerConfig
from tests.specdec_core.kernels.marks import close, needs_kernels

pytestmark = needs_kernels


def test_kernels_are_in_place_and_agree_with_torch(bf16_pair):
    fast, plain = bf16_pair
    assert not isinstance(fast.model.attention, TorchAttention)
    layer = fast.model.layers[0]
    assert isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FastMLP)
    assert isinstance(plain.model.attention, TorchAttention)
    tokens = [3, 77, 12, 5, 200, 41, 9, 150, 7]
    outs = []
    for loaded in bf16_pair:
        runner = ModelRunner(loaded.model, RunnerConfig(num_slots=1, max_seq_len=64))
        slot = runner.allocate()
        outs.append(runner.extend([slot], [tokens], all_logits=True)[0])
    close(outs[0], outs[1], 3e-2)


def test_verify_reproduces_decode_bit_for_bit(bf16_pair):
    """The property that makes greedy speculation exact in bf16: scoring k+1 tokens at once gives each position
    the very logits that decoding it alone gives."""
    fast, _ = bf16_pair
    runner = ModelRunner(fast.model, RunnerConfig(num_slots=2, max_seq_len=64))
    prompt, tail = [5, 9, 31, 77, 2, 140], [12, 240, 8, 99]
    one, many = runner.allocate(), runner.allocate()
    runner.extend([one], [prompt])
    runner.extend([many], [prompt])
    decoded = [runner.extend([one], [[t]])[0] for t in tail]  # T = 1, four times
    verified = runner.extend([many], [tail], all_logits=True)[0]  # T = 4, once
    for i, row in enumerate(decoded):
        assert torch.equal(row, verified[i]), i


def test_a_prefill_from_cached_positions_gives_a_full_prefills_logits_bit_for_bit(bf16_pair):
    """The property that makes prefix caching exact in bf16: keys written by a prefill, a verify and decode steps,
    then copied into another slot (or taken over in place), give the rest of a prompt the very logits a full
    prefill gives it."""
    fast, _ = bf16_pair
    prompt, rest = [5, 9, 31, 77, 2, 140, 12, 240], [8, 99, 3, 17]
    reference = ModelRunner(fast.model, RunnerConfig(num_slots=1, max_seq_len=64))
    want = reference.extend([reference.allocate()], [prompt + rest], all_logits=True)[0, len(prompt) :]  # [4, V]
    for running in (True, False):  # copied from a running sequence's slot; taken over from an ended one's entry
        runner = ModelRunner(fast.model, RunnerConfig(num_slots=3, max_seq_len=64, prefix_caching=True))
        source = runner.allocate()
        runner.extend([source], [prompt[:3]])  # a prefill
        runner.extend([source], [prompt[3:6]], all_logits=True)  # a verify of three rows
        for token in prompt[6:]:  # decode steps
            runner.extend([source], [[token]])
        if not running:
            runner.release(source)
        slot = runner.allocate(prompt + rest[:-1])
        assert runner.length(slot) == len(prompt) and (slot == source) is not running
        assert torch.equal(runner.extend([slot], [rest], all_logits=True)[0], want)


@pytest.mark.parametrize("vocabulary", [0, 128])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_greedy_speculation_with_a_quantized_draft_is_exact_in_bf16(tiny_dir, quantization, vocabulary):
    """Also with the draft's head cut to its first 128 ids and the contexts' (`models.vocab_head`): the kept
    rows go to the same kernel as every other linear layer."""
    from specdec_core.build import DraftSpec, build_engine, load_pair
    from specdec_core.config import SamplingParams
    from specdec_core.models.vocab_head import VocabHead
    from tests.helpers import run_to_completion

    if quantization == "int8" and not library.load_library().specdec_has_int8():
        pytest.skip("AVX-512 kernels have the int8 draft kernel only with VNNI")
    target, draft = load_pair(
        str(tiny_dir / "target"), str(tiny_dir / "target"), draft_quantization=quantization, draft_vocabulary=vocabulary
    )
    layer = {"int8": Int8CPULinear, "int4": Int4CPULinear}[quantization]
    assert any(isinstance(m, layer) for m in draft.model.modules())
    head = draft.model.lm_head
    assert (type(head) is VocabHead and type(head.head) is layer) == (vocabulary > 0)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = target.tokenizer("def add(a, b):")["input_ids"]
    plain = run_to_completion(build_engine(target, None, DraftSpec(method="none")), [("r", prompt, params, 0)])
    spec = run_to_completion(build_engine(target, draft, DraftSpec()), [("r", prompt, params, 3)])
    assert spec["r"][0] == plain["r"][0]
    assert spec["r"][2].stats.accepted > 0
