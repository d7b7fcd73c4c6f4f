"""Shared fixtures: tiny random-weight models built locally (no test downloads anything)."""

from __future__ import annotations

from pathlib import Path

import pytest
from specdec_core.models.loader import LoadedModel, load_model
from specdec_core.models.tiny import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A directory holding a shared tokenizer and several tiny models built from it."""
    root = tmp_path_factory.mktemp("tiny")
    build_tiny_tokenizer(root / "tokenizer")
    build_tiny_model(root / "target", family="qwen2", seed=1, tokenizer_dir=root / "tokenizer", vocab_size=400)
    build_tiny_model(root / "draft", family="qwen2", seed=2, tokenizer_dir=root / "tokenizer",
                     hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=384)
    build_tiny_model(root / "llama", family="llama", seed=3, tokenizer_dir=root / "tokenizer")
    return root


@pytest.fixture(scope="session")
def tiny_target(tiny_dir) -> LoadedModel:
    return load_model(tiny_dir / "target", dtype="float32")


@pytest.fixture(scope="session")
def tiny_draft(tiny_dir) -> LoadedModel:
    return load_model(tiny_dir / "draft", dtype="float32")
