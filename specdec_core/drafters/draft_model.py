"""A small causal LM as the drafter, with its own KV cache rolled back exactly like the target's."""

from __future__ import annotations

from typing import Sequence

import torch

from specdec_core.drafters.base import DraftRequest, Proposal
from specdec_core.runner import ModelRunner
from specdec_core.sampling import processed_probs, sample_from, token_probs


# Sampled drafts come from the draft's processed distribution cut to its `Q_SUPPORT` most likely tokens. Any q
# keeps verification exact as long as the drafts are drawn from the q the target sees; a short support keeps q
# small on the wire (a few hundred bytes instead of the whole vocabulary) and costs almost no acceptance.
Q_SUPPORT = 128


class DraftModelDrafter:
    """Autoregressive drafting with a smaller model: k batched forward steps per round.

    The draft cache holds every committed token the draft has read. Each round first feeds the committed tokens
    it has not read yet (usually the last round's recovered or bonus token, plus the last accepted draft), then
    one token per step; `observe` truncates it back to the committed prefix.
    """

    name = "draft_model"

    def __init__(self, runner: ModelRunner, target_vocab_size: int, q_support: int | None = Q_SUPPORT) -> None:
        self.runner = runner
        self.target_vocab_size = target_vocab_size
        self.q_support = q_support
        self._slots: dict[str, int] = {}

    def start(self, seq_id: str, prompt_ids: Sequence[int]) -> None:
        slot = self.runner.allocate()
        self._slots[seq_id] = slot
        if len(prompt_ids) > 1:
            # The last prompt token is read with the first propose, whose logits we need anyway.
            self.runner.extend([slot], [self._readable(prompt_ids[:-1])])

    def release(self, seq_id: str) -> None:
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self.runner.release(slot)

    def observe(self, seq_id: str, num_committed: int) -> None:
        slot = self._slots[seq_id]
        # Positions before num_committed - 1 hold committed tokens; the last committed token is read next round.
        self.runner.truncate(slot, min(self.runner.length(slot), num_committed - 1))

    @property
    def active_sequences(self) -> int:
        return len(self._slots)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        tokens: list[list[int]] = [[] for _ in requests]
        qs: list[list[torch.Tensor]] = [[] for _ in requests]
        chosen: list[list[float]] = [[] for _ in requests]  # q of each picked token, for requests that asked
        rows = [i for i, r in enumerate(requests) if r.num_tokens > 0]
        feeds = {}  # row -> the committed tokens its slot has not read (a long backlog read first, alone)
        for i in rows:
            slot = self._slots[requests[i].seq_id]
            feeds[i] = self._catch_up(slot, self._readable(requests[i].token_ids[self.runner.length(slot) :]))
        step = 0
        while rows:
            slots = [self._slots[requests[i].seq_id] for i in rows]
            logits = self._align(self.runner.extend(slots, [feeds[i] for i in rows]))  # [len(rows), V]
            batch = [requests[i] for i in rows]
            picked, probs = self._pick(logits, batch, step)
            picked_probs = _picked_probs(logits, batch, picked, probs)
            for j, i in enumerate(rows):
                tokens[i].append(picked[j])
                if probs is not None and probs[j] is not None:
                    qs[i].append(probs[j])
                if picked_probs[j] is not None:
                    chosen[i].append(picked_probs[j])
                feeds[i] = [picked[j]]
            step += 1
            rows = [i for i in rows if requests[i].num_tokens > step]
        return [
            Proposal(token_ids=t, q=torch.stack(q) if q else None, draft_probs=tuple(c) if r.return_probs else None)
            for t, q, c, r in zip(tokens, qs, chosen, requests)
        ]

    def _catch_up(self, slot: int, feed: list[int]) -> list[int]:
        """Read all but the last token of a long feed (a sequence that sat at k = 0 for a while) in a forward of
        its own; what is left is short. A batched step pads every row to its longest feed: one long row would
        make every row pay for its length, and could push the padding past the other rows' cache slots."""
        if len(feed) <= self.runner.config.max_extend:
            return feed
        self.runner.extend([slot], [feed[:-1]])
        return feed[-1:]

    def _readable(self, tokens: Sequence[int]) -> list[int]:
        """Ids the draft can embed. The target's embedding may have rows the draft lacks (padding beyond the
        tokenizer); should the target ever emit one, the draft reads a stand-in: its guesses get worse there,
        the output cannot change."""
        limit = self.runner.vocab_size
        return [t if t < limit else 0 for t in tokens]

    def _align(self, logits: torch.Tensor) -> torch.Tensor:  # [B, Vd] -> [B, Vt]
        """Draft and target may pad their embeddings differently; q must live on the target's vocabulary."""
        V = self.target_vocab_size
        if logits.shape[-1] >= V:
            return logits[:, :V]
        pad = logits.new_full((logits.shape[0], V - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def _pick(
        self, logits: torch.Tensor, requests: Sequence[DraftRequest], step: int
    ) -> tuple[list[int], list[torch.Tensor | None] | None]:
        """Greedy rows take the argmax; sampled rows draw from their processed q and keep it for verification."""
        picked = logits.argmax(dim=-1).tolist()
        sampled = [j for j, r in enumerate(requests) if not r.shaping.greedy]
        if not sampled:
            return picked, None
        sub = [requests[j] for j in sampled]
        q = processed_probs(
            logits[sampled],
            torch.tensor([r.shaping.temperature for r in sub], device=logits.device),
            torch.tensor([r.shaping.top_k for r in sub], device=logits.device),
            torch.tensor([r.shaping.top_p for r in sub], device=logits.device),
        )  # [S, V]
        if self.q_support is not None and self.q_support < q.shape[-1]:
            q = _truncate(q, self.q_support)
        uniform = torch.stack([r.uniform[step] for r in sub]).to(logits.device)  # [S]
        drawn = sample_from(q, uniform).tolist()
        probs: list[torch.Tensor | None] = [None] * len(requests)
        for j, token, row in zip(sampled, drawn, q):
            picked[j] = token
            probs[j] = row
        return picked, probs


def _picked_probs(
    logits: torch.Tensor,  # [B, V]
    requests: Sequence[DraftRequest],
    picked: list[int],
    q: list[torch.Tensor | None] | None,  # per row, the [V] distribution a sampled row drew from
) -> list[float | None]:
    """q of each row's picked token, for the rows that asked (None for the others): from the distribution a
    sampled row drew from (its support cut included), else the plain softmax. No row asked: nothing computed."""
    out: list[float | None] = [None] * len(requests)
    greedy = []
    for j, r in enumerate(requests):
        if not r.return_probs:
            continue
        if q is not None and q[j] is not None:
            out[j] = float(q[j][picked[j]])
        else:
            greedy.append(j)
    if greedy:
        chosen = torch.tensor([picked[j] for j in greedy])  # [G]
        values = token_probs(logits[greedy], [requests[j].shaping for j in greedy], chosen)  # [G]
        for j, value in zip(greedy, values.tolist()):
            out[j] = value
    return out


def _truncate(q: torch.Tensor, support: int) -> torch.Tensor:  # [S, V] -> [S, V], `support` nonzeros per row
    top, index = q.topk(support, dim=-1)  # [S, support]
    return torch.zeros_like(q).scatter_(-1, index, top / top.sum(dim=-1, keepdim=True))
