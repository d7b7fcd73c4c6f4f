"""The target's side of a round: prefill, then verify and accept next to the target's own logits.

Accepting where the logits are keeps what crosses a stage boundary small: the caller sends each sequence's last
committed token, its drafts and the draft's probabilities, and gets back a few token ids. In the server this
class runs inside the target worker; in-process the engine calls it directly. Both see the same `Target`
protocol.

Per sequence the target's cache holds every committed token but the last, which the next `verify` reads
together with the drafts; after acceptance the cache is rolled back to that invariant by moving its length.

A constrained row (structured output) comes with the masks of its grammar, one per position it samples at; they
apply to the logits before anything else (greedy argmax, the first token's sampling, rejection sampling: all of
them then see the masked p), so the target never needs to know what grammar a row follows.

With prefix caching a prefill starts each prompt from the longest prefix its salt has cached (all of the prompt but
its last token at most: the last is computed for the first token's logits) and computes only the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from specdec_core.config import TokenShaping
from specdec_core.decode_run import DecodeItem, DecodeRun, StepwiseRun
from specdec_core.errors import InvalidArgument, ResourceExhausted
from specdec_core.grammar.bits import PackedMasks
from specdec_core.rejection import VerifyResult, greedy_accept, rejection_sample
from specdec_core.runner import ModelRunner
from specdec_core.sampling import mask_logits, processed_probs, sample_from, token_probs
from specdec_core.target_calls import (
    PartialPrefill,
    PartialVerifyFailure,
    Prefilled,
    PrefillItem,
    VerifyItem,
    VerifyOutcome,
)

__all__ = [  # the calls' types are re-exported: callers name them from here
    "LocalTarget",
    "PartialPrefill",
    "PartialVerifyFailure",
    "Prefilled",
    "PrefillItem",
    "Target",
    "VerifyItem",
    "VerifyOutcome",
]

PREFILL_BATCH = 16  # prompts of one length prefilled together


class Target(Protocol):
    """What the engine needs from the target model, wherever it runs."""

    vocab_size: int
    max_seq_len: int

    @property
    def free_slots(self) -> int: ...

    def prefill(self, items: Sequence[PrefillItem]) -> list[Prefilled]:
        """Start each sequence: read its prompt (what its prefix cache lacks) and return its first token. May raise
        `PartialPrefill` when some found no slot after all."""

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyOutcome]:
        """One batched forward over every row's last token plus drafts; accept and roll back per row. May raise
        `PartialVerifyFailure` when only some rows failed."""

    def decode(self, items: Sequence[DecodeItem]) -> DecodeRun:
        """Start a run of plain steps for `items` (`specdec_core.decode_run`): their tokens step by step, until each
        has ended or the run is stopped."""

    def release(self, seq_id: str) -> None:
        """Free a sequence's cache (idempotent)."""


