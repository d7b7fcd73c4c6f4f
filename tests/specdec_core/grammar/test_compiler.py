"""Constraints and their compilation: what is refused and how it is named, strict against lenient, the cache."""

from __future__ import annotations

import json

import pytest

from specdec_core.errors import InvalidArgument
from specdec_core.grammar.compiler import GrammarCompiler, check
from specdec_core.grammar.constraint import Constraint
from specdec_core.grammar.state import GrammarState


def test_constraint_kinds():
    with pytest.raises(InvalidArgument) as error:
        Constraint("xml", "<a/>")
    assert error.value.field == "constraint" and "json_schema" in error.value.message
    with pytest.raises(InvalidArgument) as error:
        Constraint("regex", "  ")
    assert error.value.field == "regex"
    assert Constraint("json_object").value == ""


REFUSED = [
    # (kind, value, what the message names)
    ("json_schema", '{"type": "integer", "not": {"const": 3}}', '"not"'),
    ("json_schema", '{"type": "array", "uniqueItems": true}', '"uniqueItems"'),
    ("json_schema", '{"if": {"type": "string"}, "then": {"minLength": 2}}', '"if"'),
    ("json_schema", '{"type": "string", "format": "credit-card"}', "credit-card"),
    ("json_schema", '{"$ref": "https://example.com/schema.json"}', "example.com"),
    ("json_schema", '{"type": ', "not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("regex", "[a-", "unclosed character class"),
    ("grammar", "start: item\n", "unknown name"),
    ("grammar", 'root ::= "a" (', "GBNF"),
]


@pytest.mark.parametrize("kind,value,named", REFUSED)
def test_refusals_name_the_kind_and_the_problem(compiler, kind, value, named):
    with pytest.raises(InvalidArgument) as error:
        compiler.compile(Constraint(kind, value))
    assert error.value.field == kind
    assert named in error.value.message, error.value.message
    assert len(error.value.message) <= 400


@pytest.mark.parametrize("kind,value,named", REFUSED)
def test_check_refuses_the_same_without_a_tokenizer(kind, value, named):
    with pytest.raises(InvalidArgument) as error:
        check(Constraint(kind, value))
    assert error.value.field == kind and named in error.value.message
    check(Constraint("json_schema", '{"type": "integer", "not": {"const": 3}}', strict=False))
    check(Constraint("grammar", 'start: "a" <|im_end|>'))  # special tokens: only a compiler knows them


def _takes(compiler, tokenizer, constraint: Constraint, text: str) -> bool:
    """The whole text is a sentence of the constraint: every token taken, then the grammar can end."""
    state = GrammarState(compiler.compile(constraint))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return state.advance(tokens) == len(tokens) and state.can_end()


def test_lenient_schema_drops_what_it_cannot_enforce_and_keeps_the_rest(compiler, tokenizer):
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"n": {"type": "integer", "not": {"const": 3}}},
            "required": ["n"],
            "additionalProperties": False,
        }
    )
    lenient = Constraint("json_schema", schema, strict=False)
    assert _takes(compiler, tokenizer, lenient, '{"n": 3}')  # `not` dropped
    assert not _takes(compiler, tokenizer, lenient, '{"n": "3"}')  # the type still holds
    assert not _takes(compiler, tokenizer, lenient, '{"n": 3, "m": 1}')  # and additionalProperties


def test_a_schema_cannot_turn_strict_checking_off(compiler):
    schema = json.dumps({"type": "integer", "not": {"const": 3}, "x-guidance": {"lenient": True}})
    with pytest.raises(InvalidArgument, match="not"):
        compiler.compile(Constraint("json_schema", schema))


def test_lark_and_gbnf_both_compile(compiler, tokenizer):
    for grammar in ('start: "yes" | "no"', 'root ::= "yes" | "no"'):
        constraint = Constraint("grammar", grammar)
        assert _takes(compiler, tokenizer, constraint, "yes") and _takes(compiler, tokenizer, constraint, "no")
        assert not _takes(compiler, tokenizer, constraint, "yes no")


def test_json_object_is_any_object(compiler, tokenizer):
    constraint = Constraint("json_object")
    assert _takes(compiler, tokenizer, constraint, '{"a": [1, 2.5, {"b": null}], "c": "x"}')
    assert not _takes(compiler, tokenizer, constraint, "[1, 2]")


def test_compiled_grammars_are_cached_lru(tokenizer):
    compiler = GrammarCompiler(tokenizer, 400, [2], cache_size=2)
    a, b, c = (Constraint("regex", r) for r in ("a+", "b+", "c+"))
    first_a = compiler.compile(a)
    first_b = compiler.compile(b)
    assert compiler.compile(a) is first_a  # a is now the most recent
    compiler.compile(c)  # evicts b, the least recently used
    assert compiler.compile(a) is first_a
    assert compiler.compile(b) is not first_b
    assert compiler.compile(Constraint("regex", "a+", strict=False)) is not first_a  # strict is part of the key


def test_vocabulary_and_eos_checks(tokenizer):
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        GrammarCompiler(tokenizer, 300, [2])
    with pytest.raises(ValueError, match="eos"):
        GrammarCompiler(tokenizer, 400, [])


def test_compact_json_takes_no_whitespace_unless_the_schema_asks(compiler, tokenizer):
    """The served APIs' default: a model cannot write whitespace until max_tokens; a schema may still ask for it."""
    for constraint in (
        Constraint("json_object", compact=True),
        Constraint("json_schema", json.dumps({"type": "object"}), compact=True),
    ):
        assert _takes(compiler, tokenizer, constraint, '{"a":[1,{"b":null}],"c":"x y"}')
        assert not _takes(compiler, tokenizer, constraint, '{"a": 1}')
        assert not _takes(compiler, tokenizer, constraint, '{"a":1 }')
    flexible = json.dumps({"type": "object", "x-guidance": {"whitespace_flexible": True}})
    assert _takes(compiler, tokenizer, Constraint("json_schema", flexible, compact=True), '{"a": 1 }')
    spaced = json.dumps({"type": "object", "x-guidance": {"item_separator": ", ", "key_separator": ": "}})
    assert _takes(compiler, tokenizer, Constraint("json_schema", spaced, compact=True), '{"a": 1, "b": 2}')
