"""The tiny byte-level tokenizer (384 ids: 3 special, 256 bytes, merges), compiled for a model of 400 ids: the
16 ids past the tokenizer are padding in the model's vocabulary, as `tiny_dir`'s target has (a model's logits may
be wider than its tokenizer)."""

from __future__ import annotations

import pytest

from specdec_core.grammar.compiler import GrammarCompiler
from specdec_core.models.tiny import EOS_TOKEN, PAD_TOKEN, build_tiny_tokenizer

MODEL_VOCAB = 400


@pytest.fixture(scope="session")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def compiler(tokenizer) -> GrammarCompiler:
    """Two stop tokens, as an instruct model has (<|im_end|>, <|endoftext|>)."""
    eos = tokenizer.convert_tokens_to_ids([EOS_TOKEN, PAD_TOKEN])
    return GrammarCompiler(tokenizer, MODEL_VOCAB, eos)