class LocalTarget:
    """`Target` over a `ModelRunner` in this process."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.max_seq_len = runner.max_seq_len
        self._slots: dict[str, int] = {}

    @property
    def free_slots(self) -> int:
        return self.runner.cache.free_slots

    @property
    def active_sequences(self) -> int:
        return len(self._slots)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._slots

    def release(self, seq_id: str) -> None:
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self.runner.release(slot)

    # -- prefill -------------------------------------------------------------------------------------------------

    def prefill(self, items: Sequence[PrefillItem]) -> list[Prefilled]:
        if len(items) > self.free_slots:
            raise ResourceExhausted("sequences", f"{len(items)} new sequences, {self.free_slots} free cache slots")
        for item in items:
            if item.seq_id in self._slots:
                raise InvalidArgument("session_id", f"sequence {item.seq_id!r} is already active")
        cached = []
        try:
            for item in items:
                prompt = list(item.prompt_ids)
                slot = self._slots[item.seq_id] = self.runner.allocate(prompt[:-1], item.cache_salt)
                cached.append(self.runner.length(slot))
            logits = self._prefill_logits(items, cached).unsqueeze(1)  # [A, 1, V]
            logits = _masked(logits, [item.allowed for item in items])[:, 0]  # [A, V]
        except Exception:
            for item in items:
                self.release(item.seq_id)
            raise
        first = self._sample_first(logits, items)
        return [Prefilled(token, n) for token, n in zip(first, cached)]

    def _prefill_logits(self, items: Sequence[PrefillItem], cached: Sequence[int]) -> torch.Tensor:  # [A, V]
        """Prefill what each prompt's cache lacks, in batches of equal length (no padding wasted); logits of each
        prompt's last token."""
        by_length: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            by_length.setdefault(len(item.prompt_ids) - cached[i], []).append(i)
        rows: list[torch.Tensor | None] = [None] * len(items)
        for members in by_length.values():
            for start in range(0, len(members), PREFILL_BATCH):
                chunk = members[start : start + PREFILL_BATCH]
                slots = [self._slots[items[i].seq_id] for i in chunk]
                logits = self.runner.extend(slots, [list(items[i].prompt_ids[cached[i] :]) for i in chunk])
                for i, row in zip(chunk, logits):
                    rows[i] = row
        return torch.stack(rows)  # type: ignore[arg-type]

    def _sample_first(self, logits: torch.Tensor, items: Sequence[PrefillItem]) -> list[int]:
        tokens = logits.argmax(dim=-1).tolist()
        sampled = [i for i, item in enumerate(items) if not item.shaping.greedy]
        if sampled:
            probs = _probs(logits[sampled], [items[i].shaping for i in sampled])
            uniform = torch.tensor([items[i].uniform for i in sampled], dtype=torch.float64)
            for i, token in zip(sampled, sample_from(probs, uniform).tolist()):
                tokens[i] = token
        return tokens

    # -- verify --------------------------------------------------------------------------------------------------

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyOutcome]:
        slots = [self._slot(item.seq_id) for item in items]
        starts = [self.runner.length(slot) for slot in slots]
        feeds = [[item.last_token_id, *item.draft_token_ids] for item in items]
        logits = _masked(self.runner.extend(slots, feeds, all_logits=True), [i.allowed for i in items])  # [B, T, V]
        result = _to_host(self._accept(items, logits))
        probs = _draft_token_probs(items, logits)
        outcomes = []
        for b, (slot, start) in enumerate(zip(slots, starts)):
            n = int(result.num_accepted[b])
            # Keep the committed prefix: the last token read plus the accepted drafts. The new last token
            # (recovered or bonus) is read by the next round.
            self.runner.truncate(slot, start + 1 + n)
            outcomes.append(VerifyOutcome(tuple(result.tokens(b)), n, probs[b]))
        return outcomes

    def decode(self, items: Sequence[DecodeItem]) -> DecodeRun:
        return StepwiseRun(self.verify, items, self.has)

    def _slot(self, seq_id: str) -> int:
        slot = self._slots.get(seq_id)
        if slot is None:
            raise InvalidArgument("session_id", f"no active sequence {seq_id!r}")
        return slot

    def _accept(self, items: Sequence[VerifyItem], logits: torch.Tensor) -> VerifyResult:
        """Greedy rows by argmax, sampled rows by rejection sampling; the outcome stays on the logits' device (the
        caller copies it to the host once, for the whole batch)."""
        B, T, V = logits.shape
        device = logits.device
        drafts = torch.full((B, T - 1), -1, dtype=torch.long)  # [B, K]
        for b, item in enumerate(items):
            drafts[b, : len(item.draft_token_ids)] = torch.tensor(list(item.draft_token_ids), dtype=torch.long)
        num_draft = torch.tensor([len(item.draft_token_ids) for item in items])  # [B]
        drafts, num_draft = drafts.to(device), num_draft.to(device)
        sampled = [b for b, item in enumerate(items) if not item.shaping.greedy]
        if len(sampled) < B:
            result = greedy_accept(drafts, num_draft, logits.argmax(dim=-1))
            if not sampled:
                return result
        sub = self._rejection_sample([items[b] for b in sampled], logits[sampled], drafts[sampled])
        if len(sampled) == B:
            return sub
        at = torch.tensor(sampled, device=device)  # [S]
        out = result.output_token_ids.index_copy(0, at, sub.output_token_ids)  # [B, K+1]
        return VerifyResult(out, result.num_accepted.index_copy(0, at, sub.num_accepted))

    @staticmethod
    def _rejection_sample(
        items: Sequence[VerifyItem],
        logits: torch.Tensor,  # [S, K+1, V]
        drafts: torch.Tensor,  # [S, K] on the logits' device
    ) -> VerifyResult:  # on the logits' device
        S, T, V = logits.shape
        K = T - 1
        p = _probs(logits.reshape(S * T, V), [item.shaping for item in items for _ in range(T)]).view(S, T, V)
        q = _dense_q(items, K, p)  # [S, K, V] or None
        num_draft = torch.tensor([len(item.draft_token_ids) for item in items])  # [S]
        uniform_accept = torch.ones(S, K, dtype=torch.float64)  # [S, K]; padding positions are never accepted
        for i, item in enumerate(items):
            n = len(item.draft_token_ids)
            if n:
                assert item.uniform_accept is not None  # sampled rows (the only ones here) carry their uniforms
                uniform_accept[i, :n] = item.uniform_accept
        uniform_sample = torch.tensor([item.uniform_sample for item in items], dtype=torch.float64)  # [S]
        device = p.device
        return rejection_sample(
            drafts,
            num_draft.to(device),
            p,
            q,
            uniform_accept.to(device, p.dtype),
            uniform_sample.to(device, p.dtype),
        )


