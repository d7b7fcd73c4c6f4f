"""The speculative decoding engine: continuous batching of draft -> verify -> accept rounds.

`step()` runs one round for every running sequence: the drafter proposes k tokens per sequence (one batched
pass per draft position), the target scores every row's last committed token plus its drafts in one batched
forward, and rejection sampling decides what is kept. Sequences join (prefill) and leave between rounds.
Plain decoding is the same round with k = 0, so the baseline shares every line of code but the drafter.

A request may constrain its output (`SamplingParams.constraint`): its sequence then holds a `GrammarState`, moved
by the tokens it commits, whose masks go with every call that samples for it (the target's prefill and verify, the
draft model's steps). Tokens the grammar forces are verified as a proposal that needs no draft call, and where
they end the output they are committed with no forward pass at all; docs/engine.md says why each step is exact.

The engine owns what is per request (randomness, k, stopping, text, grammar); the drafter and the `Target` own the
models. Both may run in this process or behind an RPC boundary (the server's router runs this same engine).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from specdec_core.adaptive import AcceptanceEstimate, AdaptivePolicy, CostModel, FreeProposal
from specdec_core.config import AUTO, SamplingParams, parse_num_speculative_tokens
from specdec_core.drafters.base import DraftRequest, Drafter, Hybrid, Proposal
from specdec_core.errors import InvalidArgument
from specdec_core.faults import Faults
from specdec_core.grammar.compiler import CompiledGrammar, GrammarCompiler
from specdec_core.grammar.constraint import Constraint
from specdec_core.grammar.masks import draft_masks, verify_masks
from specdec_core.grammar.state import GrammarState
from specdec_core.stopping import FinishReason, IncrementalDetokenizer, StopChecker
from specdec_core.target import PartialPrefill, PartialVerifyFailure, PrefillItem, Target, VerifyItem

log = logging.getLogger(__name__)

NO_SPECULATION = "none"  # a request's `speculation_method` for plain decoding
FORCED = "forced"  # `RoundInfo.method` of a round that verified (or committed) the tokens a grammar forces
FORCED_LOOKAHEAD = 32  # forced tokens looked for per round: a longer run is taken over several rounds
UNTRIED_LABEL_TRIALS = 2.0  # a free proposal's label with fewer (decayed) trials at its first position is explored


@dataclass(frozen=True)
class EngineConfig:
    max_speculative_tokens: int = 8  # the largest k a request may ask for or `auto` may choose
    num_speculative_tokens: int | str = AUTO  # default for requests that do not say
    # How `auto` chooses k. Its `max_k` is set to max_speculative_tokens here, whatever the policy passed says: the
    # largest k `auto` considers, and the longest a fixed k is priced at, is the largest a request may ask for.
    policy: AdaptivePolicy = AdaptivePolicy()

    def __post_init__(self) -> None:
        if self.policy.max_k != self.max_speculative_tokens:
            object.__setattr__(self, "policy", replace(self.policy, max_k=self.max_speculative_tokens))


@dataclass(frozen=True)
class SpecStats:
    rounds: int = 0
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    draft_variant: str = ""  # the draft variant that drafted for the request, where a server A/B-tests several

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
    # For requests added with return_probs: q and p of each proposed token (see `sampling.token_probs`).
    draft_probs: tuple[float, ...] | None = None
    target_probs: tuple[float, ...] | None = None
    method: str | None = None  # the drafting method whose proposal was verified; None: no draft was asked for
    seconds: float = 0.0  # the round's wall time, drafting and verifying (shared by every row of its batch)


@dataclass(frozen=True)
class RequestOutput:
    """One sequence's progress after a step: the tokens committed in it and, at the end, why it stopped."""

    seq_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    stats: SpecStats
    num_cached_tokens: int = 0  # of the prompt, the tokens the target read from its prefix cache
    round: RoundInfo | None = None
    error: Exception | None = None  # why a request ended with FinishReason.ERROR

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Sequence:
    """Mutable per-request state, private to the engine."""

    seq_id: str
    tokens: list[int]  # prompt + committed output
    num_prompt: int
    params: SamplingParams
    k_setting: int | str  # fixed k or "auto"
    generator: torch.Generator
    stopper: StopChecker
    return_probs: bool = False  # report q and p of the proposals in each RoundInfo
    cache_salt: str | None = None  # prefix caching: shares cached prefixes only with sequences of this salt
    num_cached: int = 0  # prompt tokens the target read from its prefix cache
    started: bool = False  # prefilled: the target holds state for it
    drafting: bool = False  # the drafter holds state for it (started the first time it drafts, again after a failure)
    draft_failed: bool = False  # the drafter could not start it: it decodes plainly
    drafted_upto: int = 0  # committed tokens after its last round with drafts: the drafter has read up to here
    draft_cached: int | None = None  # before a start: of its tokens, what the drafter's prefix cache holds
    # What the request allows (`speculation_method`): the draft model (`drafter`) and the free drafter (hybrid).
    model_allowed: bool = True
    free_allowed: bool = True
    free_started: bool = False  # the free drafter holds state for it
    free_failed: bool = False  # the free drafter failed it: the request goes on without free proposals
    grammar: GrammarState | None = None  # a constrained request's, after its committed output (never its drafts)
    stats: SpecStats = SpecStats()
    estimate: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    emitted_text: int = 0

    def uniform(self, n: int) -> torch.Tensor:  # [n]
        return torch.rand(n, generator=self.generator, dtype=torch.float64)


