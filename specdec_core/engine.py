"""The speculative decoding engine: continuous batching of draft -> verify -> accept rounds.

`step()` runs one round for every running sequence: the drafter proposes k tokens per sequence (one batched
pass per draft position), the target scores every row's last committed token plus its drafts in one batched
forward, and rejection sampling decides what is kept. Sequences join (prefill) and leave between rounds.
Plain decoding is the same round with k = 0, so the baseline shares every line of code but the drafter. When every
running row decodes plainly, the target runs those rounds by itself (`decode_run`), and the engine commits each step
as it arrives; it stops the run to cut in (a request to admit, a row that speculates again).

The engine keeps the loop: admit, choose k, propose, verify, commit. What its drafters hold per sequence is a
`DraftSession`'s (`drafters/session.py`); a hybrid's free proposals and the per-label records are the
`HybridDrafter`'s (`drafters/hybrid.py`); structured output's steps are `structured.py`'s. The engine owns what is per
request (randomness, k, stopping, text, grammar); the drafter and the `Target` own the models. Both may run in
this process or behind an RPC boundary (the server's router runs this same engine).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import torch

from specdec_core import structured
from specdec_core.adaptive import AcceptanceEstimate, AdaptivePolicy, CostModel, batch_bucket
from specdec_core.config import AUTO, parse_num_speculative_tokens
from specdec_core.decode_run import RUN_STEPS, DecodeRun, Step
from specdec_core.drafters.base import Drafter, Hybrid, Proposal
from specdec_core.drafters.hybrid import HybridDrafter
from specdec_core.drafters.session import DraftSession, allowed, drafts_failed, start_drafting
from specdec_core.errors import InvalidArgument
from specdec_core.faults import Faults
from specdec_core.grammar.compiler import CompiledGrammar
from specdec_core.grammar.constraint import Constraint
from specdec_core.grammar.state import GrammarState
from specdec_core.outputs import RequestOutput, RoundInfo
from specdec_core.overlap import Branch, Overlap, OverlapMode, branches_of, hit, predraft_request, split_pays
from specdec_core.request import PromptLimits, Request
from specdec_core.sequence import SequenceState, seeded_generator
from specdec_core.stopping import FinishReason, IncrementalDetokenizer, StopChecker
from specdec_core.target import PartialPrefill, PartialVerifyFailure, Prefilled, Target, VerifyItem, VerifyOutcome

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_speculative_tokens: int = 8  # the largest k a request may ask for or `auto` may choose
    num_speculative_tokens: int | str = AUTO  # default for requests that do not say
    # How `auto` chooses k. Its `max_k` is set to max_speculative_tokens here, whatever the policy passed says: the
    # largest k `auto` considers, and the longest a fixed k is priced at, is the largest a request may ask for.
    policy: AdaptivePolicy = AdaptivePolicy()
    # Rows that all decode plainly run on the target step after step (`decode_run`); off: one round at a time.
    plain_runs: bool = True
    # Pre-draft the next round while the target verifies this one (`overlap.py`): on, off, or auto (measured).
    overlap: OverlapMode | str = OverlapMode.OFF
    # Besides the outcome where every draft is accepted, a greedy row's pre-draft covers up to this many rejection
    # outcomes, those the draft finds likeliest (`drafters/alternatives.py`), as extra rows of its forwards.
    overlap_alternatives: int = 3
    # With pre-drafting on: split a batch into two groups taking turns, the draft drafting one group's next
    # proposals while the target verifies the other (`overlap.split_pays`). None: where the measured costs say it
    # pays; True / False: always (two rows or more) / never.
    split_batches: bool | None = None

    def __post_init__(self) -> None:
        if self.policy.max_k != self.max_speculative_tokens:
            object.__setattr__(self, "policy", replace(self.policy, max_k=self.max_speculative_tokens))


@dataclass(frozen=True)
class _Row:
    """One row of a round's verify: what it proposes, how it came by it, and the target's item."""

    seq: SequenceState
    proposal: Proposal
    k: int  # the draft model's k (0: it drafted nothing for the row)
    free: bool  # it verifies a proposal that cost no draft call
    method: str | None  # `RoundInfo.method`
    item: VerifyItem
    predrafted: bool = False  # its proposal is a branch pre-drafted during the last round
    split: bool = False  # its proposal was drafted while the other group of a split batch verified


@dataclass
class _Run:
    """A run of plain steps under way: its rows, and what each sampled row's generator held before the run drew
    its uniforms (rewound to the steps taken when the run ends)."""

    run: DecodeRun
    steps: Iterator[Step]
    seqs: list[SequenceState]
    states: list[torch.Tensor | None]
    taken: list[int]
    last_step: float  # time.perf_counter() of the step before
    stopping: bool = False


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
        # `drafter` is the one `auto` chooses k for; the hybrid's free drafter's proposals cost no draft call.
        self.drafter: Drafter | None = drafter.model if isinstance(drafter, Hybrid) else drafter
        self.hybrid = HybridDrafter(drafter.free if isinstance(drafter, Hybrid) else None)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.config = config
        self.costs = CostModel()
        # Acceptance over all recent rounds: where a new request's own estimate starts.
        self.acceptance = AcceptanceEstimate(decay=0.99)
        self._waiting: list[SequenceState] = []
        self._running: dict[str, SequenceState] = {}
        self._grammars = structured.LazyCompiler(tokenizer, target.vocab_size, eos_token_ids)
        self._draft_faults = Faults("drafter")  # a drafter that raises: its rows decode plainly, retried after a rest
        self._run: _Run | None = None
        self.overlap = Overlap(config.overlap)
        self._last_group: set[str] = set()  # the rows of the last round, when it ran one group of a split batch
        self._last_k = 0  # the largest k of the last round that drafted

    @property
    def acceptance_by_label(self) -> dict[str, AcceptanceEstimate]:
        """Acceptance per proposal label (`HybridDrafter`); settable, so calibration can put it back."""
        return self.hybrid.acceptance_by_label

    @acceptance_by_label.setter
    def acceptance_by_label(self, records: dict[str, AcceptanceEstimate]) -> None:
        self.hybrid.acceptance_by_label = records

    # -- requests ------------------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Validate and queue a request (`request.Request` says what each field asks); it is prefilled at the next
        `step`. Raises `InvalidArgument` naming the field before any work on bad input: a prompt that does not fit
        the target (`PromptLimits.check`), a `speculation_method` not among `methods`, a k out of range, or a
        `params.constraint` that does not compile (compiled here)."""
        seq_id, params = request.seq_id, request.params
        if seq_id in self._running or any(s.seq_id == seq_id for s in self._waiting):
            raise InvalidArgument("seq_id", f"request {seq_id!r} is already running")
        limits = PromptLimits(vocab_size=self.target.vocab_size, max_seq_len=self.target.max_seq_len)
        prompt = limits.check(request.prompt_ids, params.max_tokens)
        model_allowed, free_allowed = allowed(request.speculation_method, self.drafter, self.hybrid.free)
        k = self._k_setting(request.num_speculative_tokens) if model_allowed or free_allowed else 0
        grammar = None if params.constraint is None else GrammarState(self.compile(params.constraint))
        session = DraftSession(seq_id, request.cache_salt, model_allowed, free_allowed)
        stopper = StopChecker(
            params,
            self.eos_token_ids,
            IncrementalDetokenizer(self.tokenizer),
            max_total_tokens=self.target.max_seq_len,
            num_prompt_tokens=len(prompt),
        )
        seq = SequenceState(request, list(prompt), k, seeded_generator(params.seed), stopper, session, grammar)
        seq.estimate = AcceptanceEstimate.starting_from(self.acceptance, self.config.max_speculative_tokens)
        self._waiting.append(seq)

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """`constraint` compiled, or `InvalidArgument` naming its kind (`LazyCompiler`). Thread-safe, unlike the rest
        of the engine: a server compiles a request's constraint first, so that `add_request` finds it compiled."""
        return self._grammars.compile(constraint)

    @property
    def methods(self) -> tuple[str, ...]:
        """The drafting methods this engine runs: what a request's `speculation_method` may name besides "auto" and
        "none"."""
        return tuple(d.name for d in (self.hybrid.free, self.drafter) if d is not None)

    def abort(self, seq_id: str) -> RequestOutput | None:
        """Cancel a request: its caches are freed at once. Returns its final output, or None if unknown."""
        for i, seq in enumerate(self._waiting):
            if seq.seq_id == seq_id:
                del self._waiting[i]
                return seq.final(FinishReason.CANCELLED)
        running = self._running.get(seq_id)
        if running is None:
            return None
        self._free(running)
        return running.final(FinishReason.CANCELLED)

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
        return bool(self._waiting or self._running or self._run)

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
        """Admit waiting requests (prefill) and run one round for the running ones; or, while the target runs their
        plain rounds by itself, commit its next step."""
        if self._run is not None:
            return self._run_step(self._run)
        seqs = list(self._running.values())
        if seqs and self._runs_plainly(seqs):
            return self._start_run(seqs)
        group, others = self._groups(seqs)
        outputs = self._round(group, others) if group else []
        outputs += self._admit()
        return outputs

    # -- a batch split in two groups taking turns (`overlap.split_pays`) -------------------------------------------

    def _groups(self, seqs: list[SequenceState]) -> tuple[list[SequenceState], list[SequenceState]]:
        """This round's rows, and the rows whose next proposals the draft drafts while the target verifies them:
        all and none, or, where a split pays, half (those that sat out the last round first) and the rest."""
        if not self._splits(seqs):
            if self._last_group:
                log.info("batches of %d rows run whole again", len(seqs))
            self._last_group = set()
            return seqs, []
        if not self._last_group:
            log.info("batches of %d rows split in two groups taking turns (overlap.split_pays)", len(seqs))
        waited = [seq for seq in seqs if seq.seq_id not in self._last_group]
        ran = [seq for seq in seqs if seq.seq_id in self._last_group]
        half = (len(seqs) + 1) // 2
        order = waited + ran
        self._last_group = {seq.seq_id for seq in order[:half]}
        self.overlap.split_rounds += 1
        return order[:half], order[half:]

    def _splits(self, seqs: list[SequenceState]) -> bool:
        """Whether these rows run as two groups: pre-drafting is on, no row has a grammar, and the config or the
        measured costs at the last round's k say so."""
        split = self.config.split_batches
        if split is False or not self.overlap.enabled or self.drafter is None or len(seqs) < 2:
            return False
        if any(seq.grammar is not None for seq in seqs):  # a constrained row does not pre-draft
            return False
        return split is True or split_pays(self.costs, len(seqs), self._last_k, self.overlap.hit_rate)

    def _draft_others(self, others: list[SequenceState], k: int) -> tuple[list[SequenceState], Future] | None:
        """Start drafting, on the pre-drafting thread, the next proposals of the rows sitting out this round: their
        committed tokens are final until their own round, so what is drafted now is what they would draft then."""
        drafter = self.drafter
        if drafter is None or k < 1 or self._draft_faults.resting():
            return None
        chosen = [seq for seq in others if seq.draft.drafting and seq.grammar is None and self._room(seq) > 1]
        requests = [seq.draft_request(min(k, self._room(seq) - 1)) for seq in chosen]
        if not chosen:
            return None
        return chosen, self.overlap.submit(lambda: drafter.propose(requests))

    def _take_others(self, drafting: tuple[list[SequenceState], Future] | None) -> None:
        """Hand each row sitting out its drafted proposal, for its next round (waits for the draft)."""
        if drafting is None:
            return
        chosen, call = drafting
        try:
            drafted = call.result()
        except Exception as exc:
            drafts_failed([seq.draft for seq in chosen], self.drafter, self._draft_faults, exc)
            return
        self._draft_faults.succeeded()
        for seq, proposal in zip(chosen, drafted):
            seq.draft.drafted(len(seq.tokens))
            if proposal.token_ids:
                seq.predrafted = (len(seq.tokens), proposal)
                seq.split_drafted = True

    # -- runs of plain steps -------------------------------------------------------------------------------------

    def _runs_plainly(self, seqs: list[SequenceState]) -> bool:
        """Whether the target may run these rows' rounds by itself: every row decodes plainly (no grammar either,
        whose masks follow each token) and no waiting request could start now."""
        if not self.config.plain_runs or self._admissible():
            return False
        return all(seq.k_setting == 0 and seq.grammar is None for seq in seqs)

    def _admissible(self) -> bool:
        return bool(self._waiting) and self.target.free_slots > 0

    def _start_run(self, seqs: list[SequenceState]) -> list[RequestOutput]:
        drawn = [seq.decode_item(min(RUN_STEPS, self._room(seq)), self.eos_token_ids) for seq in seqs]
        try:
            run = self.target.decode([item for item, _ in drawn])
        except Exception as exc:
            return self._fail(seqs, exc)
        states = [state for _, state in drawn]
        self._run = _Run(run, iter(run), seqs, states, [0] * len(seqs), time.perf_counter())
        return self._run_step(self._run)

    def _run_step(self, run: _Run) -> list[RequestOutput]:
        """Commit the run's next step; once it has no more, rewind what its rows drew beyond the steps they took."""
        if not run.stopping and self._cut_in(run):
            run.stopping = True
            run.run.stop()
        try:
            step = next(run.steps, None)
        except Exception as exc:  # the target's call failed: its rows' caches are in no known state
            self._run = None
            return self._fail([seq for seq in run.seqs if seq.seq_id in self._running], exc)
        if step is None:
            self._end_run(run)
            return []
        now = time.perf_counter()
        seconds, run.last_step = now - run.last_step, now
        outputs, first = [], not any(run.taken)
        for i, (seq, token) in enumerate(zip(run.seqs, step)):
            if token is None or seq.seq_id not in self._running:  # ended there, or here (stop string, cancel)
                continue
            if isinstance(token, Exception):
                outputs.append(self._row_failed(seq, token))
                continue
            run.taken[i] += 1
            outputs.append(self._commit_plain(seq, token, seconds))
        if not first:  # the first step's time holds the run's start
            self.costs.observe_verify(sum(isinstance(token, int) for token in step), 1, seconds)
        if not any(seq.seq_id in self._running for seq in run.seqs):
            self._end_run(run)  # its rows all ended: the target, which holds none of them now, ends it too
        return outputs

    def _cut_in(self, run: _Run) -> bool:
        """A request could start, or a row of the run speculates again (`set_speculation`)."""
        return self._admissible() or any(seq.k_setting != 0 for seq in run.seqs if seq.seq_id in self._running)

    def _end_run(self, run: _Run) -> None:
        self._run = None
        for seq, state, taken in zip(run.seqs, run.states, run.taken):
            if state is not None and seq.seq_id in self._running:
                seq.rewind_run(state, taken)

    def _commit_plain(self, seq: SequenceState, token: int, seconds: float) -> RequestOutput:
        """A run's token for `seq`, committed as a k = 0 round would commit it."""
        probs = () if seq.request.return_probs else None
        info = RoundInfo(0, (), 0, True, draft_probs=probs, target_probs=probs, seconds=seconds)
        self._learn(seq, Proposal([], None, probs), 0, False, 0)
        return self._commit(seq, [token], info)

    def _admit(self) -> list[RequestOutput]:
        room = self.target.free_slots
        admitted, self._waiting = self._waiting[:room], self._waiting[room:]
        if not admitted:
            return []
        items, failed = [], []
        for seq in admitted:
            try:
                items.append(seq.prefill_item())
            except Exception as exc:  # its grammar failed: it ends before any work, the others are prefilled
                failed.append(seq.final(FinishReason.ERROR, exc))
                log.warning("request %s failed: %s", seq.seq_id, exc, exc_info=True)
        prefilled = {item.seq_id for item in items}
        admitted = [seq for seq in admitted if seq.seq_id in prefilled]  # in the order of `items`
        if not admitted:
            return failed
        first: list[Prefilled | None]
        try:
            first = list(self.target.prefill(items))
        except PartialPrefill as exc:  # some failed alone; no room for others after all: they wait again, first
            first = exc.results
            for i, error in exc.errors.items():
                failed.append(admitted[i].final(FinishReason.ERROR, error))
            again = [seq for i, (seq, done) in enumerate(zip(admitted, first)) if done is None and i not in exc.errors]
            self._waiting = again + self._waiting
        except Exception as exc:  # the target released whatever it had allocated for these
            log.warning("prefill of %d requests failed: %s", len(admitted), exc, exc_info=True)
            return failed + [seq.final(FinishReason.ERROR, exc) for seq in admitted]
        outputs = failed
        for seq, done in zip(admitted, first):
            if done is None:
                continue
            # The drafter starts the sequence the first time it drafts: under load `auto` may keep it at k = 0
            # for its whole life, and then the drafter never reads its context. Running: the target holds it.
            seq.num_cached = done.num_cached_tokens
            self._running[seq.seq_id] = seq
            outputs.append(self._commit(seq, [done.first_token_id], None))
        return outputs

    def _round(self, seqs: list[SequenceState], others: list[SequenceState] | None = None) -> list[RequestOutput]:
        """One round for `seqs`. A failure is attributed where it belongs: a row's own (its grammar, its commit)
        ends that row alone (`_row_failed`), leaving every other row's stream and caches as if it had not happened;
        should the target's call fail, every row of that call ends, as a failed call leaves caches in no known
        state. A drafter that fails costs only drafts (`drafts_failed`). A constrained row whose grammar forces the
        rest of its output commits it without taking part (`forced_round`)."""
        outputs, rest = [], []
        for seq in seqs:
            try:
                chain = seq.forced(self.target.max_seq_len)
                ends = structured.completes(chain, self._room(seq), self.eos_token_ids)
            except Exception as exc:
                outputs.append(self._row_failed(seq, exc))
                continue
            if ends:
                outputs.append(self._commit_forced(seq, chain))
            else:
                rest.append((seq, chain[: self._spec_cap(seq)]))
        if rest:
            outputs += self._speculate([seq for seq, _ in rest], [chain for _, chain in rest], others or [])
        return outputs

    def _commit_forced(self, seq: SequenceState, chain: list[int]) -> RequestOutput:
        """Commit forced tokens that end the output, with no forward pass (`forced_round`): their eos (or the room
        filled) ends the output, so no later round needs the target's cache to hold them. `ignore_eos` is refused
        with a constraint."""
        seq.stats = seq.stats.after(len(chain), len(chain))
        return self._commit(seq, chain, structured.forced_round(chain, seq.request.return_probs))

    def _fail(self, seqs: list[SequenceState], exc: Exception) -> list[RequestOutput]:
        log.warning("a round of %d sequences failed: %s", len(seqs), exc, exc_info=True)
        for seq in seqs:
            self._free(seq)
        return [seq.final(FinishReason.ERROR, exc) for seq in seqs]

    def _row_failed(self, seq: SequenceState, exc: Exception) -> RequestOutput:
        """`seq` alone ends with `exc`; what the target and the drafters hold for it is freed."""
        log.warning("request %s failed: %s", seq.seq_id, exc, exc_info=True)
        self._free(seq)
        return seq.final(FinishReason.ERROR, exc)

    def _speculate(
        self, seqs: list[SequenceState], forced: list[list[int]], others: list[SequenceState]
    ) -> list[RequestOutput]:
        """Draft, verify and accept for `seqs`; a row with `forced` tokens verifies them instead of drafting. While
        the target verifies, the draft drafts the next proposals of `others` (the rest of a split batch), or
        pre-drafts these rows' next round (`overlap.py`)."""
        started = time.perf_counter()
        try:
            offers = self._free_proposals(seqs, forced)
            ks, takes_free = self._choose_ks(seqs, offers)
            for i, chain in enumerate(forced):  # forced tokens: all a round can commit, for no draft call
                if chain:
                    ks[i], takes_free[i] = 0, True
            if self.drafter is not None and any(ks):
                ks = [0] * len(ks) if self._draft_faults.resting() else self._start_drafting(seqs, ks)
            drafted, predrafted = self._propose(seqs, ks, split=bool(others))
        except Exception as exc:  # the round's own logic failed before the target was called
            return self._fail(seqs, exc)
        outputs, rows = [], []
        for seq, proposal, offer, k, free, chain, pre in zip(seqs, drafted, offers, ks, takes_free, forced, predrafted):
            try:
                rows.append(self._row(seq, proposal, offer, len(seqs), k, free, chain, pre))
            except Exception as exc:  # its grammar failed: the row ends before its verify, the others go on
                outputs.append(self._row_failed(seq, exc))
        if not rows:
            return outputs
        if any(ks):
            self._last_k = max(ks)
        drafting_others = self._draft_others(others, max(ks)) if others else None
        predrafting = None
        if not others and self.overlap.enabled and self.overlap.choose():
            predrafting = self._predraft(rows)
        t0 = time.perf_counter()
        try:
            outcomes, failed = self._verify([row.item for row in rows])
        except Exception as exc:
            self._branches(rows, predrafting)  # the pre-draft ends before its rows do
            self._take_others(drafting_others)
            return outputs + self._fail([row.seq for row in rows], exc)
        width = 1 + max(len(row.proposal.token_ids) for row in rows)
        if not failed:
            self.costs.observe_verify(len(rows), width, time.perf_counter() - t0)
        branches = self._branches(rows, predrafting)
        self._take_others(drafting_others)
        # A split round is the cost model's choice (`_groups`): `auto`'s trials of pre-drafting leave it out.
        if not others and not failed and self.overlap.enabled:
            shape = (batch_bucket(len(rows)), width)
            self.overlap.observe_verify(predrafting is not None, shape, time.perf_counter() - t0)
        seconds = time.perf_counter() - started
        committed = 0
        for i, (row, outcome) in enumerate(zip(rows, outcomes)):
            if i in failed:  # its target replica is gone: this request ends, the others go on
                outputs.append(self._row_failed(row.seq, failed[i]))
                continue
            try:
                outputs.append(self._accept(row, outcome, seconds, branches[i]))
                committed += len(outcome.token_ids)
            except Exception as exc:
                outputs.append(self._row_failed(row.seq, exc))
        if not others:
            self.overlap.observe(predrafting is not None, seconds, committed)
        return outputs

    def _row(
        self,
        seq: SequenceState,
        drafted: Proposal,
        offer: Proposal | None,
        batch_size: int,
        k: int,
        free: bool,
        forced: list[int],
        predrafted: bool = False,
    ) -> _Row:
        """A row's share of the verify: the free `offer` it takes, else its `drafted` proposal cut to its grammar
        and to what it is worth; and the target's item."""
        if free and offer is not None:
            proposal = offer
        else:
            proposal = self.hybrid.trim(structured.cut_to_grammar(seq.grammar, drafted), batch_size, self.costs)
        method = structured.FORCED if forced else self._method(proposal, k, free)
        split, seq.split_drafted = predrafted and seq.split_drafted and not free, False
        item = seq.verify_item(proposal)
        return _Row(seq, proposal, k, free, method, item, predrafted and not free and not split, split)

    def _accept(
        self, row: _Row, outcome: VerifyOutcome, seconds: float, branches: tuple[Branch, ...] = ()
    ) -> RequestOutput:
        """Commit a verified row's outcome; what the round teaches the estimates first. A pre-drafted branch that
        the outcome confirms is the row's next proposal."""
        seq, proposal, k, free = row.seq, row.proposal, row.k, row.free
        draft, n = proposal.token_ids, outcome.num_accepted
        info = RoundInfo(
            k=len(draft) if free else k,
            proposed_token_ids=tuple(draft),
            num_accepted=n,
            bonus=n == len(draft),
            draft_probs=proposal.draft_probs,
            target_probs=outcome.target_probs,
            method=row.method,
            seconds=seconds,
            predrafted=row.predrafted,
            split=row.split,
            branched=bool(branches),
        )
        self._learn(seq, proposal, k, free, n)
        output = self._commit(seq, list(outcome.token_ids), info)
        if k > 0 or branches:
            seq.draft.drafted(len(seq.tokens))
        if (confirmed := hit(branches, seq.tokens)) is not None:
            seq.predrafted = (len(seq.tokens), confirmed.proposal)
            self.overlap.hits += 1
            self.overlap.rejection_hits += n < len(draft)  # it confirmed a branch for a rejection
        return output

    def _learn(self, seq: SequenceState, proposal: Proposal, k: int, free: bool, num_accepted: int) -> None:
        """What a verified row teaches: the draft model's estimates (the request's, the engine's) unless it verified
        a free proposal, whose record is its label's; its label's record; the request's totals."""
        n, proposed = num_accepted, len(proposal.token_ids)
        if not free:
            seq.estimate.update(proposed, n, k)
            self.acceptance.update(proposed, n, k)
        if proposal.label is not None:
            self.hybrid.label_estimate(proposal.label).update(proposed, n)
        seq.stats = seq.stats.after(proposed, n)

    def _method(self, proposal: Proposal, k: int, free: bool) -> str | None:
        """Who proposed what a row verified (`RoundInfo.method`); None: no draft was asked for."""
        if free:
            return self.hybrid.free.name if self.hybrid.free is not None else None
        return (proposal.method or self.drafter.name) if k > 0 and self.drafter is not None else None

    def _verify(self, items: list[VerifyItem]) -> tuple[list, dict[int, Exception]]:
        """Outcomes, and the rows that failed (when only some did)."""
        try:
            return self.target.verify(items), {}
        except PartialVerifyFailure as exc:
            log.warning("verify: %s", exc)
            return exc.outcomes, exc.errors

    # -- choosing k ----------------------------------------------------------------------------------------------

    def _choose_ks(self, seqs: list[SequenceState], offers: list[Proposal | None]) -> tuple[list[int], list[bool]]:
        """Each sequence's k this round (its fixed k, or the batch's adaptive k; capped by its room left), and
        whether it verifies its free proposal (`offers`) instead of drafting."""
        rows = [(seq.estimate, seq.fixed_k()) for seq in seqs]
        free = [None if offer is None else self.hybrid.free_value(offer) for offer in offers]
        rooms = [self._room(seq) for seq in seqs]
        k_auto, use_free = 0, True
        if any(k is None for _, k in rows):
            unread = sum(self._unread(seq) for seq, (_, fixed) in zip(seqs, rows) if fixed is None)
            choice = self.config.policy.choose_round(
                rows, self.costs, len(seqs), self.costs.catch_up_cost(unread), sum(rooms), free
            )
            k_auto, use_free = choice.k, choice.free
            if k_auto > 0 and unread > 0 and not self._start_pays_after_admission(rows, unread, sum(rooms)):
                k_auto = 0
        ks, takes_free = [], []
        for seq, (estimate, fixed), room, offer in zip(seqs, rows, rooms, free):
            k = max(0, min(k_auto if fixed is None else fixed, self.config.max_speculative_tokens, room - 1))
            k = k if seq.draft.may_draft else 0
            # A fixed k is the request's: it takes the better proposal whatever `auto` chose for the others.
            expected = estimate.expected_tokens(self.config.max_speculative_tokens)
            take = (use_free or fixed is not None) and self.config.policy.takes_free(expected, k, offer)
            ks.append(0 if take else k)
            takes_free.append(take)
        return ks, takes_free

    def _room(self, seq: SequenceState) -> int:
        return seq.room(self.target.max_seq_len)

    def _spec_cap(self, seq: SequenceState) -> int:
        return seq.spec_cap(self.config.max_speculative_tokens, self.target.max_seq_len)

    def _unread(self, seq: SequenceState) -> int:
        return seq.draft.unread(self.drafter, seq.tokens)

    def _start_pays_after_admission(
        self, rows: list[tuple[AcceptanceEstimate, int | None]], unread: int, horizon: int
    ) -> bool:
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

    # -- proposals -----------------------------------------------------------------------------------------------

    def _free_proposals(self, seqs: list[SequenceState], forced: list[list[int]]) -> list[Proposal | None]:
        """Each row's proposal that costs no draft call (None where it has none): its `forced` tokens, else the free
        drafter's, cut where it leaves the row's grammar and by its label's record. A lookup, no model call: made
        before k is chosen, so the choice can weigh it."""
        offers: list[Proposal | None] = [
            structured.forced_proposal(chain, seq.request.return_probs) if chain else None
            for seq, chain in zip(seqs, forced)
        ]
        if self.hybrid.free is None:
            return offers
        caps = [
            0 if chain or not seq.draft.may_use_free or seq.k_setting == 0 else self._spec_cap(seq)
            for seq, chain in zip(seqs, forced)
        ]
        rows = [i for i, cap in enumerate(caps) if cap > 0]
        found = self.hybrid.propose([(seqs[i].draft, seqs[i].free_request(caps[i])) for i in rows])
        for i, proposal in zip(rows, found):
            proposal = None if proposal is None else structured.cut_to_grammar(seqs[i].grammar, proposal)
            if proposal is not None and proposal.token_ids:
                offers[i] = self.hybrid.trim(proposal, len(seqs), self.costs)
        return offers

    def _start_drafting(self, seqs: list[SequenceState], ks: list[int]) -> list[int]:
        """Start, on the drafter, the sequences that draft this round for the first time; the time per token of
        context read teaches the cost model what starting (and catching up) costs. A sequence the drafter cannot
        take decodes plainly from then on (`start_drafting`): its k is 0."""
        assert self.drafter is not None
        new = [seq for seq, k in zip(seqs, ks) if k > 0 and not seq.draft.drafting]
        for start in start_drafting(self.drafter, [seq.draft for seq in new], [seq.tokens for seq in new]):
            # Starts that found their contexts cached say nothing about what reading a context costs (their time
            # is mostly the call's fixed part): only full reads teach the price.
            if not any(start.cached):
                self.costs.observe_catch_up(start.num_tokens, start.seconds)
        return [k if seq.draft.may_draft else 0 for seq, k in zip(seqs, ks)]

    def _propose(
        self, seqs: list[SequenceState], ks: list[int], split: bool = False
    ) -> tuple[list[Proposal], list[bool]]:
        """Each row's proposal, and whether it was pre-drafted; rows at k = 0 get an empty one without troubling the
        drafter, and rows holding a branch the last round confirmed verify it (cut to k) without drafting."""
        proposals = [Proposal([], None, () if seq.request.return_probs else None) for seq in seqs]
        predrafted = [False] * len(seqs)
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            branch, seq.predrafted = seq.predrafted_proposal(), None
            if branch is not None and k > 0:
                proposals[i], predrafted[i] = branch.prefix(k), True
            else:
                seq.split_drafted = False
        rows = [i for i, k in enumerate(ks) if k > 0 and not predrafted[i]]
        if self.overlap.enabled and not split:
            self.overlap.observe_saved(self._drafting_saved(ks, predrafted, rows))
        if self.drafter is None or not rows:
            return proposals, predrafted
        # A drafting row that sat at k = 0 has context to catch up on: that call's time is not a k-draft's.
        stale = sum(self._unread(seqs[i]) for i in rows)
        requests = [seqs[i].draft_request(ks[i]) for i in rows]
        t0 = time.perf_counter()
        try:
            drafted = self.drafter.propose(requests)
        except Exception as exc:  # as a remote drafter's failure: these rows' drafts, never their requests
            drafts_failed([seqs[i].draft for i in rows], self.drafter, self._draft_faults, exc)
            return proposals, predrafted
        self._draft_faults.succeeded()
        if stale <= len(seqs):
            self.costs.observe_draft(len(seqs), max(ks), time.perf_counter() - t0)
        for i, proposal in zip(rows, drafted):
            proposals[i] = proposal
        return proposals, predrafted

    # -- pre-drafting (`overlap.py`) -----------------------------------------------------------------------------

    def _drafting_saved(self, ks: list[int], predrafted: list[bool], rows: list[int]) -> float:
        """Seconds of drafting the branches used this round saved, by the measured costs: a call for every row that
        drafts or holds a branch, less the call for those that draft (none if every one holds a branch)."""
        covered = [i for i, k in enumerate(ks) if k > 0 and (predrafted[i] or i in rows)]
        if not any(predrafted) or not covered:
            return 0.0
        full = self.costs.draft_cost(len(covered), max(ks[i] for i in covered))
        left = self.costs.draft_cost(len(rows), max(ks[i] for i in rows)) if rows else 0.0
        return 0.0 if full is None or left is None else max(0.0, full - left)

    def _predraft(self, rows: list[_Row]) -> tuple[list[int], Future[list[Proposal]]] | None:
        """Start pre-drafting, on the pre-drafting thread, the rows that may: each row's branch where every draft of
        its proposal is accepted, as far ahead as the round's k or the proposal, whichever is longer (a proposal the
        confidence threshold cut short says little of the next one's length), and no further than the draft steps
        that fit in the verify's measured time (the round waits for the pre-draft). The rows, and the call."""
        drafter = self.drafter
        if drafter is None or self._draft_faults.resting():
            return None
        width = 1 + max(len(row.proposal.token_ids) for row in rows)
        alternatives = self.config.overlap_alternatives
        fits = self._steps_within_verify(len(rows), width, alternatives)
        chosen, requests = [], []
        for i, row in enumerate(rows):
            seq, n = row.seq, len(row.proposal.token_ids)
            ahead = min(max(n, row.k), fits - 1, self.config.max_speculative_tokens, self._room(seq) - n - 2)
            if row.method == structured.FORCED or seq.grammar is not None or not seq.draft.drafting or ahead < 1:
                continue
            chosen.append(i)
            request = predraft_request(seq.draft_request(1 + ahead), row.proposal, 1 + ahead)
            if seq.params.shaping.greedy:  # a sampled row's replacement is a draw from the residual: no guess
                request = replace(request, num_alternatives=alternatives)
            requests.append(request)
        if not chosen:
            return None
        return chosen, self.overlap.submit(lambda: drafter.propose(requests))

    def _steps_within_verify(self, batch_size: int, width: int, alternatives: int = 0) -> int:
        """Draft steps (after the call's fixed part) that fit in a verify of `width` tokens, by the measured costs;
        at least 2 (the guess and one draft), unbounded while either cost is unmeasured. A pre-draft covering
        `alternatives` rejection outcomes a row drafts as many more rows: priced at that batch size where drafts
        of it were measured (calibration measures them on the served stack), else at `batch_size`."""
        verify = self.costs.verify_cost(batch_size, width)
        rows = batch_size * (1 + alternatives)
        if self.costs.draft_cost(rows, 1) is None:
            rows = batch_size
        one, many = self.costs.draft_cost(rows, 1), self.costs.draft_cost(rows, 8)
        if verify is None or one is None or many is None:
            return self.config.max_speculative_tokens + 1
        step = (many - one) / 7 if many > one else one
        return max(2, int((verify - (one - step)) // step))

    def _branches(
        self, rows: list[_Row], predrafting: tuple[list[int], Future[list[Proposal]]] | None
    ) -> list[tuple[Branch, ...]]:
        """Per row, the branches pre-drafted for it (none where none were). Waits for the pre-draft; one that failed
        costs its rows their draft state (started again when they next draft), never their requests."""
        branches: list[tuple[Branch, ...]] = [() for _ in rows]
        if predrafting is None:
            return branches
        chosen, call = predrafting
        try:
            drafted = call.result()
        except Exception as exc:
            drafts_failed([rows[i].seq.draft for i in chosen], self.drafter, self._draft_faults, exc)
            return branches
        self._draft_faults.succeeded()
        for i, proposal in zip(chosen, drafted):
            seq, n = rows[i].seq, len(rows[i].proposal.token_ids)
            branches[i] = branches_of(proposal, len(seq.tokens), n)
        self.overlap.branches += sum(len(b) for b in branches)
        self.overlap.branched_rows += sum(bool(b) for b in branches)
        return branches

    # -- commit and release --------------------------------------------------------------------------------------

    def _commit(self, seq: SequenceState, tokens: list[int], info: RoundInfo | None) -> RequestOutput:
        """Commit `tokens` to `seq` and say what they were. A failure here is the row's alone: it ends, and no
        other row's commit or stream is touched (`_row_failed`)."""
        try:
            committed = seq.stopper.commit(tokens)
            seq.tokens.extend(committed)
            if seq.grammar is not None and seq.grammar.advance(committed) != len(committed):
                # Every token was sampled under the grammar's masks: one it refuses is the engine's fault (or a
                # target that ignored the masks), and the grammar's state no longer says where the output is.
                kind = seq.params.constraint.kind if seq.params.constraint is not None else None
                raise RuntimeError(f"{seq.seq_id}: committed tokens {committed} leave the {kind} constraint")
            if seq.stopper.finish_reason is None:
                seq.draft.observe(self.drafter, self.hybrid.free, len(seq.tokens), self._draft_faults)
            else:
                self._free(seq)
            return seq.output(committed, info)
        except Exception as exc:
            return self._row_failed(seq, exc)

    def _free(self, seq: SequenceState) -> None:
        """Release what the target and the drafters hold for `seq` (a running sequence: the target holds it)."""
        if self._running.pop(seq.seq_id, None) is not None:
            self.target.release(seq.seq_id)
        seq.draft.release(self.drafter, self.hybrid.free, self._draft_faults)
