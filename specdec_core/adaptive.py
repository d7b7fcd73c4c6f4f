"""Choosing the speculation length k per round from acceptance and measured costs: `auto`.

docs/engine.md ("Choosing k") derives the model and says why each rule is there; in short, the policy picks

    k* = argmax_{0 <= k <= k_max}  sum_i E_i(k) / (c_draft(B, k) + c_verify(B, k + 1)),   E(0) = 1,

with E(k) = 1 + a_1 + a_1 a_2 + ... (Leviathan et al. 2023, section 3, with a rate a_j per draft position) and
costs measured per batch-size bucket. What must stay true:
- One k serves the batch (every row pays for the longest row), so k maximises the batch's tokens per second.
- Speculation must beat plain decoding by a margin that grows with the batch (`AdaptivePolicy.required_gain`).
- A k > 0 whose rows must first be read by the drafter pays that one-time read over the tokens the rows have left.
- Nothing here reads this round's verification: k and the free-proposal choice depend on past rounds only, so
  the output distribution does not depend on them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def expected_tokens_by_position(rates: Sequence[float], k: int) -> float:
    """E(k) when the j-th draft is accepted with probability rates[j - 1] given that all before it were:
    1 + a_1 + a_1 a_2 + ... + a_1 ... a_k. With every a_j = alpha this is (1 - alpha^(k+1)) / (1 - alpha)."""
    total, run = 1.0, 1.0
    for a in rates[:k]:
        run *= a
        total += run
    return total


def measured(cost: float | None) -> float:
    """A cost the caller knows is measured (its batch size explored): None there is a bug, not a missing figure."""
    if cost is None:
        raise RuntimeError("a cost was read before it was measured")
    return cost


@dataclass
class AcceptanceEstimate:
    """A request's acceptance per draft position (P(draft j accepted | drafts 1..j-1 accepted)): decayed counts
    of trials, shrunk to a prior. Per position, not one alpha: a copied span is right to its end far more often
    than at its first token (docs/engine.md). Mutable: `update` learns."""

    prior: tuple[float, ...] = (2.0 / 3.0,)  # per position; positions past its end follow the one before
    weight: float = 3.0  # the prior counts as this many trials at each position
    decay: float = 0.95  # per drafting round: recent rounds dominate, so drift is followed
    accepted: list[float] = field(default_factory=list)  # per position: decayed count of acceptances
    trials: list[float] = field(default_factory=list)  # per position: decayed count of trials
    rounds_at_zero: int = 0  # rounds in a row run with k = 0
    probes: int = 0  # probes from k = 0 since the request last speculated two rounds running
    _drafted_last: bool = False

    @property
    def alpha(self) -> float:
        """Acceptances over trials, all positions pooled (the usual acceptance rate)."""
        return (sum(self.accepted) + self.weight * self.prior[0]) / (sum(self.trials) + self.weight)

    @classmethod
    def starting_at(cls, alpha: float, weight: float = 3.0) -> AcceptanceEstimate:
        """An estimate that starts from `alpha` at every position, worth `weight` trials each."""
        return cls(prior=(alpha,), weight=weight)

    @classmethod
    def starting_from(cls, recent: AcceptanceEstimate, positions: int, weight: float = 3.0) -> AcceptanceEstimate:
        """A new request's estimate: the per-position rates of `recent` (e.g. recent requests') as its prior."""
        return cls(prior=tuple(recent.rates(max(1, positions))), weight=weight)

    def optimistic(self, positions: int) -> AcceptanceEstimate:
        """Rates halfway from this estimate's to 1 at each position: an acceptance a probe could plausibly find.
        (Drafts that are always right would justify a probe wherever speculation can pay at all.)"""
        return AcceptanceEstimate(prior=tuple((1.0 + r) / 2.0 for r in self.rates(max(1, positions))))

    def rates(self, n: int) -> list[float]:
        """Estimated acceptance rates of draft positions 1..n."""
        out: list[float] = []
        for j in range(n):
            prior = self.prior[j] if j < len(self.prior) else out[-1]
            accepted = self.accepted[j] if j < len(self.accepted) else 0.0
            trials = self.trials[j] if j < len(self.trials) else 0.0
            out.append((accepted + self.weight * prior) / (trials + self.weight))
        return out

    def expected_tokens(self, up_to: int) -> list[float]:
        """E(k) for k = 0..up_to under the per-position rates."""
        rates = self.rates(up_to)
        return [expected_tokens_by_position(rates, k) for k in range(up_to + 1)]

    def update(self, num_draft: int, num_accepted: int, k: int | None = None) -> None:
        """A round with speculation length `k` (default: num_draft) proposed num_draft tokens (fewer than k when
        the drafter had no more, e.g. an n-gram with a short match) and accepted the first num_accepted."""
        k = num_draft if k is None else k
        if k == 0:
            self.rounds_at_zero += 1
            self._drafted_last = False
            return
        if self.rounds_at_zero:
            self.probes += 1  # a round with drafts after rounds without: a probe
        elif self._drafted_last:
            self.probes = 0  # speculating steadily again
        self.rounds_at_zero, self._drafted_last = 0, True
        if num_draft == 0:
            return  # nothing proposed: nothing learnt about acceptance
        # Trials: every accepted draft, plus the one rejected (if any) that ended the run.
        tried = num_accepted + (1 if num_accepted < num_draft else 0)
        grow = tried - len(self.trials)
        if grow > 0:
            self.trials += [0.0] * grow
            self.accepted += [0.0] * grow
        for j in range(len(self.trials)):
            self.trials[j] = self.trials[j] * self.decay + (1.0 if j < tried else 0.0)
            self.accepted[j] = self.accepted[j] * self.decay + (1.0 if j < num_accepted else 0.0)


# Context reads shorter than this are not timed: a fixed per-call cost would pass for a per-token one.
CATCH_UP_TIMED_FROM = 16


def batch_bucket(batch_size: int) -> int:
    """The batch-size bucket costs are kept per: the next power of two."""
    return 1 << max(0, math.ceil(math.log2(max(1, batch_size))))


@dataclass
class CostModel:
    """Measured seconds of a draft call and of a verify forward, per batch-size bucket and tokens per row. An entry
    last measured over `stale_after` rounds ago is measured again (`stale_k`), its new value replacing the old: a
    cost is measured only where it is chosen, so one measured in a slow moment must not stand for good."""

    smoothing: float = 0.2
    stale_after: int = 256  # rounds of a bucket after which an entry not measured since is measured again
    draft: dict[int, dict[int, float]] = field(default_factory=dict)  # bucket -> {k: seconds of a k-draft call}
    verify: dict[int, dict[int, float]] = field(default_factory=dict)  # bucket -> {tokens per row: seconds}
    verify_samples: dict[int, dict[int, int]] = field(default_factory=dict)  # bucket -> {tokens per row: count}
    rounds: dict[int, int] = field(default_factory=dict)  # bucket -> verifies measured (its rounds)
    draft_seen: dict[int, dict[int, int]] = field(default_factory=dict)  # bucket -> {k: round last measured}
    verify_seen: dict[int, dict[int, int]] = field(default_factory=dict)  # bucket -> {tokens per row: round}
    # Seconds per token for the drafter to read a context it has not seen (a draft model's prefill of a sequence
    # that never drafted, or that sat at k = 0 for a while). None until measured.
    catch_up: float | None = None

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A drafter read `tokens` tokens of context in `seconds` (only reads long enough to time are worth it)."""
        if tokens >= CATCH_UP_TIMED_FROM:
            value = seconds / tokens
            self.catch_up = value if self.catch_up is None else self.catch_up + self.smoothing * (value - self.catch_up)

    def catch_up_cost(self, tokens: int) -> float:
        """Seconds to read `tokens` tokens of unseen context; 0 until a read was measured."""
        return tokens * (self.catch_up or 0.0)

    def observe_draft(self, batch_size: int, steps: int, seconds: float) -> None:
        if steps > 0:
            bucket = batch_bucket(batch_size)
            self._ewma(
                self.draft.setdefault(bucket, {}), self.draft_seen.setdefault(bucket, {}), bucket, steps, seconds
            )

    def observe_verify(self, batch_size: int, tokens_per_row: int, seconds: float) -> None:
        bucket = batch_bucket(batch_size)
        self.rounds[bucket] = self.rounds.get(bucket, 0) + 1
        self._ewma(
            self.verify.setdefault(bucket, {}), self.verify_seen.setdefault(bucket, {}), bucket, tokens_per_row, seconds
        )
        counts = self.verify_samples.setdefault(bucket, {})
        counts[tokens_per_row] = counts.get(tokens_per_row, 0) + 1

    def _ewma(self, table: dict[int, float], seen: dict[int, int], bucket: int, key: int, value: float) -> None:
        old, now = table.get(key), self.rounds.get(bucket, 0)
        stale = old is None or now - seen.get(key, now) > self.stale_after
        table[key] = value if stale or old is None else old + self.smoothing * (value - old)
        seen[key] = now

    def stale_k(self, batch_size: int, up_to: int) -> int | None:
        """The k in 1..up_to, among those measured, whose draft call (k steps) or verify (k + 1 tokens a row) was
        last measured the longest ago, if more than `stale_after` rounds ago; None where none is stale."""
        bucket = batch_bucket(batch_size)
        now = self.rounds.get(bucket, 0)
        drafts, verifies = self.draft_seen.get(bucket, {}), self.verify_seen.get(bucket, {})
        ages = {
            k: now - min(drafts.get(k, now), verifies.get(k + 1, now))
            for k in range(1, up_to + 1)
            if k in drafts or k + 1 in verifies
        }
        stale = [k for k, age in ages.items() if age > self.stale_after]
        return max(stale, key=lambda k: (ages[k], -k)) if stale else None

    def verify_cost(self, batch_size: int, tokens_per_row: int) -> float | None:
        """Measured, or extrapolated from the nearest measured row count along the slope of the measured ones; None
        until two row counts are measured. How the cost grows with the rows is the model's own, and nothing here
        assumes it: a few percent a token for a dense model's memory-bound verify, but up to a whole expert set
        more a token for a mixture of experts' (benchmarks/moe)."""
        table = self.verify.get(batch_bucket(batch_size))
        if not table:
            return None
        if tokens_per_row in table:
            return table[tokens_per_row]
        if len(table) < 2:
            return None
        nearest = min(table, key=lambda t: abs(t - tokens_per_row))
        per_token = self._slope(table)
        return max(table[nearest] + per_token * (tokens_per_row - nearest), 1e-6)

    @staticmethod
    def _slope(table: dict[int, float]) -> float:  # at least two points
        ts, cs = zip(*sorted(table.items()))
        return max(0.0, (cs[-1] - cs[0]) / (ts[-1] - ts[0]))

    def draft_cost(self, batch_size: int, k: int) -> float | None:
        """Seconds of a call drafting k tokens: measured, or extrapolated along the measured line (with one
        measurement, proportional to k)."""
        table = self.draft.get(batch_bucket(batch_size))
        if not table:
            return None
        if k in table:
            return table[k]
        if len(table) == 1:
            ((k0, c0),) = table.items()
            return c0 * k / k0
        nearest = min(table, key=lambda t: abs(t - k))
        return max(table[nearest] + self._slope(table) * (k - nearest), 1e-6)

    def carried_to(self, batch_size: int, up_to: int, samples: int) -> CostModel | None:
        """Costs for an unexplored batch size, carried from the nearest explored one and scaled to plain decoding's
        cost here (plain rounds measure c_verify(B, 1) at no extra cost). A verify's cost follows the tokens it
        processes in all, B * t (each weight is used once per token), so from a smaller batch b the cost of t
        tokens a row here is read at B * t / b tokens a row there, and scaled by c_verify(B, 1) / c_verify(b, B / b):
        the same token count on both sides. Draft costs are scaled by the ratio of plain decoding's costs. None
        when this batch size has no plain-decoding measurement or no batch size is explored."""
        bucket = batch_bucket(batch_size)
        here = self.verify.get(bucket, {}).get(1)
        explored = [
            b
            for b in self.verify
            if b != bucket and b in self.draft and self.unmeasured_k(b, up_to, samples) is None and 1 in self.verify[b]
        ]
        if here is None or not explored:
            return None
        source = min(explored, key=lambda b: (abs(math.log2(b / bucket)), -b))
        factor = bucket // source if source < bucket else 1  # tokens a row there per token a row here
        scale = here / measured(self.verify_cost(source, factor))
        carried = CostModel(smoothing=self.smoothing, stale_after=self.stale_after)
        carried.draft[bucket] = {k: c * here / self.verify[source][1] for k, c in self.draft[source].items()}
        carried.draft[bucket].update(self.draft.get(bucket, {}))  # what was measured here stands
        carried.verify[bucket] = {
            t: measured(self.verify_cost(source, t * factor)) * scale for t in range(1, up_to + 2)
        }
        carried.verify[bucket].update(self.verify[bucket])
        return carried

    def unmeasured_k(self, batch_size: int, up_to: int, samples: int = 1) -> int | None:
        """The smallest k in 1..up_to whose verify cost (k + 1 tokens per row) has fewer than `samples`
        measurements."""
        counts = self.verify_samples.get(batch_bucket(batch_size), {})
        return next((k for k in range(1, up_to + 1) if counts.get(k + 1, 0) < samples), None)


