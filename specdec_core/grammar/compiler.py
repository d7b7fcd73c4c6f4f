"""Constraints compiled for one tokenizer, with llguidance (the grammar engine; `docs/engine.md` says why this one).

The tokenizer's side (every token's bytes, arranged for fast masking) is built once per `GrammarCompiler`, which takes
seconds at a large vocabulary, so an engine builds one compiler and keeps it. A compiled grammar is a pristine
matcher; each sequence's `GrammarState` runs on a copy of it (a copy is far cheaper than a compile), so
compiled grammars are kept in a small LRU keyed by the constraint.

Structured output is optional per model: the grammar engine must read every token's bytes from the tokenizer, and
some tokenizers it cannot read (a WordLevel tokenizer without a decoder, which transformers and the engine handle
fine). `grammar_compiler` then gives `NoGrammars`, which refuses each constraint saying why, and everything else
serves as before.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # the stubs' TypedDict (not exported at run time)
import llguidance.hf

from specdec_core.errors import InvalidArgument
from specdec_core.grammar.constraint import Constraint

logger = logging.getLogger(__name__)

_MAX_MESSAGE = 400  # llguidance's errors can quote the whole grammar: the reply names the problem, not the input


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint ready to match, for one tokenizer and one model vocabulary size."""

    constraint: Constraint
    matcher: Any  # llguidance.LLMatcher in its initial state: never advanced, only copied (`GrammarState`)
    tokenizer_vocab_size: int  # ids the tokenizer has, and the grammar engine masks
    vocab_size: int  # V, the model's: ids in [tokenizer_vocab_size, V) exist in its logits only, never allowed
    eos_token_ids: tuple[int, ...]  # allowed exactly where the grammar can end


class GrammarCompiler:
    """Compiles `Constraint`s for one tokenizer; thread-safe, so requests may compile as they arrive."""

    def __init__(
        self,
        tokenizer: Any,  # a Hugging Face fast tokenizer (`LoadedTokenizer.tokenizer`)
        vocab_size: int,  # V: the width of the logits the masks apply to
        eos_token_ids: Sequence[int],  # the tokens that end the output (the engine's stop tokens)
        cache_size: int = 64,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("a grammar needs at least one eos token id to end on")
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=list(eos_token_ids))
        if vocab_size < self._tokenizer.vocab_size:
            # Tokens the model cannot produce may be the only ones a grammar allows: refuse rather than mask to nothing.
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {self._tokenizer.vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._cache: OrderedDict[Constraint, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar of `constraint`; `InvalidArgument(constraint.kind, why)` if it does not compile."""
        with self._lock:
            if constraint in self._cache:
                self._cache.move_to_end(constraint)
                return self._cache[constraint]
        compiled = CompiledGrammar(
            constraint, self._matcher(constraint), self._tokenizer.vocab_size, self.vocab_size, self.eos_token_ids
        )
        with self._lock:
            self._cache[constraint] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _matcher(self, constraint: Constraint) -> Any:
        try:
            grammar = _grammar_text(constraint)
        except InvalidArgument:
            raise
        except ValueError as e:  # llguidance's own refusals (a GBNF grammar it cannot convert)
            raise InvalidArgument(constraint.kind, _short(str(e))) from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidArgument(constraint.kind, _short(matcher.get_error()))
        for warning in matcher.get_grammar_warnings():  # non-strict schemas: the keywords left unenforced
            logger.info("%s: %s", constraint.kind, warning)
        return matcher


@dataclass(frozen=True)
class NoGrammars:
    """In place of a `GrammarCompiler` for a model that cannot have one: structured output is unavailable, `why`."""

    why: str

    def compile(self, constraint: Constraint) -> NoReturn:
        """`InvalidArgument(constraint.kind, ...)`, always: the field that asked for structured output."""
        raise InvalidArgument(constraint.kind, f"structured output is unavailable for this model: {self.why}")


def grammar_compiler(
    tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 64
) -> GrammarCompiler | NoGrammars:
    """A `GrammarCompiler` (its arguments), or `NoGrammars` saying why none can be built for this model: serving
    goes on without structured output rather than failing to start, which for a server's replica means being
    restarted, and failing again, forever."""
    try:
        return GrammarCompiler(tokenizer, vocab_size, eos_token_ids, cache_size)
    except Exception as exc:  # llguidance refuses a tokenizer with a plain ValueError: any error will do
        why = f"the grammar engine cannot use its tokenizer ({type(exc).__name__}: {_short(str(exc))})"
        return NoGrammars(why)


def check(constraint: Constraint) -> None:
    """Raise `InvalidArgument(constraint.kind, why)` if `constraint` cannot compile for any tokenizer: what an API's
    edge can check before a request is queued (a JSON schema, say), where no compiler is at hand. Special tokens
    (`<|...|>`, `<[id]>`) need a tokenizer, so only `GrammarCompiler.compile` checks grammars that name them."""
    try:
        grammar = _grammar_text(constraint)
    except InvalidArgument:
        raise
    except ValueError as e:  # as in `GrammarCompiler._matcher`
        raise InvalidArgument(constraint.kind, _short(str(e))) from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise InvalidArgument(constraint.kind, _short(messages[0]))


def _grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint (not yet checked: the matcher does that)."""
    M = llguidance.LLMatcher
    # Defaults apply before the schema's "x-guidance", which may still ask for flexible whitespace or other separators.
    defaults: JsonCompileOptions | None = {"whitespace_flexible": False} if constraint.compact else None
    if constraint.kind == "json_object":
        return M.grammar_from_json_schema('{"type": "object"}', defaults=defaults)
    if constraint.kind == "json_schema":
        try:
            schema = json.loads(constraint.value)
        except json.JSONDecodeError as e:
            raise InvalidArgument("json_schema", f"not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise InvalidArgument("json_schema", f"must be a JSON object, got {type(schema).__name__}")
        # An override, so that an "x-guidance" key inside the schema cannot turn strict checking off.
        return M.grammar_from_json_schema(schema, defaults=defaults, overrides={"lenient": not constraint.strict})
    if constraint.kind == "regex":
        return M.grammar_from_regex(constraint.value)
    return llguidance.grammar_from("grammar", constraint.value)  # Lark as is, GBNF converted to Lark


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 3] + "..."
