"""Structured output is optional per model: a tokenizer the grammar engine cannot read leaves it unavailable, with
a reason each constrained request is refused by, and everything else serving."""

from __future__ import annotations

import logging

import pytest
import tokenizers
import transformers

from specdec_core.config import SamplingParams
from specdec_core.engine import SpecEngine
from specdec_core.errors import InvalidArgument
from specdec_core.grammar.compiler import GrammarCompiler, NoGrammars, grammar_compiler
from specdec_core.grammar.constraint import Constraint
from specdec_core.request import Request
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.stopping import FinishReason
from specdec_core.target import LocalTarget

SCHEMA = Constraint("json_schema", '{"type": "object"}')
EOS_ID = 1


def wordlevel_tokenizer(vocab_size: int = 400) -> transformers.PreTrainedTokenizerFast:
    """A WordLevel tokenizer with no decoder, one word per id (`<unk>`, `<eos>`, then w2, w3, ...): transformers
    encodes and decodes with it, llguidance cannot tell what bytes its tokens stand for."""
    vocab = {"<unk>": 0, "<eos>": EOS_ID} | {f"w{i}": i for i in range(2, vocab_size)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")


def test_the_grammar_engine_cannot_read_a_wordlevel_tokenizer_without_a_decoder():
    tokenizer = wordlevel_tokenizer()
    assert tokenizer.decode(tokenizer("w5 w6")["input_ids"]) == "w5 w6"  # transformers reads it
    with pytest.raises(ValueError, match="decoder"):
        GrammarCompiler(tokenizer, 400, [EOS_ID])
    grammars = grammar_compiler(tokenizer, 400, [EOS_ID])
    assert isinstance(grammars, NoGrammars) and "decoder" in grammars.why
    with pytest.raises(InvalidArgument) as refused:
        grammars.compile(Constraint("regex", "[0-9]+"))
    assert refused.value.field == "regex" and "structured output is unavailable for this model" in str(refused.value)


def test_an_engine_without_grammars_serves_and_refuses_constrained_requests_saying_why(tiny_target, caplog):
    """The engine comes up and serves a plain request; each constrained one is refused naming its field (the
    constraint's kind), the reason logged once as a WARNING."""
    runner = ModelRunner(tiny_target.model, RunnerConfig(num_slots=2, max_seq_len=64))
    engine = SpecEngine(LocalTarget(runner), None, wordlevel_tokenizer(), frozenset({EOS_ID}))
    with caplog.at_level(logging.WARNING, logger="specdec_core.structured"):
        for seq_id in ("a", "b"):
            with pytest.raises(InvalidArgument) as refused:
                engine.add_request(Request(seq_id, (5, 6, 7), SamplingParams(max_tokens=4, constraint=SCHEMA), 0))
            assert refused.value.field == "json_schema" and "unavailable for this model" in refused.value.message
            assert "decoder" in refused.value.message
    assert [r.levelno for r in caplog.records if "structured requests are refused" in r.message] == [logging.WARNING]
    engine.add_request(Request("plain", (5, 6, 7), SamplingParams(max_tokens=4, ignore_eos=True), 0))
    outputs = [out for _ in range(10) if engine.has_work for out in engine.step()]
    assert outputs[-1].finish_reason == FinishReason.LENGTH and sum(len(o.new_token_ids) for o in outputs) == 4
