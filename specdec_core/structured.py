"""Structured output in the engine: the grammar compiler, tokens a grammar forces, proposals cut at a grammar.

A constrained request's sequence holds a `GrammarState`, moved by the tokens it commits, whose masks go with every
call that samples for it (the target's prefill and verify, the draft model's steps). Tokens the grammar forces (one
allowed token at each position) are verified as a proposal that needs no draft call; where they end the output
they are committed with no forward pass at all. docs/engine.md says why each step is exact.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from typing import Any

from specdec_core.drafters.base import Proposal
from specdec_core.grammar.compiler import CompiledGrammar, GrammarCompiler, NoGrammars, grammar_compiler
from specdec_core.grammar.constraint import Constraint
from specdec_core.grammar.masks import draft_masks
from specdec_core.grammar.state import GrammarState
from specdec_core.outputs import RoundInfo

logger = logging.getLogger(__name__)

FORCED = "forced"  # `RoundInfo.method` of a round that verified (or committed) the tokens a grammar forces
FORCED_LOOKAHEAD = 32  # forced tokens looked for per round: a longer run is taken over several rounds


class LazyCompiler:
    """A grammar compiler built with the first constrained request: its tables of the tokenizer take seconds at a
    large vocabulary, which an engine never asked for structured output should not pay. Its masks span the target's
    logits (`vocab_size`), eos allowed exactly where the grammar can end. Thread-safe: a server compiles a request's
    constraint on another thread first, so that no round waits for the tables or a compile. A tokenizer the grammar
    engine cannot read leaves structured output unavailable (`NoGrammars`): logged once, as a WARNING, and each
    constrained request refused saying why; the tables are not tried again."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self._args = (tokenizer, vocab_size, sorted(eos_token_ids))
        self._compiler: GrammarCompiler | NoGrammars | None = None
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """`constraint` compiled (kept in the compiler's LRU), or `InvalidArgument` naming its kind (it does not
        compile, or structured output is unavailable for this model)."""
        with self._lock:
            if self._compiler is None:
                self._compiler = grammar_compiler(*self._args)
                if isinstance(self._compiler, NoGrammars):
                    logger.warning("structured requests are refused: %s", self._compiler.why)
        return self._compiler.compile(constraint)


def forced_tokens(grammar: GrammarState, room: int) -> list[int]:
    """The tokens `grammar` forces next, at most `room` (and `FORCED_LOOKAHEAD`)."""
    return grammar.forced(min(room, FORCED_LOOKAHEAD))


def completes(chain: list[int], room: int, eos_token_ids: Collection[int]) -> bool:
    """The forced tokens end the output: they reach an eos, or fill the `room` it has left."""
    return bool(chain) and (chain[-1] in eos_token_ids or len(chain) >= room)


def forced_proposal(chain: list[int], return_probs: bool) -> Proposal:
    """Forced tokens as a point-mass proposal. Masked, p and q are 1 on each: always accepted, and the bonus
    position after them is sampled from the masked p as any other. No label: its record would always be 1."""
    return Proposal(list(chain), None, (1.0,) * len(chain) if return_probs else None)


def forced_round(chain: list[int], return_probs: bool) -> RoundInfo:
    """The round of forced tokens that end the output, committed with no forward pass: masked, p is 1 on each
    whatever the target's logits, so verifying them could only accept them."""
    n = len(chain)
    ones = (1.0,) * n if return_probs else None
    return RoundInfo(
        k=n,
        proposed_token_ids=tuple(chain),
        num_accepted=n,
        bonus=False,
        draft_probs=ones,
        target_probs=ones,
        method=FORCED,
    )


def cut_to_grammar(grammar: GrammarState | None, proposal: Proposal) -> Proposal:
    """A constrained row's point-mass proposal (an n-gram's, a suffix's, greedy drafts) cut where it leaves the
    grammar: exact, the cut position sampled from the masked p as the residual of a point mass would be. A
    proposal with a q is never cut: drawn from the masked q it stays in the grammar, and one drawn from any
    other q is exact only verified whole (`grammar/masks.py`)."""
    if grammar is None or proposal.q is not None or not proposal.token_ids:
        return proposal
    return proposal.prefix(draft_masks(grammar, proposal.token_ids).num_valid)
