"""LoRA through peft on the served model class: adapters on the projections only, merged into plain weights."""

from __future__ import annotations

import torch

from specdec_core.distill.forward import logits_at, use_causal_attention
from specdec_core.distill.lora import merged, projection_names, trainable
from specdec_core.models.loader import load_model
from specdec_core.models.transformer import Transformer


def _draft(tiny_dir):
    return use_causal_attention(load_model(tiny_dir / "draft", dtype="float32").model)


def test_adapters_sit_on_every_projection_of_the_layers(tiny_dir):
    assert projection_names(_draft(tiny_dir)) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]


def test_under_lora_only_the_adapters_learn(tiny_dir):
    module = trainable(_draft(tiny_dir), rank=4)
    base = {n: p.detach().clone() for n, p in module.named_parameters() if "lora_" not in n}
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):  # lora_B starts at 0: the second step is the first that moves lora_A
        optimizer.zero_grad()
        logits_at(module, [list(range(3, 20))], [list(range(17))]).logsumexp(-1).mean().backward()
        optimizer.step()
    params = dict(module.named_parameters())
    assert all("lora_" in n for n, p in params.items() if p.requires_grad)
    assert all(params[n].grad is None and torch.equal(params[n], before) for n, before in base.items())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in params.items() if "lora_" in n)


def test_merged_weights_compute_what_the_adapters_did(tiny_dir):
    rows, picks = [list(range(3, 20))], [list(range(17))]
    draft = _draft(tiny_dir)
    with torch.no_grad():
        original = logits_at(draft, rows, picks)
    module = trainable(draft, rank=4)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.1)
    with torch.no_grad():
        with_adapters = logits_at(module, rows, picks)
        assert not torch.allclose(with_adapters, original, atol=1e-3)  # the adapters change the output
        plain = merged(module)
        assert type(plain) is Transformer and not any("lora" in n for n, _ in plain.named_parameters())
        torch.testing.assert_close(logits_at(plain, rows, picks), with_adapters, rtol=1e-4, atol=1e-4)


def test_rank_zero_trains_every_weight(tiny_dir):
    module = trainable(_draft(tiny_dir), rank=0)
    assert isinstance(module, Transformer) and all(p.requires_grad for p in module.parameters())


def test_adapters_start_from_the_seed(tiny_dir):
    def adapters(seed):
        return {
            n: p.detach().clone()
            for n, p in trainable(_draft(tiny_dir), 4, seed=seed).named_parameters()
            if "lora_A" in n
        }

    first, again, other = adapters(1), adapters(1), adapters(2)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not all(torch.equal(first[n], other[n]) for n in first)
