"""One sequence's position in its grammar, moved by the tokens it commits and drafts."""

from __future__ import annotations

import numpy as np
import torch

from specdec_core.errors import GrammarError
from specdec_core.grammar.bits import has, only_token, popcount, set_bit, unpack_bitmask
from specdec_core.grammar.compiler import CompiledGrammar
from specdec_core.grammar.constraint import Constraint

# Masks kept behind the current position: rolling back a round (at most this many drafts) finds its masks cached.
_KEPT_BEHIND = 32
_MAX_FORCED = 32
_MAX_ERROR = 400  # characters of the matcher's error kept: it can quote the grammar


class GrammarState:
    """The grammar's state after a sequence's output tokens so far, committed and drafted alike.

    Mutating: `advance` and `rollback` move it; every other method leaves it where it is. A position's mask is
    computed once: the masks along the last path explored stay cached (packed, 4 bytes per 32 tokens) until a
    different token is advanced at their position, so a round's drafting, verifying and committing share them.
    After an eos token the state is terminated and its mask allows the eos tokens only, so that every mask has a
    token to renormalise onto. A grammar engine that fails (its matcher in an error state, which llguidance masks
    to the eos tokens alone; or a mask with no token at all) raises `GrammarError`: ending the output there would
    report output that may break its constraint as a normal stop.
    """

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self._matcher = grammar.matcher.deep_copy()
        self._eos = frozenset(grammar.eos_token_ids)
        self._trail: list[int] = []  # the last path explored; the state is at its prefix of length `_n`
        self._n = 0
        self._packed: dict[int, np.ndarray] = {}  # position on the trail -> [W] uint32 mask

    @property
    def constraint(self) -> Constraint:
        return self.grammar.constraint

    @property
    def num_tokens(self) -> int:
        """Tokens advanced and not rolled back."""
        return self._n

    def advance(self, token_ids: list[int]) -> int:
        """Consume tokens in order, stopping at the first the grammar does not allow (nothing after an eos).
        Returns how many were consumed; the state is after them.

        A token is taken iff the mask at its position allows it, so a proposal is cut exactly where its law under
        the grammar is 0. llguidance's own consume is looser: where the coming text is forced it also takes
        non-canonical spellings of it (`v`, `valu` for a forced `values`) that its mask leaves out. The mask is the
        law p and q are masked by, so it decides; checking it costs nothing in a round, whose masks are computed
        anyway.
        """
        consumed = 0
        for token in token_ids:
            if self.is_terminated() or not self._allows(token):
                break
            # The eos never reaches the matcher: llguidance takes it inconsistently (refused by try_consume_tokens
            # once nothing else may follow, taken but not counted for rollback by consume_token). Allowed where the
            # grammar accepts, it ends the output; this class tracks that itself.
            if token not in self._eos and self._matcher.try_consume_tokens([token]) != 1:
                raise self._failed(f"the mask allows token {token} but the matcher refused it")
            self._step(token)
            consumed += 1
        for position in [p for p in self._packed if p < self._n - _KEPT_BEHIND]:
            del self._packed[position]
        return consumed

    def rollback(self, n: int) -> None:
        """Undo the last `n` tokens advanced."""
        if not 0 <= n <= self._n:
            raise ValueError(f"cannot roll back {n} of {self._n} tokens")
        in_matcher = n - (1 if n and self.is_terminated() else 0)  # the eos was never the matcher's
        if in_matcher and not self._matcher.rollback(in_matcher):
            raise self._failed(f"the matcher refused to roll back {in_matcher} tokens")
        self._n -= n

    def allowed_mask(self) -> torch.Tensor:  # [V] bool
        """The tokens the grammar allows next; ids beyond the tokenizer's (padding in the model's vocabulary) are
        never allowed. Never empty: a terminated state allows the eos tokens."""
        return unpack_bitmask(self._packed_mask(), self.grammar.vocab_size)  # [V]

    def allowed_words(self) -> np.ndarray:  # [W] uint32, read only (the state's cache)
        """`allowed_mask`, packed (`bits.py`): over the tokenizer's ids, the model's padding ids left out."""
        return self._packed_mask()

    def forced(self, limit: int = _MAX_FORCED) -> list[int]:
        """The tokens forced from here, one by one while the grammar allows exactly one token (at most `limit`,
        ending at an eos). Drafting them is free: masked, both p and q put all their mass on them."""
        out: list[int] = []
        while len(out) < limit and not self.is_terminated():
            packed = self._packed_mask()  # [W]
            if popcount(packed) != 1:
                break
            token = only_token(packed)
            if self.advance([token]) != 1:
                raise self._failed(f"the one allowed token {token} was refused")
            out.append(token)
        self.rollback(len(out))
        return out

    def is_terminated(self) -> bool:
        """An eos token has been consumed: the output is over."""
        return self._n > 0 and self._trail[self._n - 1] in self._eos

    def must_end(self) -> bool:
        """Only eos tokens are allowed: the output is complete and nothing may follow (no forward pass needed)."""
        words = self._packed_mask().copy()  # [W]
        for token in self._eos:
            set_bit(words, token, False)
        return popcount(words) == 0

    def can_end(self) -> bool:
        """The output so far is a complete sentence of the grammar: an eos token is allowed (or was consumed)."""
        return self.is_terminated() or any(self._allows(token) for token in self._eos)

    def _allows(self, token: int) -> bool:
        if not 0 <= token < self.grammar.tokenizer_vocab_size:  # the model's padding ids, or garbage
            return False
        return has(self._packed_mask(), token)

    def _step(self, token: int) -> None:
        """Move one token along the trail; the masks past this position hold only if the trail goes on the same."""
        if self._n < len(self._trail) and self._trail[self._n] == token:
            self._n += 1
            return
        del self._trail[self._n :]
        for position in [p for p in self._packed if p > self._n]:
            del self._packed[position]
        self._trail.append(token)
        self._n += 1

    def _failed(self, what: str) -> GrammarError:
        """The error ending this sequence: what failed, and the matcher's own error (its first line: the rest
        dumps the matcher's state and the whole grammar)."""
        error = (self._matcher.get_error() or "").strip().splitlines()
        detail = f": {error[0][:_MAX_ERROR]}" if error else ""
        return GrammarError(self.constraint.kind, f"the grammar engine failed after {self._n} tokens, {what}{detail}")

    def _packed_mask(self) -> np.ndarray:  # [W] uint32
        if self._n not in self._packed:
            vocab = self.grammar.tokenizer_vocab_size
            words = np.zeros((vocab + 31) // 32, dtype=np.uint32)  # [W]
            if self.is_terminated():
                for token in self._eos:
                    set_bit(words, token, True)
            else:
                self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
                if vocab % 32:  # the last word's bits past the tokenizer: never allowed, whatever the engine left
                    words[-1] &= np.uint32((1 << (vocab % 32)) - 1)
                if self._matcher.is_error():  # its mask then allows the eos tokens: an error posing as an end
                    raise self._failed("no token may follow")
                if popcount(words) == 0:  # a grammar with no way out: nothing to renormalise onto
                    raise self._failed("no token continues the output and it cannot end")
            self._packed[self._n] = words
        return self._packed[self._n]
