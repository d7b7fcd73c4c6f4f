"""The drafter interface: anything that can guess the next few tokens of a sequence.

A drafter sees each sequence's committed tokens and proposes up to k more. It may keep state per sequence (a
draft model keeps a KV cache) and learns which of its proposals were kept through `observe`, which gives the new
committed length: state past that length must be rolled back.

A constrained sequence (structured output) hands the drafter its grammar (`DraftGrammar`). A drafter that samples
from a distribution must mask it with the grammar at each draft step and draw from the masked q: cutting a
proposal drawn from an unmasked q where it leaves the grammar would bias the output (`grammar/masks.py`). A
deterministic drafter may ignore the grammar: the engine cuts its proposals where they leave it, which is exact.

Each drafting method also describes itself (`DraftMethod`), in its own file, for the registry
(`drafters.registry`) that the in-process builder, the router and the Serve application choose from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specdec_core.config import TokenShaping
from specdec_core.sparse_q import SparseQ

if TYPE_CHECKING:
    from specdec_core.grammar.constraint import Constraint
    from specdec_core.runner import ModelRunner


class DraftGrammar(Protocol):
    """A sequence's place in its grammar, as a drafter reads it (`grammar.GrammarState` is one). A drafter may move
    it along its drafts, and must leave it where it found it: as many `rollback` as `advance`d."""

    @property
    def constraint(self) -> Constraint:  # what the grammar was compiled from (a remote drafter sends it on)
        ...

    @property
    def num_tokens(self) -> int:  # output tokens it has taken: the sequence's committed output, when handed over
        ...

    def allowed_mask(self) -> torch.Tensor:  # [V] bool: the tokens allowed next, on the target's vocabulary
        ...

    def advance(self, token_ids: list[int]) -> int:
        """Take tokens in order while the grammar allows them; how many were taken."""

    def rollback(self, n: int) -> None: ...

    def is_terminated(self) -> bool:
        """An eos was taken: nothing after it will be committed."""


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's share of a batched `propose` call."""

    seq_id: str
    token_ids: Sequence[int]  # every committed token: prompt and output so far (not copied; read only)
    num_tokens: int  # k: propose at most this many
    shaping: TokenShaping  # the request's token shaping; the draft samples from q shaped alike
    uniform: torch.Tensor | None  # [k] in [0, 1): randomness for sampling drafts; None when greedy
    return_probs: bool = False  # also report q of each proposed token (`Proposal.draft_probs`)
    grammar: DraftGrammar | None = None  # a constrained sequence's grammar after its committed tokens
    # The last `num_assumed` of `token_ids` are not committed: drafts under verification, assumed accepted (a
    # pre-draft, `overlap.py`). A drafter with state keeps what it computes on them only while later calls agree.
    num_assumed: int = 0
    # A pre-draft may also cover up to this many outcomes where the target rejects an assumed draft: the drafter
    # picks those it finds likeliest and drafts after each (`Proposal.alternatives`). 0: the main branch alone.
    num_alternatives: int = 0


@dataclass(frozen=True)
class Alternative:
    """A pre-draft's branch for one rejection outcome: were the target to accept the first `position` assumed
    drafts and commit `token` in place of the next, `proposal` holds the drafts after it, drawn from q on exactly
    that context."""

    position: int  # the assumed draft rejected: 0 .. num_assumed - 1
    token: int  # the target's token there, as the drafter guesses it (its runner-up)
    proposal: Proposal


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]  # 0..k proposed tokens
    q: SparseQ | None  # at len(token_ids) positions: the draft's probabilities; None: deterministic (point masses)
    # q of each proposed token, when the request asked (`DraftRequest.return_probs`): under the distribution it
    # was drawn from, or the plain softmax for greedy drafts; 1.0 for deterministic methods. None otherwise.
    draft_probs: tuple[float, ...] | None = None
    # The kind of guess this is, where the drafter knows that kinds differ in how often they are right (an n-gram
    # proposal: the length of its match). The engine learns acceptance per label and verifies only as much of a
    # proposal as its label's record makes worth the wider verify. None: no such knowledge.
    label: str | None = None
    # The method that proposed, where a drafter combines several (`VariantDrafter`); None: the drafter's own name.
    method: str | None = None
    # A pre-draft's branches for rejection outcomes (`DraftRequest.num_alternatives`), likeliest first.
    alternatives: tuple[Alternative, ...] = ()

    def prefix(self, n: int) -> Proposal:
        """The first n proposed tokens (a proposal cut short is still a valid proposal)."""
        if n >= len(self.token_ids):
            return self
        return Proposal(
            self.token_ids[:n],
            None if self.q is None else self.q.prefix(n),
            None if self.draft_probs is None else self.draft_probs[:n],
            self.label,
            self.method,
        )


