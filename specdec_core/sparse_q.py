"""The draft's q, kept sparse from the drafter to the verifier.

A draft model's q is sparse by construction: it samples from its `Q_SUPPORT` (128) most likely tokens
(`drafters/draft_model.py`). Kept as (id, probability) pairs, a position costs n entries instead of a row over
the whole vocabulary (151,936 for Qwen2.5): that is what the draft worker sends, the router passes on and the
target worker reads. q is made dense only where the rejection sampler needs it (`target.py`), for sampled rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from specdec_core.errors import InvalidArgument


@dataclass(frozen=True)
class SparseQ:
    """q at k draft positions: position i gives probability probs[i, j] to token token_ids[i, j] and 0 to every
    other token. A row with fewer than n entries is padded with probability 0 (its ids are then meaningless).
    Ids are ascending where a drafter samples from the row, so that its cdf runs in a dense row's order."""

    token_ids: torch.Tensor  # [k, n] long
    probs: torch.Tensor  # [k, n] float32

    def __post_init__(self) -> None:
        if self.token_ids.dim() != 2 or self.token_ids.shape != self.probs.shape:
            raise InvalidArgument(
                "q", f"token_ids {tuple(self.token_ids.shape)} and probs {tuple(self.probs.shape)} must both be [k, n]"
            )

    def __len__(self) -> int:
        return self.token_ids.shape[0]  # k

    def prefix(self, n: int) -> SparseQ:
        """q at the first n positions."""
        return SparseQ(self.token_ids[:n], self.probs[:n])

    def dense(self, vocab_size: int, device: torch.device | str | None = None) -> torch.Tensor:  # [k, V]
        """Every position as a row over the vocabulary, in the probabilities' dtype, built on `device` (default:
        where the tensors are), so that only the k * n entries ever cross to it."""
        device = self.probs.device if device is None else device
        out = torch.zeros(len(self), vocab_size, dtype=self.probs.dtype, device=device)  # [k, V]
        # Padding adds 0 wherever its id points.
        return out.scatter_add_(-1, self.token_ids.to(device), self.probs.to(device))

    @staticmethod
    def from_rows(token_ids: Sequence[torch.Tensor], probs: Sequence[torch.Tensor]) -> SparseQ:
        """Positions of n_i entries each (`token_ids[i]`, `probs[i]`: [n_i]), padded to the longest."""
        return SparseQ(pad_sequence(list(token_ids), batch_first=True), pad_sequence(list(probs), batch_first=True))

    @staticmethod
    def from_dense(q: torch.Tensor) -> SparseQ:  # [k, V] -> [k, n], n: the most nonzeros in a row
        """The nonzero entries of each row, ids ascending."""
        nonzero = q != 0  # [k, V]
        n = int(nonzero.sum(dim=-1).max()) if q.numel() else 0
        # A stable sort puts each row's nonzero ids first, in ascending order; the rest of the first n is padding.
        ids = nonzero.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[:, :n]  # [k, n]
        return SparseQ(ids, q.gather(-1, ids))
