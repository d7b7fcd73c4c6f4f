"""Tiny models: real tokenizer, random but non-degenerate weights, deterministic, fast."""

from __future__ import annotations

import json

import pytest
import torch

from specdec_core.models.tiny import EOS_TOKEN, PAD_TOKEN, build_tiny_gguf, build_tiny_model, build_tiny_tokenizer

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café — ✓ unicode 字 and\ttabs  and  spaces",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_tokenizer_round_trips_and_compresses(tokenizer):
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    code = TEXTS[0]
    assert len(tokenizer.encode(code)) < 0.6 * len(code)  # the merges learned something
    assert 250 <= len(tokenizer) <= 500


def test_tokenizer_specials_and_chat_template(tokenizer, tmp_path):
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token == PAD_TOKEN
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert tokenizer.encode(EOS_TOKEN) == [tokenizer.eos_token_id]  # specials stay whole
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    build_tiny_tokenizer(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.get_vocab() == tokenizer.get_vocab()  # training is deterministic
    assert again.chat_template == tokenizer.chat_template


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_model_builds_and_loads(tmp_path, family, tokenizer):
    from transformers import AutoModelForCausalLM

    # No timing is asserted: on a shared machine a bound on seconds fails for reasons unrelated to the code.
    path = build_tiny_model(tmp_path / "m", family=family, vocab_size=len(tokenizer) + 16)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == family and config["vocab_size"] == len(tokenizer) + 16
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert (path / "tokenizer.json").is_file() and (path / "generation_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.num_hidden_layers == 2 and not model.config.tie_word_embeddings


def test_logits_depend_on_context(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path))
    contexts = torch.randint(0, model.config.vocab_size, (32, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        greedy = model(contexts).logits[:, -1].argmax(-1)  # [32]
    assert len(set(greedy.tolist())) >= 8


def test_seed_determines_weights_and_shared_tokenizer(tmp_path):
    from safetensors.torch import load_file

    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    c = build_tiny_model(tmp_path / "c", seed=4, tokenizer_dir=a, dtype=torch.bfloat16, num_layers=1)
    wa, wb, wc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert wc["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert not torch.equal(wa["model.embed_tokens.weight"].bfloat16(), wc["model.embed_tokens.weight"])
    assert (c / "tokenizer.json").read_text() == (a / "tokenizer.json").read_text()


def test_vocab_smaller_than_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        build_tiny_model(tmp_path, vocab_size=10)
    with pytest.raises(ValueError, match="family"):
        build_tiny_model(tmp_path, family="gpt2")


def test_gguf_loads_with_transformers(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = build_tiny_gguf(tmp_path / "tiny.gguf")
    loaded = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf.name)
    for text in TEXTS:
        assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.eos_token == EOS_TOKEN
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf.name)
    assert model.config.vocab_size == len(tokenizer) and model.config.hidden_size == 64
