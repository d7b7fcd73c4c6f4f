"""Greedy drafting with the tokens kept on the device: a draft model's k steps as one chain, one copy to the host.

The step loop in `draft_model.py` reads every step's argmax back to the host to feed it to the next step. On a GPU
each such read waits for the device: the host cannot queue step s + 1 while step s runs, and a replayed CUDA graph
costs less than the wait. Here step s + 1 reads step s's argmax where it lies (`ModelRunner.extend_next`), and the
drafts and their probabilities come back in one copy at the end.

What must stay true: the proposals, and what each slot holds afterwards, are those of the step loop. Every row runs
the longest row's steps, so a row is cut afterwards to its own `num_tokens` and at its first draft below the
confidence threshold (the loop includes that draft and stops), and its slot is rolled back (by a length) to the
drafts the loop would have fed: all of its drafts but the last.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec_core.config import TokenShaping
from specdec_core.runner import ModelRunner
from specdec_core.sampling import token_probs


@dataclass(frozen=True)
class ChainRow:
    """One row of a chain: its slot, the committed tokens its slot has not read, and how many drafts it wants."""

    slot: int
    feed: Sequence[int]
    num_tokens: int
    shaping: TokenShaping


@dataclass(frozen=True)
class Drafted:
    """A row's drafts, and q of each (the plain softmax: greedy rows), as the step loop would have proposed them."""

    token_ids: list[int]
    probs: list[float]


def draft_chain(
    runner: ModelRunner,
    rows: Sequence[ChainRow],
    align: Callable[[torch.Tensor], torch.Tensor],  # [R, Vd] -> [R, V]: the draft's logits on the target's ids
    confidence_threshold: float,
    with_probs: bool,
    extra_vocab: torch.Tensor | None = None,
) -> list[Drafted]:
    """Draft greedily for `rows` (each with num_tokens >= 1): max(num_tokens) steps, one device-to-host copy.
    `with_probs`: q of every draft is wanted (a threshold, or a row that reports them); else each reads 1."""
    slots = [row.slot for row in rows]
    shaping = [row.shaping for row in rows]
    steps = max(row.num_tokens for row in rows)
    logits = runner.extend(slots, [list(row.feed) for row in rows], extra_vocab=extra_vocab)  # [R, Vd]
    first = [runner.length(slot) for slot in slots]  # where each row's first draft would be written
    picks, probs = [], []
    for step in range(steps):
        aligned = align(logits)  # [R, V]
        token = aligned.argmax(dim=-1)  # [R]
        picks.append(token)
        probs.append(token_probs(aligned, shaping, token) if with_probs else torch.ones_like(token))  # [R]
        if step + 1 < steps:
            logits = runner.extend_next(slots, token, extra_vocab=extra_vocab)  # [R, Vd]
    host = torch.cat([torch.stack(picks, 1).double(), torch.stack(probs, 1).double()], dim=1).cpu()  # [R, 2 steps]
    out = []
    for r, row in enumerate(rows):
        tokens = [int(t) for t in host[r, :steps].tolist()]
        values = host[r, steps:].tolist()
        n = _kept(values, row.num_tokens, confidence_threshold)
        runner.truncate(row.slot, first[r] + n - 1)  # the loop fed every draft but the last
        runner.record(row.slot, first[r], tokens[: n - 1])
        out.append(Drafted(tokens[:n], values[:n]))
    return out


def _kept(probs: Sequence[float], num_tokens: int, threshold: float) -> int:
    """Drafts the step loop keeps: up to num_tokens, ending with the first whose q is below the threshold."""
    for j, prob in enumerate(probs[:num_tokens]):
        if prob < threshold:
            return j + 1
    return num_tokens
