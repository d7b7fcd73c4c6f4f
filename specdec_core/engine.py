"""The speculative decoding engine: continuous batching of draft -> verify -> accept rounds.

`step()` runs one round for every running sequence: the drafter proposes k tokens per sequence (one batched
pass per draft position), the target scores every row's last committed token plus its drafts in one batched
forward, and rejection sampling decides what is kept. Sequences join (prefill) and leave between rounds.
Plain decoding is the same round with k = 0, so the baseline shares every line of code but the drafter.

Invariant kept for every running sequence: the target cache holds all committed tokens but the last, which is
read by the next round's verify forward together with the drafts.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from specdec_core.adaptive import AcceptanceEstimate, AdaptivePolicy, CostModel
from specdec_core.config import AUTO, SamplingParams, parse_num_speculative_tokens
from specdec_core.drafters.base import DraftRequest, Drafter, Proposal
from specdec_core.errors import InvalidArgument, ResourceExhausted
from specdec_core.rejection import VerifyResult, greedy_accept, rejection_sample
from specdec_core.runner import ModelRunner
from specdec_core.sampling import processed_probs, sample_from
from specdec_core.stopping import FinishReason, IncrementalDetokenizer, StopChecker

log = logging.getLogger(__name__)

PREFILL_BATCH = 16  # prompts of one length prefilled together


@dataclass(frozen=True)
class EngineConfig:
    max_speculative_tokens: int = 8  # the largest k a request may ask for or `auto` may choose
    num_speculative_tokens: int | str = AUTO  # default for requests that do not say
    policy: AdaptivePolicy = AdaptivePolicy()


@dataclass(frozen=True)
class SpecStats:
    rounds: int = 0
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass(frozen=True)
class RoundInfo:
    """What happened to one sequence in one round: the data a trace span or proposal log needs."""

    k: int
    proposed_token_ids: tuple[int, ...]
    num_accepted: int
    bonus: bool  # all drafts accepted: the extra token came from p at the position after them


@dataclass(frozen=True)
class RequestOutput:
    """One sequence's progress after a step: the tokens committed in it and, at the end, why it stopped."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    stats: SpecStats
    round: RoundInfo | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Sequence:
    """Mutable per-request state, private to the engine."""

    request_id: str
    tokens: list[int]  # prompt + committed output
    num_prompt: int
    params: SamplingParams
    k_setting: int | str  # fixed k or "auto"
    generator: torch.Generator
    stopper: StopChecker
    slot: int = -1
    stats: SpecStats = SpecStats()
    estimate: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    emitted_text: int = 0

    def uniform(self, n: int) -> torch.Tensor:  # [n]
        return torch.rand(n, generator=self.generator, dtype=torch.float64)