class SpecEngine:
    """Runs requests to completion over a `Target` and an optional drafter: one, or a `Hybrid` pair (a model-free
    drafter whose proposals each round weighs against the draft model's)."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | Hybrid | None,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        config: EngineConfig = EngineConfig(),
    ) -> None:
        self.target = target
        # `drafter` is the one `auto` chooses k for; `free_drafter`'s proposals cost no draft call.
        self.drafter, self.free_drafter = (drafter.model, drafter.free) if isinstance(drafter, Hybrid) else (drafter, None)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.config = config
        self.costs = CostModel()
        # Acceptance over all recent rounds: where a new request's own estimate starts.
        self.acceptance = AcceptanceEstimate(decay=0.99)
        # Acceptance per proposal label (`Proposal.label`): how much of a labelled proposal is worth verifying.
        self.acceptance_by_label: dict[str, AcceptanceEstimate] = {}
        self._waiting: list[_Sequence] = []
        self._running: dict[str, _Sequence] = {}
        self._grammars: GrammarCompiler | None = None  # built for the first constrained request (`compile`)
        self._grammars_lock = threading.Lock()
        self._draft_faults = Faults("drafter")  # a drafter that raises: its rows decode plainly, retried after a rest

    # -- requests ------------------------------------------------------------------------------------------------

    def add_request(
        self,
        seq_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        num_speculative_tokens: int | str | None = None,
        return_probs: bool = False,
        cache_salt: str | None = None,
        speculation_method: str | None = None,
    ) -> None:
        """Validate and queue a request; it is prefilled at the next `step`. Raises before any work on bad input.
        `return_probs`: each round's `RoundInfo` carries q and p of the proposed tokens (a softmax per row more).
        `cache_salt`: the target and the drafter share cached prefixes only among requests of the same salt (None:
        the shared namespace of requests without one). `speculation_method`: narrows drafting to one of `methods`,
        or "none" (plain decoding); None or "auto": the engine chooses among all it runs. `params.constraint` is
        compiled here: one that does not compile is `InvalidArgument` naming its kind."""
        if seq_id in self._running or any(s.seq_id == seq_id for s in self._waiting):
            raise InvalidArgument("seq_id", f"request {seq_id!r} is already running")
        prompt = self._check_prompt(prompt_ids, params)
        model_allowed, free_allowed = self._allowed(speculation_method)
        k = self._k_setting(num_speculative_tokens) if model_allowed or free_allowed else 0
        grammar = None if params.constraint is None else GrammarState(self.compile(params.constraint))
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        stopper = StopChecker(
            params=params,
            eos_token_ids=self.eos_token_ids,
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            max_total_tokens=self.target.max_seq_len,
            num_prompt_tokens=len(prompt),
        )
        seq = _Sequence(seq_id, list(prompt), len(prompt), params, k, generator, stopper, return_probs, cache_salt,
                        model_allowed=model_allowed, free_allowed=free_allowed, grammar=grammar)
        seq.estimate = AcceptanceEstimate.starting_from(self.acceptance, self.config.max_speculative_tokens)
        self._waiting.append(seq)

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """`constraint` compiled (kept in the compiler's LRU), or `InvalidArgument` naming its kind. The compiler is
        built with the first constrained request: its tables of the tokenizer take seconds at a large vocabulary,
        which an engine never asked for structured output should not pay. Its masks span the target's logits
        (`vocab_size`), eos allowed exactly where the grammar can end. Thread-safe, unlike the rest of the engine:
        a server compiles a request's constraint on another thread first, so that `add_request` finds it compiled
        and no round waits for the tables or a compile."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.target.vocab_size, sorted(self.eos_token_ids))
        return self._grammars.compile(constraint)

    @property
    def methods(self) -> tuple[str, ...]:
        """The drafting methods this engine runs: what a request's `speculation_method` may name besides "auto" and
        "none"."""
        return tuple(d.name for d in (self.free_drafter, self.drafter) if d is not None)

    def _allowed(self, speculation_method: str | None) -> tuple[bool, bool]:
        """Whether a request with this `speculation_method` may use the draft model (`drafter`) and the free
        drafter: both for "auto"; neither for "none"."""
        if speculation_method in (None, AUTO):
            return True, True
        if speculation_method == NO_SPECULATION:
            return False, False
        if speculation_method not in self.methods:
            choices = ", ".join((AUTO, *self.methods, NO_SPECULATION))
            raise InvalidArgument("speculation_method", f"{speculation_method!r} is not run here; choose one of {choices}")
        return speculation_method == self.drafter.name, self.free_drafter is not None and (
            speculation_method == self.free_drafter.name)

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

    def abort(self, seq_id: str) -> RequestOutput | None:
        """Cancel a request: its caches are freed at once. Returns its final output, or None if unknown."""
        for i, seq in enumerate(self._waiting):
            if seq.seq_id == seq_id:
                del self._waiting[i]
                return self._final(seq, FinishReason.CANCELLED)
        seq = self._running.get(seq_id)
        if seq is None:
            return None
        self._free(seq)
        return self._final(seq, FinishReason.CANCELLED)

    def set_speculation(self, seq_id: str, num_speculative_tokens: int | str) -> bool:
        """From its next round on, a queued or running request speculates as `num_speculative_tokens` says (a k,
        or `auto`). False when there is no such request."""
        seq = self._running.get(seq_id) or next((s for s in self._waiting if s.seq_id == seq_id), None)
        if seq is None:
            return False
        seq.k_setting = self._k_setting(num_speculative_tokens)
        return True

    def _k_setting(self, num_speculative_tokens: int | str | None) -> int | str:
        """What a request asks (None: the engine's default), validated; 0 without a drafter."""
        k = parse_num_speculative_tokens(num_speculative_tokens, self.config.max_speculative_tokens)
        if self.drafter is None:
            return 0
        return self.config.num_speculative_tokens if k is None else k

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def waiting_request_ids(self) -> list[str]:
        """Requests not yet admitted (waiting for a free slot), oldest first."""
        return [seq.seq_id for seq in self._waiting]

    # -- the loop ------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit waiting requests (prefill) and run one round for the running ones."""
        outputs = self._round(list(self._running.values())) if self._running else []
        outputs += self._admit()
        return outputs

    def _admit(self) -> list[RequestOutput]:
        room = self.target.free_slots
        admitted, self._waiting = self._waiting[:room], self._waiting[room:]
        if not admitted:
            return []
        items = [
            PrefillItem(seq.seq_id, seq.tokens, seq.params.shaping,
                        None if seq.params.greedy else float(seq.uniform(1)), seq.cache_salt,
                        None if seq.grammar is None else verify_masks(seq.grammar, []))
            for seq in admitted
        ]
        try:
            first = self.target.prefill(items)
        except PartialPrefill as exc:  # no room for some after all: they wait again, first in line
            first = exc.results
            self._waiting = [seq for seq, done in zip(admitted, first) if done is None] + self._waiting
        except Exception as exc:  # the target released whatever it had allocated for these
            log.warning("prefill of %d requests failed: %s", len(admitted), exc, exc_info=True)
            return [self._final(seq, FinishReason.ERROR, exc) for seq in admitted]
        outputs = []
        for seq, done in zip(admitted, first):
            if done is None:
                continue
            # The drafter starts the sequence the first time it drafts: under load `auto` may keep it at k = 0
            # for its whole life, and then the drafter never reads its context.
            seq.started, seq.num_cached = True, done.num_cached_tokens
            self._running[seq.seq_id] = seq
            outputs.append(self._commit(seq, [done.first_token_id], None))
        return outputs

    def _round(self, seqs: list[_Sequence]) -> list[RequestOutput]:
        """One round for `seqs`. Should the target fail, every sequence of the round ends with an error and its
        state is released: a failed call leaves caches in no known state. A drafter that fails costs only drafts
        (`_draft_failed`). A constrained row whose grammar forces the rest of its output commits it without taking
        part (`_commit_forced`)."""
        try:
            forced = self._forced(seqs)
        except Exception as exc:
            return self._fail(seqs, exc)
        ending = [self._completes(seq, chain) for seq, chain in zip(seqs, forced)]
        outputs = [self._commit_forced(seq, chain) for seq, chain, end in zip(seqs, forced, ending) if end]
        rest = [(seq, chain[: self._spec_cap(seq)]) for seq, chain, end in zip(seqs, forced, ending) if not end]
        if rest:
            outputs += self._speculate([seq for seq, _ in rest], [chain for _, chain in rest])
        return outputs

    def _fail(self, seqs: list[_Sequence], exc: Exception) -> list[RequestOutput]:
        log.warning("a round of %d sequences failed: %s", len(seqs), exc, exc_info=True)
        for seq in seqs:
            self._free(seq)
        return [self._final(seq, FinishReason.ERROR, exc) for seq in seqs]

    def _speculate(self, seqs: list[_Sequence], forced: list[list[int]]) -> list[RequestOutput]:
        """Draft, verify and accept for `seqs`; a row with `forced` tokens verifies them instead of drafting."""
        started = time.perf_counter()
        try:
            offers = self._free_proposals(seqs, forced)
            ks, takes_free = self._choose_ks(seqs, offers)
            for i, chain in enumerate(forced):  # forced tokens: all a round can commit, for no draft call
                if chain:
                    ks[i], takes_free[i] = 0, True
            if self.drafter is not None and any(ks):
                ks = [0] * len(ks) if self._draft_faults.resting() else self._start_drafting(seqs, ks)
            proposals = [offer if free else self._trim(self._cut(seq, p), len(seqs))
                         for seq, p, offer, free in zip(seqs, self._propose(seqs, ks), offers, takes_free)]
            items = [self._verify_item(seq, proposal) for seq, proposal in zip(seqs, proposals)]
            t0 = time.perf_counter()
            outcomes, failed = self._verify(items)
        except Exception as exc:
            return self._fail(seqs, exc)
        if not failed:
            self.costs.observe_verify(len(seqs), 1 + max(len(p.token_ids) for p in proposals), time.perf_counter() - t0)
        seconds = time.perf_counter() - started
        outputs = []
        for i, (seq, proposal, k, free, outcome) in enumerate(zip(seqs, proposals, ks, takes_free, outcomes)):
            if i in failed:  # its target replica is gone: this request ends, the others go on
                self._free(seq)
                outputs.append(self._final(seq, FinishReason.ERROR, failed[i]))
                continue
            draft, n = proposal.token_ids, outcome.num_accepted
            method = (FORCED if forced[i] else self.free_drafter.name if free
                      else (proposal.method or self.drafter.name) if k > 0 else None)
            info = RoundInfo(k=len(draft) if free else k, proposed_token_ids=tuple(draft), num_accepted=n,
                             bonus=n == len(draft), draft_probs=proposal.draft_probs,
                             target_probs=outcome.target_probs, method=method, seconds=seconds)
            if not free:  # the request's estimate is the draft model's: a free proposal's record is its label's
                seq.estimate.update(len(draft), n, k)
                self.acceptance.update(len(draft), n, k)
            if proposal.label is not None:
                self._label_estimate(proposal.label).update(len(draft), n)
            seq.stats = SpecStats(seq.stats.rounds + 1, seq.stats.proposed + len(draft), seq.stats.accepted + n)
            outputs.append(self._commit(seq, list(outcome.token_ids), info))
            if k > 0 and seq.drafting:
                seq.drafted_upto = len(seq.tokens)
        return outputs

    def _verify(self, items: list[VerifyItem]) -> tuple[list, dict[int, Exception]]:
        """Outcomes, and the rows that failed (when only some did)."""
        try:
            return self.target.verify(items), {}
        except PartialVerifyFailure as exc:
            log.warning("verify: %s", exc)
            return exc.outcomes, exc.errors

    @staticmethod
    def _verify_item(seq: _Sequence, proposal: Proposal) -> VerifyItem:
        """The target's share of the round; randomness drawn in a fixed order (accept tests, then the sample).
        A constrained row's masks are its grammar's along the drafts (`verify_masks`: a proposal that leaves the
        grammar here has a q, and is verified whole)."""
        n = len(proposal.token_ids)
        greedy = seq.params.greedy
        return VerifyItem(
            seq_id=seq.seq_id,
            last_token_id=seq.tokens[-1],
            draft_token_ids=proposal.token_ids,
            q=proposal.q,
            shaping=seq.params.shaping,
            uniform_accept=None if greedy else seq.uniform(n),
            uniform_sample=None if greedy else float(seq.uniform(1)),
            return_probs=seq.return_probs,
            allowed=None if seq.grammar is None else verify_masks(seq.grammar, proposal.token_ids),
        )

    @staticmethod
    def _cut(seq: _Sequence, proposal: Proposal) -> Proposal:
        """A constrained row's point-mass proposal (an n-gram's, a suffix's, greedy drafts) cut where it leaves the
        grammar: exact, the cut position sampled from the masked p as the residual of a point mass would be. A
        proposal with a q is never cut: drawn from the masked q it stays in the grammar, and one drawn from any
        other q is exact only verified whole (`grammar/masks.py`)."""
        if seq.grammar is None or proposal.q is not None or not proposal.token_ids:
            return proposal
        return proposal.prefix(draft_masks(seq.grammar, proposal.token_ids).num_valid)

    def _choose_ks(self, seqs: list[_Sequence], offers: list[Proposal | None]) -> tuple[list[int], list[bool]]:
        """Each sequence's k this round (its fixed k, or the batch's adaptive k; capped by its room left), and
        whether it verifies its free proposal (`offers`) instead of drafting."""
        rows = [(seq.estimate, self._fixed_k(seq)) for seq in seqs]
        free = [None if offer is None else self._free_value(offer) for offer in offers]
        rooms = [self._room(seq) for seq in seqs]
        k_auto, use_free = 0, True
        if any(k is None for _, k in rows):
            unread = sum(self._unread(seq) for seq, (_, fixed) in zip(seqs, rows) if fixed is None)
            choice = self.config.policy.choose_round(rows, self.costs, len(seqs), self.costs.catch_up_cost(unread),
                                                     sum(rooms), free)
            k_auto, use_free = choice.k, choice.free
            if k_auto > 0 and unread > 0 and not self._start_pays_after_admission(rows, unread, sum(rooms)):
                k_auto = 0
        ks, takes_free = [], []
        for seq, (estimate, fixed), room, offer in zip(seqs, rows, rooms, free):
            k = max(0, min(k_auto if fixed is None else fixed, self.config.max_speculative_tokens, room - 1))
            k = 0 if seq.draft_failed else k
            # A fixed k is the request's: it takes the better proposal whatever `auto` chose for the others.
            expected = estimate.expected_tokens(self.config.max_speculative_tokens)
            take = (use_free or fixed is not None) and self.config.policy.takes_free(expected, k, offer)
            ks.append(0 if take else k)
            takes_free.append(take)
        return ks, takes_free

    def _fixed_k(self, seq: _Sequence) -> int | None:
        """The draft model's k for `seq` where the request fixed it (0 where it may not use the draft model);
        None: `auto` chooses."""
        if not seq.model_allowed:
            return 0
        return None if seq.k_setting == AUTO else int(seq.k_setting)

    def _room(self, seq: _Sequence) -> int:
        """Tokens the sequence may still commit."""
        return min(seq.params.max_tokens - seq.stopper.num_output, self.target.max_seq_len - len(seq.tokens))

    # -- free proposals (hybrid drafting) -------------------------------------------------------------------------

    def _free_proposals(self, seqs: list[_Sequence], forced: list[list[int]]) -> list[Proposal | None]:
        """Each row's proposal that costs no draft call (None where it has none): its `forced` tokens, else the free
        drafter's, cut where it leaves the row's grammar and by its label's record. A lookup, no model call: made
        before k is chosen, so the choice can weigh it."""
        offers: list[Proposal | None] = [self._forced_proposal(seq, chain) if chain else None
                                         for seq, chain in zip(seqs, forced)]
        if self.free_drafter is None:
            return offers
        caps = [0 if chain else self._free_cap(seq) for seq, chain in zip(seqs, forced)]
        rows = [i for i, cap in enumerate(caps) if cap > 0 and self._start_free(seqs[i])]
        if not rows:
            return offers
        # Without the grammar: the free drafter's proposals are point masses, cut where they leave it (`_cut`).
        requests = [DraftRequest(seqs[i].seq_id, seqs[i].tokens, caps[i], seqs[i].params.shaping, None,
                                 seqs[i].return_probs) for i in rows]
        try:
            proposals = self.free_drafter.propose(requests)
        except Exception as exc:  # a failed lookup costs these rows their free proposals, never the request
            log.warning("the %s drafter failed, its rows go on without it: %s", self.free_drafter.name, exc,
                        exc_info=True)
            for i in rows:
                self._stop_free(seqs[i])
            return offers
        for i, proposal in zip(rows, proposals):
            proposal = self._cut(seqs[i], proposal)
            if proposal.token_ids:
                offers[i] = self._trim(proposal, len(seqs))
        return offers

    def _free_cap(self, seq: _Sequence) -> int:
        """The longest free proposal `seq` may verify (0 where it may not use the free drafter)."""
        if not seq.free_allowed or seq.free_failed or seq.k_setting == 0:
            return 0
        return self._spec_cap(seq)

    def _spec_cap(self, seq: _Sequence) -> int:
        """The longest proposal `seq` may verify this round: its fixed k (else the largest), within its room."""
        k = self.config.max_speculative_tokens if seq.k_setting == AUTO else int(seq.k_setting)
        return max(0, min(k, self._room(seq) - 1))

    # -- forced tokens (structured output) ------------------------------------------------------------------------

    def _forced(self, seqs: list[_Sequence]) -> list[list[int]]:
        """Per row, the tokens its grammar forces next (one allowed token at each position), at most its room.
        Only for rows that speculate: a request at k = 0 (plain decoding) stays token by token."""
        return [seq.grammar.forced(min(self._room(seq), FORCED_LOOKAHEAD))
                if seq.grammar is not None and seq.k_setting != 0 else [] for seq in seqs]

    def _completes(self, seq: _Sequence, chain: list[int]) -> bool:
        """The forced tokens end the output: they reach an eos, or fill the room it has left."""
        return bool(chain) and (chain[-1] in self.eos_token_ids or len(chain) >= self._room(seq))

    @staticmethod
    def _forced_proposal(seq: _Sequence, chain: list[int]) -> Proposal:
        """Forced tokens as a point-mass proposal. Masked, p and q are 1 on each: always accepted, and the bonus
        position after them is sampled from the masked p as any other. No label: its record would always be 1."""
        return Proposal(list(chain), None, (1.0,) * len(chain) if seq.return_probs else None)

    def _commit_forced(self, seq: _Sequence, chain: list[int]) -> RequestOutput:
        """Commit forced tokens that end the output, with no forward pass: masked, p is 1 on each whatever the
        target's logits, so verifying them could only accept them; their eos (or the room filled) ends the output,
        so no later round needs the target's cache to hold them. `ignore_eos` is refused with a constraint."""
        n = len(chain)
        seq.stats = SpecStats(seq.stats.rounds + 1, seq.stats.proposed + n, seq.stats.accepted + n)
        ones = (1.0,) * n if seq.return_probs else None
        info = RoundInfo(k=n, proposed_token_ids=tuple(chain), num_accepted=n, bonus=False, draft_probs=ones,
                         target_probs=ones, method=FORCED)
        return self._commit(seq, chain, info)

    def _start_free(self, seq: _Sequence) -> bool:
        """Start `seq` on the free drafter (it indexes the context: no model runs). False where that failed."""
        if not seq.free_started:
            try:
                self.free_drafter.start(seq.seq_id, seq.tokens, seq.cache_salt)
            except Exception as exc:
                log.warning("the %s drafter could not start %s: %s", self.free_drafter.name, seq.seq_id, exc)
                seq.free_failed = True
                return False
            seq.free_started = True
        return True

    def _stop_free(self, seq: _Sequence) -> None:
        seq.free_failed = True
        if seq.free_started:
            seq.free_started = False
            try:
                self.free_drafter.release(seq.seq_id)
            except Exception:  # it has failed already: what it holds is lost either way
                log.warning("the %s drafter failed to release %s", self.free_drafter.name, seq.seq_id, exc_info=True)

    def _free_value(self, proposal: Proposal) -> FreeProposal:
        """What verifying `proposal` is expected to commit, by its label's record. A label with (almost) no record
        is valued as if always right: trying it costs only a wider verify, and an untried label is never learnt."""
        n = len(proposal.token_ids)
        record = self.acceptance_by_label.get(proposal.label) if proposal.label is not None else None
        if record is None or not record.trials or record.trials[0] < UNTRIED_LABEL_TRIALS:
            return FreeProposal(float(n + 1), n)
        return FreeProposal(record.expected_tokens(n)[n], n)

    def _start_pays_after_admission(self, rows: list[tuple[AcceptanceEstimate, int | None]], unread: int,
                                    horizon: int) -> bool:
        """Starting drafts is an investment that pays off over the rows' later rounds. Requests admitted right after
        this round will share those rounds (a burst of arrivals fills the batch one prefill at a time): judge the
        investment at the batch size they make, with their own reads and tokens counted."""
        joining = self._waiting[: self.target.free_slots]
        if not joining:
            return True
        rows = rows + [(seq.estimate, None if seq.k_setting == AUTO else int(seq.k_setting)) for seq in joining]
        unread += sum(self._unread(seq) for seq in joining if seq.k_setting == AUTO)
        horizon += sum(seq.params.max_tokens for seq in joining)
        return self.config.policy.pays(rows, self.costs, len(rows), self.costs.catch_up_cost(unread), horizon)

    def _unread(self, seq: _Sequence) -> int:
        """Context the drafter would have to read before drafting for `seq`: the tokens committed since its last
        round with drafts (none after a round with drafts); if it never drafted, all of it but what the drafter's
        prefix cache holds (a conversation's next turn finds the last one there), asked once per start."""
        if seq.drafting:
            return len(seq.tokens) - seq.drafted_upto
        if self.drafter is None:
            return 0
        if seq.draft_cached is None:
            try:
                seq.draft_cached = self.drafter.cached(seq.seq_id, seq.tokens, seq.cache_salt)
            except Exception as exc:  # an estimate: without it a start is priced at the whole context
                log.warning("drafter could not say what it holds of %s: %s", seq.seq_id, exc)
                seq.draft_cached = 0
        return len(seq.tokens) - seq.draft_cached

    def _start_drafting(self, seqs: list[_Sequence], ks: list[int]) -> list[int]:
        """Start, on the drafter, the sequences that draft this round for the first time; the time per token of
        context read teaches the cost model what starting (and catching up) costs. A sequence the drafter cannot
        take decodes plainly from then on: a drafter's failure costs speculation, never the request."""
        out = list(ks)
        new = [i for i, (seq, k) in enumerate(zip(seqs, ks)) if k > 0 and not seq.drafting]
        start_many = getattr(self.drafter, "start_many", None)
        if len(new) > 1 and start_many is not None:
            t0 = time.perf_counter()
            try:
                cached = start_many([(seqs[i].seq_id, seqs[i].tokens, seqs[i].cache_salt) for i in new])
            except Exception as exc:  # all or none started: each is tried alone below, so one cannot fail the rest
                log.warning("drafter could not start %d sequences together, trying each: %s", len(new), exc)
            else:
                self._started([seqs[i] for i in new], cached, time.perf_counter() - t0)
                return out
        for i in new:
            t0 = time.perf_counter()
            try:
                cached = [self.drafter.start(seqs[i].seq_id, seqs[i].tokens, seqs[i].cache_salt)]
            except Exception as exc:
                log.warning("drafter could not start %s, it decodes without drafts: %s", seqs[i].seq_id, exc)
                seqs[i].draft_failed = True
                out[i] = 0
                continue
            self._started([seqs[i]], cached, time.perf_counter() - t0)
        return out

    def _started(self, seqs: list[_Sequence], cached: list[int], seconds: float) -> None:
        """The drafter started `seqs`, finding `cached` tokens of each in its prefix cache, in `seconds`. Starts
        that found their contexts cached say nothing about what reading a context costs (their time is mostly the
        call's fixed part): only full reads teach the price."""
        if not any(cached):
            self.costs.observe_catch_up(sum(len(seq.tokens) for seq in seqs), seconds)
        for seq in seqs:
            seq.drafting, seq.drafted_upto = True, len(seq.tokens)

    def _propose(self, seqs: list[_Sequence], ks: list[int]) -> list[Proposal]:
        """Each row's proposal; rows at k = 0 get an empty one without troubling the drafter."""
        proposals = [Proposal([], None, () if seq.return_probs else None) for seq in seqs]
        rows = [i for i, k in enumerate(ks) if k > 0]
        if self.drafter is None or not rows:
            return proposals
        # A drafting row that sat at k = 0 has context to catch up on: that call's time is not a k-draft's.
        stale = sum(self._unread(seqs[i]) for i in rows)
        requests = [
            DraftRequest(
                seq_id=seqs[i].seq_id,
                token_ids=seqs[i].tokens,
                num_tokens=ks[i],
                shaping=seqs[i].params.shaping,
                uniform=None if seqs[i].params.greedy else seqs[i].uniform(ks[i]),
                return_probs=seqs[i].return_probs,
                grammar=seqs[i].grammar,  # a draft model masks its q with it; point-mass drafters may ignore it
            )
            for i in rows
        ]
        t0 = time.perf_counter()
        try:
            drafted = self.drafter.propose(requests)
        except Exception as exc:  # as a remote drafter's failure: these rows' drafts, never their requests
            self._draft_failed([seqs[i] for i in rows], exc)
            return proposals
        self._draft_faults.succeeded()
        if stale <= len(seqs):
            self.costs.observe_draft(len(seqs), max(ks), time.perf_counter() - t0)
        for i, proposal in zip(rows, drafted):
            proposals[i] = proposal
        return proposals

    def _label_estimate(self, label: str) -> AcceptanceEstimate:
        # A weak prior (one trial): a position is only tried again when the record says it may pay, so each
        # trial there must count.
        return self.acceptance_by_label.setdefault(label, AcceptanceEstimate(weight=1.0, decay=0.99))

    def _trim(self, proposal: Proposal, batch_size: int) -> Proposal:
        """A labelled proposal cut to the length t >= 1 that maximises E(t) / c_verify(B, t + 1) by its label's
        record (its rates per position). The cut depends on the context and on past rounds, never on this round's
        verification, so the output distribution is unchanged. At least one token stays: a label that is never
        tried again is never learnt."""
        est = self.acceptance_by_label.get(proposal.label) if proposal.label is not None else None
        n = len(proposal.token_ids)
        if est is None or n <= 1:
            return proposal
        costs = [self.costs.verify_cost(batch_size, t + 1) for t in range(n + 1)]
        if costs[0] is None:
            return proposal
        gains = est.expected_tokens(n)
        best = max(range(1, n + 1), key=lambda t: (gains[t] / costs[t], -t))
        return proposal.prefix(best)

    def _commit(self, seq: _Sequence, tokens: list[int], info: RoundInfo | None) -> RequestOutput:
        committed = seq.stopper.commit(tokens)
        seq.tokens.extend(committed)
        if seq.grammar is not None and seq.grammar.advance(committed) != len(committed):
            # Every token was sampled under the grammar's masks: one it refuses is the engine's fault (or a target
            # that ignored the masks), and the grammar's state no longer says where the output is.
            self._free(seq)
            return self._final(seq, FinishReason.ERROR, RuntimeError(
                f"{seq.seq_id}: committed tokens {committed} leave the {seq.params.constraint.kind} constraint"))
        reason = seq.stopper.finish_reason
        if reason is None:
            if seq.drafting:
                try:
                    self.drafter.observe(seq.seq_id, len(seq.tokens))
                except Exception as exc:
                    self._draft_failed([seq], exc)
            if seq.free_started:
                self.free_drafter.observe(seq.seq_id, len(seq.tokens))
        else:
            self._free(seq)
        text = seq.stopper.stable_text
        new_text, seq.emitted_text = text[seq.emitted_text :], len(text)
        return RequestOutput(
            seq_id=seq.seq_id,
            new_token_ids=tuple(committed),
            new_text=new_text,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt,
            num_output_tokens=seq.stopper.num_output,
            stats=seq.stats,
            num_cached_tokens=seq.num_cached,
            round=info,
        )

    def _free(self, seq: _Sequence) -> None:
        self._running.pop(seq.seq_id, None)
        if seq.started:
            seq.started = False
            self.target.release(seq.seq_id)
        self._drop_draft(seq)
        if seq.free_started:
            seq.free_started = False
            self.free_drafter.release(seq.seq_id)

    def _draft_failed(self, seqs: list[_Sequence], error: Exception) -> None:
        """A drafter call for `seqs` raised: what it holds for them is in no known state, so it is dropped, and each
        is started again (with all it has committed) the next round it drafts. Their output stays the target's."""
        self._draft_faults.failed(error)
        for seq in seqs:
            self._drop_draft(seq)

    def _drop_draft(self, seq: _Sequence) -> None:
        """Free the drafter's state for `seq`, if it holds any."""
        if seq.drafting:
            seq.drafting, seq.draft_cached = False, None
            try:
                self.drafter.release(seq.seq_id)
            except Exception as exc:  # what it held is lost either way
                self._draft_faults.failed(exc)

    def _final(self, seq: _Sequence, reason: FinishReason, error: Exception | None = None) -> RequestOutput:
        return RequestOutput(
            seq.seq_id, (), "", reason, seq.num_prompt, seq.stopper.num_output, seq.stats, seq.num_cached, error=error
        )