@dataclass(frozen=True)
class FreeProposal:
    """A row's proposal that costs no draft call (a model-free drafter's, already made)."""

    expected_tokens: float  # E: tokens a round verifying it commits, by its record (1 + expected accepted)
    length: int  # tokens proposed: the verify reads length + 1 for the row


@dataclass(frozen=True)
class RoundChoice:
    k: int  # the speculation length of the batch's adaptive rows' draft-model proposals
    free: bool  # rows take their free proposals where `takes_free` says (False: no free proposal this round)


@dataclass(frozen=True)
class AdaptivePolicy:
    max_k: int = 8  # the largest k chosen (an engine sets it to its max_speculative_tokens)
    explore_up_to: int = 4  # measure the verify cost of k = 1..this (<= max_k) per batch-size bucket before choosing
    explore_samples: int = 3  # ... this many times each: one timing on a shared machine can mislead
    probe_every: int = 8

    margin: float = 0.05  # speculate only where the model predicts at least this gain over plain decoding...
    # ... plus this much per sequence in the batch beyond the first (up to max_margin): what the model leaves out
    # grows with the batch (docs/engine.md, "Choosing k").
    margin_per_sequence: float = 0.02
    max_margin: float = 0.25

    @property
    def explore_k(self) -> int:
        """The largest k explored, and measured by calibration: explore_up_to, within max_k (a k never chosen
        would never be measured, and its bucket would stay unexplored)."""
        return min(self.explore_up_to, self.max_k)

    def required_gain(self, batch_size: int) -> float:
        return min(self.max_margin, self.margin + self.margin_per_sequence * max(0, batch_size - 1))

    def choose(
        self,
        estimate: AcceptanceEstimate,
        costs: CostModel,
        batch_size: int,
        catch_up_s: float = 0.0,
        horizon: float = math.inf,
    ) -> int:
        """k for a request alone in its batch (`choose_batch` with one adaptive row)."""
        return self.choose_batch([(estimate, None)], costs, batch_size, catch_up_s, horizon)

    def choose_batch(
        self,
        rows: Sequence[tuple[AcceptanceEstimate, int | None]],
        costs: CostModel,
        batch_size: int,
        catch_up_s: float = 0.0,
        horizon: float = math.inf,
    ) -> int:
        """One k for the batch's adaptive rows (`choose_round` without free proposals)."""
        return self.choose_round(rows, costs, batch_size, catch_up_s, horizon).k

    def choose_round(
        self,
        rows: Sequence[tuple[AcceptanceEstimate, int | None]],
        costs: CostModel,
        batch_size: int,
        catch_up_s: float = 0.0,
        horizon: float = math.inf,
        free: Sequence[FreeProposal | None] | None = None,
    ) -> RoundChoice:
        """One k for the batch's adaptive rows, and whether rows take their free proposals (`free`, per row; None:
        no row has one). `rows`: each sequence's estimate and its fixed k (None: adaptive). `catch_up_s`: seconds
        the drafter needs, once, to read what the adaptive rows have that it has not seen; `horizon`: output tokens
        the rows have left, over which that cost is spread."""
        catch_up = (catch_up_s, horizon)
        explore = costs.unmeasured_k(batch_size, self.explore_k, self.explore_samples)
        if explore is not None:
            # Exploring a batch size costs every row a draft prefill and wider verifies. Where costs carried over
            # from a measured batch size already say speculation cannot pay, skip it. Carrying needs plain
            # decoding's cost here: measure it first (one plain round) where another batch size is explored.
            explored_elsewhere = any(
                costs.unmeasured_k(b, self.explore_k, self.explore_samples) is None for b in costs.verify
            )
            if explored_elsewhere and 1 not in costs.verify.get(batch_bucket(batch_size), {}):
                return RoundChoice(0, False)
        judged = self._judging_costs(costs, batch_size)
        if judged is None:
            if explore is None and costs.verify_cost(batch_size, 1) is None:
                # Explored at one width only (max_k 1) and no plain round yet: one measures plain decoding's cost.
                return RoundChoice(0, False)
            return RoundChoice(explore if explore is not None else self.explore_k, False)
        if explore is not None and self._best(rows, judged, batch_size, catch_up).k > 0:
            return RoundChoice(explore, False)
        costs = judged
        best = self._best(rows, costs, batch_size, catch_up, free)
        if best.k > 0 and judged is not None and explore is None:
            # Speculation is on: a k whose cost has not been measured for a long while is measured again now, so
            # that a cost measured in a slow moment cannot keep its k from ever being chosen.
            stale = costs.stale_k(batch_size, self.max_k)
            if stale is not None and stale != best.k:
                return RoundChoice(stale, best.free)
        adaptive = [e for e, fixed in rows if fixed is None]
        if (
            best == RoundChoice(0, False)
            and adaptive
            and all(e.rounds_at_zero >= self.probe_every << min(e.probes, 4) for e in adaptive)
        ):
            # One k serves the batch, so one row's probe costs every row (a draft call, a wider verify, and the
            # drafter's catch-up); probe when all are due, and only where what a probe could plausibly find would
            # change the answer: speculation must pay with each row's acceptance halfway from its estimate to 1.
            # Probes back off (8, 16, 32... rounds) while they keep finding k = 0 best.
            hopeful = [(e.optimistic(self.max_k), fixed) for e, fixed in rows]
            if self._best(hopeful, costs, batch_size, catch_up).k > 0:
                return RoundChoice(1, False)
        return best

    def pays(
        self,
        rows: Sequence[tuple[AcceptanceEstimate, int | None]],
        costs: CostModel,
        batch_size: int,
        catch_up_s: float = 0.0,
        horizon: float = math.inf,
    ) -> bool:
        """Whether the model expects speculation to pay for `rows` at `batch_size` (by costs carried over where that
        batch size is unexplored); True where too little is measured to say."""
        judged = self._judging_costs(costs, batch_size)
        return judged is None or self._best(rows, judged, batch_size, (catch_up_s, horizon)).k > 0

    def _judging_costs(self, costs: CostModel, batch_size: int) -> CostModel | None:
        """The costs to judge `batch_size` by: those measured there once it is explored, else those carried from
        an explored batch size; None where neither is known yet."""
        if costs.unmeasured_k(batch_size, self.explore_k, self.explore_samples) is not None:
            return costs.carried_to(batch_size, self.explore_k, self.explore_samples)
        if costs.draft_cost(batch_size, 1) is None or costs.verify_cost(batch_size, 1) is None:
            return None
        return costs

    @staticmethod
    def takes_free(expected: Sequence[float], k: int, free: FreeProposal | None) -> bool:
        """Whether a row verifies its free proposal rather than the draft model's k drafts: where it expects at
        least as many tokens (`expected`: the row's E(0..) for the draft model), for no draft call."""
        return free is not None and (k == 0 or free.expected_tokens >= expected[min(k, len(expected) - 1)])

    def _best(
        self,
        rows: Sequence[tuple[AcceptanceEstimate, int | None]],
        costs: CostModel,
        batch_size: int,
        catch_up: tuple[float, float] = (0.0, math.inf),
        free: Sequence[FreeProposal | None] | None = None,
    ) -> RoundChoice:
        """argmax over k (and free proposals taken or not) of the batch's expected tokens per second; plain
        decoding unless the best beats it by the required gain. Where an adaptive row drafts, the one-time
        `catch_up` (seconds, tokens left) is spread over the tokens left."""
        gains = [(e.expected_tokens(self.max_k), fixed) for e, fixed in rows]  # E(0..max_k) per row
        offers = list(free) if free is not None and any(f is not None for f in free) else None
        seconds, horizon = catch_up

        def rate(k: int, with_free: bool) -> float:
            tokens, width, steps, adaptive_drafts = 0.0, 0, 0, False
            for i, (e, fixed) in enumerate(gains):
                row_k = k if fixed is None else min(fixed, len(e) - 1)
                offer = offers[i] if with_free and offers is not None else None
                if offer is not None and self.takes_free(e, row_k, offer):
                    tokens, width = tokens + offer.expected_tokens, max(width, offer.length)
                else:
                    tokens, width, steps = tokens + e[row_k], max(width, row_k), max(steps, row_k)
                    adaptive_drafts |= fixed is None and row_k > 0
            draft = measured(costs.draft_cost(batch_size, steps)) if steps else 0.0
            per_second = tokens / (draft + measured(costs.verify_cost(batch_size, width + 1)))
            if not adaptive_drafts or seconds <= 0.0:
                return per_second
            return 1.0 / (1.0 / per_second + seconds / max(horizon, 1.0))

        plain = rate(0, False)
        choices = [
            RoundChoice(k, with_free)
            for with_free in ((False, True) if offers else (False,))
            for k in range(self.max_k + 1)
        ]
        rates = [rate(c.k, c.free) for c in choices]
        best = max(range(len(choices)), key=lambda i: (rates[i], -choices[i].k, choices[i].free))
        if rates[best] < (1.0 + self.required_gain(batch_size)) * plain:
            return RoundChoice(0, False)  # a predicted gain within the cost model's error is not worth a loss
        return choices[best]
