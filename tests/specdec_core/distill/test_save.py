"""A trained draft is written as a model directory the loader and `prepare_draft` take like any other."""

from __future__ import annotations

import pytest
import torch

from specdec_core.build import prepare_draft
from specdec_core.distill.save import write_draft
from specdec_core.models.loader import load_model
from specdec_core.models.tiny import build_tiny_model


@pytest.mark.parametrize("tied", [False, True])
def test_the_written_directory_loads_with_the_trained_weights(tiny_dir, tmp_path, tied):
    source_dir = build_tiny_model(
        tmp_path / "source",
        family="qwen2",
        seed=4,
        tokenizer_dir=tiny_dir / "tokenizer",
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        tie_word_embeddings=tied,
    )
    source = load_model(source_dir, dtype="float32")
    with torch.no_grad():
        for p in source.model.parameters():
            p.add_(0.01)  # "trained": no weight is the source's any more
    out = write_draft(source.model, source, tmp_path / "out")
    loaded = load_model(out, dtype="float32")
    want, got = source.model.state_dict(), loaded.model.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[n], got[n]) for n in want)
    assert (loaded.model.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    target = load_model(tiny_dir / "target", dtype="float32")
    draft = prepare_draft(out, target.tokenizer, dtype="float32")  # the tokenizer check passes
    assert draft.eos_token_ids == source.eos_token_ids


def test_rewriting_replaces_the_weights(tiny_dir, tmp_path):
    source = load_model(tiny_dir / "draft", dtype="float32")
    out = write_draft(source.model, source, tmp_path / "out")
    with torch.no_grad():
        source.model.norm.weight.mul_(2)
    write_draft(source.model, source, out)
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    assert torch.equal(load_model(out, dtype="float32").model.norm.weight, source.model.norm.weight)
