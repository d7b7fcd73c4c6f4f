"""Our Llama-family transformer against transformers' own implementation, on tiny random models."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec_core.models.loader import load_model
from specdec_core.models.tiny import build_tiny_model
from specdec_core.runner import ModelRunner, RunnerConfig


@pytest.mark.parametrize(
    "family,tie,kv_heads", [("llama", False, 2), ("qwen2", False, 1), ("qwen2", True, 4), ("llama", True, 4)]
)
def test_logits_match_transformers(tmp_path, tiny_dir, family, tie, kv_heads):
    path = build_tiny_model(
        tmp_path / "m",
        family=family,
        seed=11,
        tie_word_embeddings=tie,
        num_kv_heads=kv_heads,
        tokenizer_dir=tiny_dir / "tokenizer",
    )
    ours = load_model(path, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.tensor([[3, 77, 12, 5, 200, 41, 9, 150, 7, 7, 2]])
    with torch.inference_mode():
        expected = hf(tokens).logits[0]  # [T, V]
    runner = ModelRunner(ours.model, RunnerConfig(num_slots=1, max_seq_len=64))
    slot = runner.allocate()
    got = torch.cat(
        [
            runner.extend([slot], [tokens[0, :6].tolist()], all_logits=True)[0],
            runner.extend([slot], [tokens[0, 6:].tolist()], all_logits=True)[0],
        ]
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