class SpecEngine:
    """Runs requests to completion over a target `ModelRunner` and an optional drafter."""

    def __init__(
        self,
        target: ModelRunner,
        drafter: Drafter | None,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        config: EngineConfig = EngineConfig(),
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.config = config
        self.costs = CostModel()
        self._waiting: list[_Sequence] = []
        self._running: dict[str, _Sequence] = {}

    # -- requests ------------------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        num_speculative_tokens: int | str | None = None,
    ) -> None:
        """Validate and queue a request; it is prefilled at the next `step`. Raises before any work on bad input."""
        if request_id in self._running or any(s.request_id == request_id for s in self._waiting):
            raise InvalidArgument("request_id", f"request {request_id!r} is already running")
        prompt = self._check_prompt(prompt_ids, params)
        k = parse_num_speculative_tokens(num_speculative_tokens, self.config.max_speculative_tokens)
        if k is None:
            k = self.config.num_speculative_tokens
        if self.drafter is None:
            k = 0
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        stopper = StopChecker(
            params=params,
            eos_token_ids=self.eos_token_ids,
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            max_total_tokens=self.target.max_seq_len,
            num_prompt_tokens=len(prompt),
        )
        self._waiting.append(
            _Sequence(request_id, list(prompt), len(prompt), params, k, generator, stopper)
        )

    def _check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise InvalidArgument("prompt", "the prompt is empty")
        vocab = self.target.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
        limit = self.target.max_seq_len
        if len(prompt) >= limit:
            raise InvalidArgument("prompt", f"the prompt has {len(prompt)} tokens; the context holds {limit}")
        if len(prompt) + params.max_tokens > limit:
            raise InvalidArgument(
                "max_tokens",
                f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds the context ({limit})",
            )
        return prompt

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request: its caches are freed at once. Returns its final output, or None if unknown."""
        for i, seq in enumerate(self._waiting):
            if seq.request_id == request_id:
                del self._waiting[i]
                return self._final(seq, FinishReason.CANCELLED)
        seq = self._running.get(request_id)
        if seq is None:
            return None
        self._free(seq)
        return self._final(seq, FinishReason.CANCELLED)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # -- the loop ------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit waiting requests (prefill) and run one round for the running ones."""
        outputs = self._round(list(self._running.values())) if self._running else []
        outputs += self._admit()
        return outputs

    def _admit(self) -> list[RequestOutput]:
        room = self.target.cache.free_slots
        admitted, self._waiting = self._waiting[:room], self._waiting[room:]
        if not admitted:
            return []
        for seq in admitted:
            seq.slot = self.target.allocate()
            self._running[seq.request_id] = seq
            if self.drafter is not None:
                self.drafter.start(seq.request_id, seq.tokens)
        logits = self._prefill(admitted)  # [A, V]
        first = self._sample_next(logits, admitted)
        return [self._commit(seq, [token], None) for seq, token in zip(admitted, first)]

    def _prefill(self, seqs: list[_Sequence]) -> torch.Tensor:  # [A, V]
        """Prefill prompts in batches of equal length (no padding wasted); logits of each prompt's last token."""
        by_length: dict[int, list[int]] = {}
        for i, seq in enumerate(seqs):
            by_length.setdefault(len(seq.tokens), []).append(i)
        rows: list[torch.Tensor | None] = [None] * len(seqs)
        for members in by_length.values():
            for start in range(0, len(members), PREFILL_BATCH):
                chunk = members[start : start + PREFILL_BATCH]
                logits = self.target.extend([seqs[i].slot for i in chunk], [seqs[i].tokens for i in chunk])
                for i, row in zip(chunk, logits):
                    rows[i] = row
        return torch.stack(rows)  # type: ignore[arg-type]

    def _sample_next(self, logits: torch.Tensor, seqs: Sequence[_Sequence]) -> list[int]:
        """One token per row from the target's logits [N, V], greedy or sampled per request."""
        tokens = logits.argmax(dim=-1).tolist()
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            probs = self._probs(logits[sampled], [seqs[i].params for i in sampled])
            uniform = torch.cat([seqs[i].uniform(1) for i in sampled])
            for i, token in zip(sampled, sample_from(probs, uniform).tolist()):
                tokens[i] = token
        return tokens

    @staticmethod
    def _probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:  # [N, V]
        device = logits.device
        return processed_probs(
            logits,
            torch.tensor([p.temperature for p in params], device=device),
            torch.tensor([p.top_k for p in params], device=device),
            torch.tensor([p.top_p for p in params], device=device),
        )

    def _round(self, seqs: list[_Sequence]) -> list[RequestOutput]:
        ks = [self._choose_k(seq, len(seqs)) for seq in seqs]
        proposals = self._propose(seqs, ks)
        drafts = [p.token_ids for p in proposals]
        t0 = time.perf_counter()
        feeds = [seq.tokens[self.target.length(seq.slot) :] + d for seq, d in zip(seqs, drafts)]
        logits = self.target.extend([s.slot for s in seqs], feeds, all_logits=True)  # [B, T, V]
        results = self._verify(seqs, proposals, logits)
        self._sync()
        self.costs.observe_verify(len(seqs), max(len(f) for f in feeds), time.perf_counter() - t0)
        outputs = []
        for b, (seq, draft) in enumerate(zip(seqs, drafts)):
            n = int(results.num_accepted[b])
            # Keep the target's cache to the committed prefix: the last committed token is read next round.
            self.target.truncate(seq.slot, len(seq.tokens) + n)
            info = RoundInfo(k=ks[b], proposed_token_ids=tuple(draft), num_accepted=n, bonus=n == len(draft))
            seq.estimate.update(len(draft), n)
            seq.stats = SpecStats(seq.stats.rounds + 1, seq.stats.proposed + len(draft), seq.stats.accepted + n)
            outputs.append(self._commit(seq, results.tokens(b), info))
        return outputs

    def _choose_k(self, seq: _Sequence, batch_size: int) -> int:
        if seq.k_setting == AUTO:
            k = self.config.policy.choose(seq.estimate, self.costs, batch_size)
        else:
            k = int(seq.k_setting)
        room = min(seq.params.max_tokens - seq.stopper.num_output, self.target.max_seq_len - len(seq.tokens))
        return max(0, min(k, self.config.max_speculative_tokens, room - 1))

    def _propose(self, seqs: list[_Sequence], ks: list[int]) -> list[Proposal]:
        if self.drafter is None or not any(ks):
            return [Proposal([], None) for _ in seqs]
        requests = [
            DraftRequest(
                seq_id=seq.request_id,
                token_ids=seq.tokens,
                num_tokens=k,
                params=seq.params,
                uniform=None if seq.params.greedy else seq.uniform(k),
            )
            for seq, k in zip(seqs, ks)
        ]
        t0 = time.perf_counter()
        proposals = self.drafter.propose(requests)
        self._sync()
        self.costs.observe_draft(len(seqs), max(ks), time.perf_counter() - t0)
        return proposals

    def _verify(self, seqs: list[_Sequence], proposals: list[Proposal], logits: torch.Tensor) -> VerifyResult:
        """Accept or reject every row's drafts: greedy rows by argmax, sampled rows by rejection sampling."""
        B, T, V = logits.shape
        K = T - 1
        drafts = torch.full((B, K), -1, dtype=torch.long)  # [B, K]
        for b, p in enumerate(proposals):
            drafts[b, : len(p.token_ids)] = torch.tensor(p.token_ids, dtype=torch.long)
        num_draft = torch.tensor([len(p.token_ids) for p in proposals])  # [B]
        sampled = [b for b, s in enumerate(seqs) if not s.params.greedy]
        if len(sampled) < B:
            result = greedy_accept(drafts, num_draft, logits.argmax(dim=-1).cpu())  # [B, K+1]
            if not sampled:
                return result
        sub = self._rejection_sample(
            [seqs[b] for b in sampled], [proposals[b] for b in sampled], logits[sampled], drafts[sampled]
        )
        if len(sampled) == B:
            return sub
        out, n = result.output_token_ids.clone(), result.num_accepted.clone()
        out[sampled], n[sampled] = sub.output_token_ids, sub.num_accepted
        return VerifyResult(out, n)

    def _rejection_sample(
        self,
        seqs: list[_Sequence],
        proposals: list[Proposal],
        logits: torch.Tensor,  # [S, K+1, V]
        drafts: torch.Tensor,  # [S, K]
    ) -> VerifyResult:
        S, T, V = logits.shape
        K = T - 1
        params = [s.params for s in seqs for _ in range(T)]
        p = self._probs(logits.reshape(S * T, V), params).view(S, T, V)  # [S, K+1, V]
        q = None
        if any(prop.q is not None for prop in proposals):
            q = torch.zeros(S, K, V, dtype=p.dtype, device=p.device)  # [S, K, V]
            for i, prop in enumerate(proposals):
                if prop.q is not None:
                    q[i, : prop.q.shape[0]] = prop.q
        num_draft = torch.tensor([len(prop.token_ids) for prop in proposals])
        uniform_accept = torch.stack(
            [torch.cat([s.uniform(len(prop.token_ids)), torch.ones(K - len(prop.token_ids), dtype=torch.float64)])
             for s, prop in zip(seqs, proposals)]
        ).to(p.dtype)  # [S, K]; padding positions are invalid and never accepted
        uniform_sample = torch.cat([s.uniform(1) for s in seqs]).to(p.dtype)  # [S]
        return rejection_sample(
            drafts.to(p.device), num_draft.to(p.device), p, q, uniform_accept.to(p.device), uniform_sample.to(p.device)
        )

    def _commit(self, seq: _Sequence, tokens: list[int], info: RoundInfo | None) -> RequestOutput:
        committed = seq.stopper.commit(tokens)
        seq.tokens.extend(committed)
        reason = seq.stopper.finish_reason
        if reason is None:
            if self.drafter is not None:
                self.drafter.observe(seq.request_id, len(seq.tokens))
        else:
            self._free(seq)
        text = seq.stopper.stable_text
        new_text, seq.emitted_text = text[seq.emitted_text :], len(text)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tuple(committed),
            new_text=new_text,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt,
            num_output_tokens=seq.stopper.num_output,
            stats=seq.stats,
            round=info,
        )

    def _free(self, seq: _Sequence) -> None:
        self._running.pop(seq.request_id, None)
        if seq.slot >= 0:
            self.target.release(seq.slot)
            seq.slot = -1
        if self.drafter is not None:
            self.drafter.release(seq.request_id)

    def _final(self, seq: _Sequence, reason: FinishReason) -> RequestOutput:
        return RequestOutput(seq.request_id, (), "", reason, seq.num_prompt, seq.stopper.num_output, seq.stats)

    def _sync(self) -> None:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)
