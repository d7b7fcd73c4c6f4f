"""Loading models and the draft/target tokenizer compatibility check."""

from __future__ import annotations

import json

import pytest
import torch

from specdec_core.build import load_pair
from specdec_core.errors import InvalidArgument, ModelNotFound, TokenizerMismatch
from specdec_core.models.loader import check_tokenizers_compatible, load_model, parse_dtype
from specdec_core.models.tiny import build_tiny_model


def test_padded_embeddings_share_a_tokenizer(tiny_dir):
    # target has 400 embedding rows, draft 384: same tokenizer, so compatible (as between Qwen2 sizes).
    target, draft = load_pair(str(tiny_dir / "target"), str(tiny_dir / "draft"), dtype="float32")
    assert target.model.vocab_size != draft.model.vocab_size


def _swap_two_tokens(path):
    data = json.loads((path / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (path / "tokenizer.json").write_text(json.dumps(data))
    return a


def test_mismatched_tokenizers_fail_at_load_time(tmp_path, tiny_dir):
    other = build_tiny_model(tmp_path / "other", seed=5, tokenizer_dir=tiny_dir / "tokenizer")
    token = _swap_two_tokens(other)
    with pytest.raises(TokenizerMismatch, match="differ") as err:
        load_pair(str(tiny_dir / "target"), str(other), dtype="float32")
    assert repr(token) in str(err.value) or "token" in str(err.value)


def test_tokenizers_of_different_size_fail(tiny_dir):
    a = load_model(tiny_dir / "target", dtype="float32").tokenizer
    b = load_model(tiny_dir / "draft", dtype="float32").tokenizer
    b.add_tokens(["<extra_token>"])
    with pytest.raises(TokenizerMismatch, match="size"):
        check_tokenizers_compatible(a, b)


def test_missing_path_and_unknown_name_are_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    with pytest.raises(ModelNotFound, match="no-such-model"):
        load_model("no-such-model")
    with pytest.raises(ModelNotFound, match="config.json"):
        load_model(tmp_path)
    with pytest.raises(ModelNotFound, match="pull"):
        load_model("qwen2.5-coder-0.5b-instruct")  # known, not pulled into this empty home


def test_dtype_is_validated():
    assert parse_dtype("bf16") is torch.bfloat16
    with pytest.raises(InvalidArgument, match="dtype"):
        parse_dtype("int3")


def test_loads_in_each_dtype(tiny_dir):
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        model = load_model(tiny_dir / "llama", dtype=name).model
        assert next(model.parameters()).dtype is dtype


def test_loads_a_gguf_file(tmp_path):
    from specdec_core.models.tiny import build_tiny_gguf

    gguf = build_tiny_gguf(tmp_path / "tiny.gguf")
    loaded = load_model(gguf, dtype="float32")
    assert loaded.model.vocab_size > 0 and loaded.tokenizer("def f():")["input_ids"]


def test_gguf_files_serve_as_target_and_draft(tmp_path):
    from specdec_core.models.tiny import build_tiny_gguf

    target = build_tiny_gguf(tmp_path / "target.gguf", seed=1)
    draft = build_tiny_gguf(tmp_path / "draft.gguf", seed=2, hidden_size=32, num_layers=1)
    loaded_target, loaded_draft = load_pair(str(target), str(draft), dtype="float32")
    assert loaded_draft is not None and (loaded_target.path, loaded_draft.path) == (target, draft)
    assert loaded_draft.model.args.hidden_size == 32 != loaded_target.model.args.hidden_size