class Drafter(Protocol):
    """Propose tokens for a batch of sequences; observe what the target kept.

    A drafter whose starts cost a forward each may also offer `start_many(starts) -> list[int]`, `start` for several
    (seq_id, prompt_ids, cache_salt) at once, all or none: the engine calls it when several sequences start drafting
    in one round (`DraftModelDrafter` reads their contexts batched)."""

    name: str

    def start(self, seq_id: str, prompt_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Begin a sequence (a draft model prefills here). The engine calls it the first time the sequence drafts,
        with every token committed so far (the prompt, and the output of its rounds without drafts). Returns how
        many of those tokens came from a prefix cache (shared only among sequences of one `cache_salt`) instead
        of being read: 0 for a drafter without one."""

    def cached(self, seq_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """How many of `token_ids` a `start` now would likely find in a prefix cache: an estimate, cheap (no
        call to another process), by which the engine prices starting the sequence before it does. 0 for a
        drafter without one."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        """Up to `num_tokens` tokens per request, in one batched pass where the method allows."""

    def observe(self, seq_id: str, num_committed: int) -> None:
        """The sequence now has `num_committed` committed tokens: anything proposed beyond them may be wrong. A
        drafter may forget it now, or at its next `propose`, whose tokens say which of it was right."""

    def release(self, seq_id: str) -> None:
        """The sequence is finished or cancelled: free its state (idempotent)."""


@dataclass(frozen=True)
class DraftSpec:
    """How to draft: a method's name (`drafters.registry`: a registered method, or "none" for plain decoding) and
    the options the methods read."""

    method: str = "draft_model"
    ngram_max: int = 4  # ngram: the longest n-gram looked up
    ngram_min: int = 1  # ngram: the shortest
    suffix_max_depth: int = 32  # suffix: the trie's depth; matches up to half of it, continuations below them
    suffix_min_match: int = 2  # suffix: a shorter match proposes nothing
    suffix_max_requests: int = 256  # suffix: ended requests kept in the global structure (oldest evicted)
    # suffix: the global structure's estimated size in memory (`SuffixTrie.bytes`), oldest requests evicted beyond:
    # where text repeats, a request of a few thousand tokens can cost megabytes, which the count alone does not bound.
    suffix_max_bytes: int = 256 * 1024 * 1024
    suffix_min_prob: float = 0.1  # suffix: stop once the continuation's frequency product falls below this
    suffix_index_prompts: bool = True  # suffix: the global structure also holds ended requests' prompts
    # draft_model: a row stops drafting after a draft the draft model gave less than this probability (kept: it
    # costs one verify row and may be right), so k is a cap; 0 drafts every row to k. Exact at any value: where a
    # proposal ends depends on the draft's own tokens and probabilities only.
    confidence_threshold: float = 0.0


@dataclass(frozen=True)
class DraftContext:
    """What a method's factory builds its in-process drafter from."""

    spec: DraftSpec
    target_vocab_size: int  # the target's embedding rows: q must cover every id the target scores
    runner: ModelRunner | None = None  # the loaded draft model's runner, for a method that runs a draft model


@dataclass(frozen=True)
class DraftMethod:
    """A drafting method as the builder, the router and the Serve application see it."""

    name: str  # its `draft.method` value in configs: a contract, never renamed
    # It runs a draft model: the in-process builder loads one and hands `build` its runner; the service deploys
    # draft workers, which run `build`'s drafter, and the router reaches them remotely. Otherwise `build`'s
    # drafter runs wherever the engine does (in the router, when served).
    runs_draft_model: bool
    build: Callable[[DraftContext], Drafter]
    # A model-free method (registered by this name) whose proposals the engine weighs against `build`'s drafter's
    # every round, per request (`Hybrid`); it runs wherever the engine does. None: `build`'s drafter alone.
    free_part: str | None = None


@dataclass(frozen=True)
class Hybrid:
    """Two drafters for one engine: `free`, model-free (its proposals cost no draft call: a lookup in the router),
    and `model`, a draft model (each call costs a draft step per token). Each round, per request, the engine
    verifies whichever proposal its cost model expects to commit the most tokens per second, or neither."""

    free: Drafter
    model: Drafter
