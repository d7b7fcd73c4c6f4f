"""Hybrid drafting: SuffixDecoding's cached proposals and a draft model, chosen per request and per round.

A suffix proposal costs a lookup in the router; a draft model's costs a draft call of k steps. Where a request
repeats what it or earlier requests said (an edit of the last answer, a tool call echoing a schema), the suffix
structure proposes long spans the draft model would have to produce step by step; elsewhere it proposes nothing,
or a short, weak guess, and the draft model does better. The engine weighs both each round by the cost model
`auto` uses (`adaptive.AdaptivePolicy.choose_round` with the free proposals): the suffix proposal's expected
tokens by its label's acceptance record (`HybridDrafter.free_value`), the draft model's by the request's own,
each over what its round costs (no draft call for the suffix proposal), and plain decoding where neither pays.
Both proposals are verified exactly: the suffix one as point masses, the model's with its q.

The draft workers run the draft model (`build`); the suffix structure runs wherever the engine does.
"""

from __future__ import annotations

import logging

from specdec_core.adaptive import AcceptanceEstimate, CostModel, FreeProposal
from specdec_core.drafters import draft_model, suffix
from specdec_core.drafters.base import Drafter, DraftMethod, DraftRequest, Proposal
from specdec_core.drafters.session import DraftSession

log = logging.getLogger(__name__)

METHOD = DraftMethod("hybrid", runs_draft_model=True, build=draft_model.METHOD.build, free_part=suffix.METHOD.name)

UNTRIED_LABEL_TRIALS = 2.0  # a free proposal's label with fewer (decayed) trials at its first position is explored


class HybridDrafter:
    """The engine's side of hybrid drafting: the free drafter (None for an engine without one), proposing for the
    sequences that may use it, and the acceptance records per proposal label (`Proposal.label`) by which labelled
    proposals are valued and trimmed. The records serve any labelled proposal, the draft model's too (an n-gram
    drafter's): an engine without a free drafter keeps them here all the same. Mutable: the records learn."""

    def __init__(self, free: Drafter | None) -> None:
        self.free = free
        # Acceptance per proposal label: how much of a labelled proposal is worth verifying.
        self.acceptance_by_label: dict[str, AcceptanceEstimate] = {}

    def propose(self, rows: list[tuple[DraftSession, DraftRequest]]) -> list[Proposal | None]:
        """Per row, the free drafter's proposal (None where it holds no proposal for the row). Each row's sequence
        is started on it first (`DraftSession.start_free`); a failed lookup costs these rows their free proposals
        for the rest of their requests (`DraftSession.stop_free`), never the requests. A lookup, no model call."""
        out: list[Proposal | None] = [None] * len(rows)
        if self.free is None:
            return out
        free = self.free
        live = [i for i, (session, request) in enumerate(rows) if session.start_free(free, request.token_ids)]
        if not live:
            return out
        try:
            proposals = free.propose([rows[i][1] for i in live])
        except Exception as exc:
            log.warning("the %s drafter failed, its rows go on without it: %s", free.name, exc, exc_info=True)
            for i in live:
                rows[i][0].stop_free(free)
            return out
        for i, proposal in zip(live, proposals):
            out[i] = proposal
        return out

    def free_value(self, proposal: Proposal) -> FreeProposal:
        """What verifying `proposal` is expected to commit, by its label's record. A label with (almost) no record
        is valued as if always right: trying it costs only a wider verify, and an untried label is never learnt."""
        n = len(proposal.token_ids)
        record = self.acceptance_by_label.get(proposal.label) if proposal.label is not None else None
        if record is None or not record.trials or record.trials[0] < UNTRIED_LABEL_TRIALS:
            return FreeProposal(float(n + 1), n)
        return FreeProposal(record.expected_tokens(n)[n], n)

    def label_estimate(self, label: str) -> AcceptanceEstimate:
        """`label`'s record, made on first use. A weak prior (one trial): a position is only tried again when the
        record says it may pay, so each trial there must count."""
        return self.acceptance_by_label.setdefault(label, AcceptanceEstimate(weight=1.0, decay=0.99))

    def trim(self, proposal: Proposal, batch_size: int, costs: CostModel) -> Proposal:
        """A labelled proposal cut to the length t >= 1 that maximises E(t) / c_verify(B, t + 1) by its label's
        record (its rates per position). The cut depends on the context and on past rounds, never on this round's
        verification, so the output distribution is unchanged. At least one token stays: a label that is never
        tried again is never learnt."""
        est = self.acceptance_by_label.get(proposal.label) if proposal.label is not None else None
        n = len(proposal.token_ids)
        if est is None or n <= 1:
            return proposal
        price = [costs.verify_cost(batch_size, t + 1) for t in range(n + 1)]
        if any(p is None for p in price):  # widths not measured yet: nothing to weigh
            return proposal
        gains = est.expected_tokens(n)
        best = max(range(1, n + 1), key=lambda t: (gains[t] / price[t], -t))  # type: ignore[operator]
        return proposal.prefix(best)
