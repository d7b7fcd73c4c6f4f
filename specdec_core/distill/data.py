"""Training data: token sequences, and at chosen positions of each the target's top-k next-token distribution.

Two sources. Target completions: the target's greedy output after a prompt, every output position taught at
weight 1. Proposal-log rejections: a served round whose proposal the target cut short, with the tokens before it
(`include_context_tokens` in the log's config); the draft is taught the target's distribution at the first rejected
position, weighted up, since that is exactly where it went wrong in production.

The target is scored once, ahead of training (`score`): one forward per batch of sequences, keeping the log p of
its top-k ids. The draft never reads an id it has no embedding row for: such ids (padding rows of the target's
embedding) read as 0, as `DraftModelDrafter` reads them, and the top-k is taken among the ids both models have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec_core.distill.forward import logits_at


@dataclass(frozen=True)
class TrainingSequence:
    """A token sequence to score, and where: the draft's prediction after token_ids[i], for i in `positions`."""

    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    weight: float = 1.0


@dataclass(frozen=True)
class Example:
    """A scored sequence: the target's distribution at each of its positions, as its top-k (ids, log p)."""

    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    top_ids: torch.Tensor  # [N, K] int64, N = len(positions)
    top_logprobs: torch.Tensor  # [N, K] float32: log p under the target's full softmax (they sum below 1)
    weights: torch.Tensor  # [N] float32

    def to_state(self) -> dict[str, Any]:
        """Plain lists and tensors only: `torch.load(weights_only=True)` reads it back."""
        return {
            "token_ids": list(self.token_ids),
            "positions": list(self.positions),
            "top_ids": self.top_ids,
            "top_logprobs": self.top_logprobs,
            "weights": self.weights,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Example:
        return cls(
            tuple(state["token_ids"]),
            tuple(state["positions"]),
            state["top_ids"],
            state["top_logprobs"],
            state["weights"],
        )


def completion_sequence(
    prompt_ids: Sequence[int], completion_ids: Sequence[int], weight: float = 1.0
) -> TrainingSequence:
    """The prompt and the target's completion; positions: those whose next token is a completion token."""
    tokens = tuple(prompt_ids) + tuple(completion_ids)
    return TrainingSequence(tokens, tuple(range(len(prompt_ids) - 1, len(tokens) - 1)), weight)


def rejection_sequences(records: Iterable[dict[str, Any]], weight: float) -> list[TrainingSequence]:
    """From proposal-log records, one sequence per round with a rejection and a context: the context and the
    accepted proposals, taught at its last position (where the first rejected proposal was). Records without a
    context (the log's default) or with every proposal accepted teach nothing and are skipped."""
    out = []
    for record in records:
        context, proposed = record.get("context") or [], record.get("proposed") or []
        accepted = int(record.get("accepted", 0))
        if not context or accepted >= len(proposed):
            continue
        tokens = tuple(int(t) for t in context) + tuple(int(t) for t in proposed[:accepted])
        out.append(TrainingSequence(tokens, (len(tokens) - 1,), weight))
    return out


def readable(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """Ids a model with `vocab_size` embedding rows can read: others read as 0 (`DraftModelDrafter._readable`)."""
    return [t if t < vocab_size else 0 for t in token_ids]


@torch.no_grad()
def score(
    target: torch.nn.Module,
    sequences: Sequence[TrainingSequence],
    *,
    top_k: int,
    shared_vocab: int,
    batch_size: int = 4,
    progress: Callable[[int], None] | None = None,
) -> list[Example]:
    """Each sequence scored by `target` (a `Transformer` using `CausalAttention`): the top `top_k` of log p among
    ids below `shared_vocab` (those the draft can propose) at each of its positions. `progress(n)`: n more done."""
    examples = []
    for start in range(0, len(sequences), batch_size):
        batch = sequences[start : start + batch_size]
        logits = logits_at(target, [s.token_ids for s in batch], [s.positions for s in batch])  # [N, Vt]
        logp = torch.log_softmax(logits.float(), dim=-1)[:, :shared_vocab]  # [N, V shared]
        top = logp.topk(min(top_k, shared_vocab), dim=-1)  # [N, K] each
        offset = 0
        for s in batch:
            n = len(s.positions)
            examples.append(
                Example(
                    s.token_ids,
                    s.positions,
                    top.indices[offset : offset + n].cpu(),
                    top.values[offset : offset + n].cpu(),
                    torch.full((n,), float(s.weight)),
                )
            )
            offset += n
        if progress is not None:
            progress(len(batch))
    return examples
