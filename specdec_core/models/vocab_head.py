"""A draft's LM head cut to part of the vocabulary: the ids a request is likely to need, not all 152k.

The LM head of a small draft is a large share of its step: Qwen2.5-0.5B's 151,936 x 896 head holds 27% of the
model's weights, read once per draft token. FR-Spec (Zhao et al. 2025, arXiv 2502.14856) scores only the most
frequent tokens in the draft; here the frequent set is the first `keep` ids (byte-pair and SentencePiece
vocabularies number their tokens roughly most frequent first: a BPE id is its merge's rank), widened per call by
the ids of the requests' own contexts (the identifiers and rare words a conversation repeats, which a frequency
cut would lose) and by the special tokens (an end of turn must stay proposable). Every other id gets logit -inf:
the draft never proposes it, and its q is 0 there.

Exact whatever is cut: the draft's proposals stay point masses (greedy) or draws from the q that verification
sees, so only the acceptance rate can move. Keeping the context's ids is what keeps the agreement with the
target close to the whole head's; docs/engine.md has the measurements.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

ROW_MULTIPLE = 64  # `keep` is rounded up to this: the kernels take whole blocks of output rows


class VocabHead(nn.Module):
    """Scores ids [0, keep) with `head` (a linear layer the CPU kernels may repack or quantize like any other), and
    the ids `always` and `extra` (those at or past `keep`) from the unquantized rows of `weight`; -inf elsewhere."""

    def __init__(self, weight: torch.Tensor, keep: int, always: Iterable[int] = ()) -> None:  # weight [V, D]
        super().__init__()
        V, D = weight.shape
        keep = min(V, -(-keep // ROW_MULTIPLE) * ROW_MULTIPLE)
        self.keep, self.vocab_size = keep, V
        self.head = nn.Linear(D, keep, bias=False, device="meta")
        self.head.weight = nn.Parameter(weight.detach()[:keep], requires_grad=False)
        self.weight = weight.detach()  # [V, D]: shared with a tied embedding, so no copy
        self.always = torch.tensor(sorted({i for i in always if keep <= i < V}), dtype=torch.long)  # [A]
        self._scored: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None  # see `_extra_rows`

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:  # [..., D] -> [..., V]
        out = torch.full((*x.shape[:-1], self.vocab_size), float("-inf"), device=x.device)  # [..., V] float32
        out[..., : self.keep] = self.head(x)
        ids, rows = self._extra_rows(extra)  # [E], [E, D]
        if ids.numel():
            flat = out.view(-1, self.vocab_size)  # [M, V]
            flat.index_copy_(1, ids, x.reshape(-1, x.shape[-1]).float() @ rows.T)
        return out

    def _extra_rows(self, extra: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # [E], [E, D] float32
        """The ids scored besides the kept ones, and their rows in fp32. A drafter passes one `extra` tensor to
        the k steps of a round: its rows are gathered and widened once, not at every step."""
        if self._scored is not None and self._scored[0] is extra:
            return self._scored[1], self._scored[2]
        ids = self.always if extra is None else torch.cat([self.always, extra[extra >= self.keep]]).unique()
        ids = ids.to(self.weight.device)
        rows = self.weight[ids].float()  # [E, D]
        self._scored = (extra, ids, rows)
        return ids, rows


def cut_vocabulary(model: nn.Module, keep: int, always: Iterable[int]) -> bool:
    """Give `model` (a `Transformer` as loaded, before any kernel swap) a `VocabHead` keeping `keep` ids plus
    `always`; False (nothing changed) where `keep` would keep the whole vocabulary."""
    weight = model.lm_head.weight  # [V, D]
    if keep <= 0 or -(-keep // ROW_MULTIPLE) * ROW_MULTIPLE >= weight.shape[0]:
        return False
    model.lm_head = VocabHead(weight, keep, always)
    return True


def context_ids(token_lists: Iterable[Iterable[int]], keep: int, vocab_size: int) -> torch.Tensor:  # [E] long
    """The distinct ids at or past `keep` in the given contexts: what a `VocabHead` must add for them."""
    ids = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.long)  # [sum of lengths]
    ids = ids[(ids >= keep) & (ids < vocab_size)]
    return ids.unique()