def _to_host(result: VerifyResult) -> VerifyResult:
    """The batch's outcome on the host in one device-to-host copy: tokens and counts packed side by side (on a GPU
    every copy is a sync that waits for the device, so one per round, never one per row)."""
    packed = torch.cat([result.output_token_ids, result.num_accepted.unsqueeze(1)], dim=1).cpu()  # [B, K+2]
    return VerifyResult(packed[:, :-1], packed[:, -1])


def _masked(
    logits: torch.Tensor,  # [B, T, V]
    masks: Sequence[PackedMasks | None],  # per row: [<= T, W], or None
) -> torch.Tensor:  # [B, T, V]
    """The logits with what each row's grammar forbids at -inf; rows without masks, and positions past a row's
    masks (padding), as they were."""
    rows = [b for b, m in enumerate(masks) if m is not None]
    if not rows:
        return logits
    allowed = torch.ones(logits.shape, dtype=torch.bool)  # [B, T, V]
    for b in rows:
        mask = masks[b]
        assert mask is not None  # `rows` are those with masks
        allowed[b, : len(mask)] = mask.dense()  # [n, V]
    return mask_logits(logits, allowed.to(logits.device))


def _dense_q(items: Sequence[VerifyItem], K: int, p: torch.Tensor) -> torch.Tensor | None:  # [S, K, V]
    """The rows' q as the sampler reads it (p's dtype and device), None when every row's drafts are point masses.
    The one place q is dense: the sampler is a pure function over dense tensors, and only sampled rows get here.
    A deterministic row (n-gram, a row without a draft model) in a batch with model-drafted rows gets its point
    masses written out: a zero q would accept its drafts wherever p > 0, not with probability p."""
    if all(item.q is None for item in items):
        return None
    S, _, V = p.shape
    q = torch.zeros(S, K, V, dtype=p.dtype, device=p.device)  # [S, K, V]
    for i, item in enumerate(items):
        if item.q is not None:
            q[i, : len(item.q)] = item.q.dense(V, p.device)  # [k, V]
        elif item.draft_token_ids:
            drafts = torch.tensor(list(item.draft_token_ids), dtype=torch.long, device=p.device)  # [k]
            q[i, torch.arange(len(drafts), device=p.device), drafts] = 1.0
    return q


def _draft_token_probs(items: Sequence[VerifyItem], logits: torch.Tensor) -> list[tuple[float, ...] | None]:
    """p of every draft token, for the items that asked (None for the others). Position j of a row predicts its
    draft j, so a row's first len(drafts) logits are the ones read; rows that did not ask cost nothing."""
    out: list[tuple[float, ...] | None] = [tuple() if item.return_probs else None for item in items]
    asked = [b for b, item in enumerate(items) if item.return_probs and item.draft_token_ids]
    if not asked:
        return out
    counts = [len(items[b].draft_token_ids) for b in asked]
    rows = torch.cat([logits[b, :n] for b, n in zip(asked, counts)])  # [sum(counts), V]
    shaping = [items[b].shaping for b, n in zip(asked, counts) for _ in range(n)]
    drafts = torch.tensor([t for b in asked for t in items[b].draft_token_ids], dtype=torch.long)  # [sum(counts)]
    values = iter(token_probs(rows, shaping, drafts).tolist())
    for b, n in zip(asked, counts):
        out[b] = tuple(next(values) for _ in range(n))
    return out


def _probs(logits: torch.Tensor, shaping: Sequence[TokenShaping]) -> torch.Tensor:  # [N, V]
    device = logits.device
    return processed_probs(
        logits,
        torch.tensor([s.temperature for s in shaping], device=device),
        torch.tensor([s.top_k for s in shaping], device=device),
        torch.tensor([s.top_p for s in shaping], device=device),
    )
