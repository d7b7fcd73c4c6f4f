"""Prompt lookup: model-free drafting by continuing the longest recent n-gram match in the context.

Code edits, extraction and summarisation repeat long spans of the prompt; when the last n tokens occurred
before, the tokens that followed them then are a cheap and often right guess. Proposals are deterministic (q is
a point mass), which rejection sampling handles exactly.

Each sequence keeps an index from n-gram to the end of its most recent earlier occurrence, updated with the
tokens committed since the last round, so a lookup costs O(max_n) whatever the context length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec_core.drafters.base import DraftContext, DraftMethod, DraftRequest, Proposal


@dataclass
class _Index:
    # n -> {n-gram: end position of its latest occurrence whose continuation is known}
    grams: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed_upto: int = 0  # n-grams ending before this position are in `grams`


class NgramDrafter:
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._index: dict[str, _Index] = {}

    def start(self, seq_id: str, prompt_ids: Sequence[int], cache_salt: str | None = None) -> int:
        self._index[seq_id] = _Index(grams={n: {} for n in range(self.min_n, self.max_n + 1)})
        return 0

    def cached(self, seq_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        return 0

    def release(self, seq_id: str) -> None:
        self._index.pop(seq_id, None)

    def observe(self, seq_id: str, num_committed: int) -> None:
        """Nothing to roll back: the index only ever holds committed tokens."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        proposals = []
        for r in requests:
            tokens, n = self._lookup(r)
            # q is a point mass on each proposed token. A longer match is a much better guess (docs/engine.md,
            # "Labelled proposals"): the label lets the engine learn how much better.
            probs = (1.0,) * len(tokens) if r.return_probs else None
            proposals.append(Proposal(tokens, q=None, draft_probs=probs, label=f"ngram-{n}" if tokens else None))
        return proposals

    def _lookup(self, request: DraftRequest) -> tuple[list[int], int]:
        """The continuation of the longest matching n-gram, and n (0: no match)."""
        tokens, k = request.token_ids, request.num_tokens
        index = self._index[request.seq_id]
        self._catch_up(index, tokens)
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            end = index.grams[n].get(tuple(tokens[L - n : L]))
            if end is not None:
                return list(tokens[end + 1 : min(end + 1 + k, L)]), n
        return [], 0

    def _catch_up(self, index: _Index, tokens: Sequence[int]) -> None:
        """Index every n-gram that ends at a position whose next token is committed (end <= L - 2)."""
        for end in range(index.indexed_upto, len(tokens) - 1):
            for n, grams in index.grams.items():
                if end + 1 >= n:
                    grams[tuple(tokens[end + 1 - n : end + 1])] = end
        index.indexed_upto = max(index.indexed_upto, len(tokens) - 1)


def _build(context: DraftContext) -> NgramDrafter:
    return NgramDrafter(max_n=context.spec.ngram_max, min_n=context.spec.ngram_min)


METHOD = DraftMethod(NgramDrafter.name, runs_draft_model=False, build=_build)
