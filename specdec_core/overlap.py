"""Drafting that overlaps verification: while the target verifies round r, the draft model pre-drafts round r + 1.

The branch pre-drafted is the round's most likely outcome, every draft accepted: the draft is handed the committed
tokens plus the proposal under verification, guesses the target's bonus token after them (its own next draft) and
drafts up to k more after that guess. When the verify answers with every draft accepted and a bonus equal to the
guess, the committed tokens are exactly the context the branch was drafted on, and its drafts after the guess are
round r + 1's proposal at once, with the q they were drawn from: the draft's turn leaves the round's critical path.
Any other outcome is a miss: the draft rolls back (by a length, at its next call) and drafts as it does without
overlap.

Exact: a branch's drafts were drawn from q on exactly the committed prefix, with uniforms of their own, before the
target drew anything for round r + 1; whether a branch is used depends only on round r's outcome. Greedy output is
plain decoding's, token for token. Seeded sampling stays exact in law, but a pre-draft draws uniforms a sequential
round would not: a seed's sample differs between overlap on and off.

Pre-drafting pays only where the draft computes while the target verifies on hardware of its own (a draft GPU, a
draft node, cores pinned apart): on shared cores the two contend, and the round is slower. `overlap: auto` weighs
what it measured of both modes (each tried again now and then): per pre-drafting round, the drafting its branches
saved the round after (the draft call a hit made unnecessary, at its measured cost) against what pre-drafting added
to the wait for the verify (the verify and the pre-draft together, less a sequential verify of the same shape), each
averaged over the last pre-drafting rounds, across trials; pre-drafting stays unless it costs more than it saves by
more than the averages' uncertainty (`Overlap._better`). Round against round, that compares like with like: timing
rounds per committed token would weigh in how many tokens each happened to commit, which varies far more between
rounds than either term. Until both terms are measured, rounds are timed per committed token. Rows with a grammar
never pre-draft (the grammar's state would have to follow the assumed drafts)."""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from specdec_core.adaptive import CostModel
from specdec_core.drafters.base import DraftRequest, Proposal
from specdec_core.sparse_q import SparseQ


class OverlapMode(str, enum.Enum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


@dataclass(frozen=True)
class Branch:
    """A pre-drafted branch of one sequence: valid if the round under verification commits exactly `context`
    (its committed tokens, the proposal, then the target's token equal to `guess`)."""

    num_context: int  # committed tokens the branch assumes: len(tokens) + k + 1
    guess: int  # the draft's guess of the target's token after the proposal
    proposal: Proposal  # the drafts after the guess, with their q: round r + 1's proposal on a hit


def predraft_request(request: DraftRequest, proposal: Proposal, num_tokens: int) -> DraftRequest:
    """The draft's share of a pre-draft: `request` (the sequence's committed tokens, its shaping, `num_tokens`
    uniforms drawn for it) with the proposal under verification assumed after them."""
    return DraftRequest(
        seq_id=request.seq_id,
        token_ids=[*request.token_ids, *proposal.token_ids],
        num_tokens=num_tokens,
        shaping=request.shaping,
        uniform=request.uniform,
        return_probs=request.return_probs,
        num_assumed=len(proposal.token_ids),
    )


def branches_of(drafted: Proposal, num_committed: int, num_assumed: int) -> tuple[Branch, ...]:
    """The branches a pre-draft returned, for a sequence with `num_committed` tokens and `num_assumed` drafts under
    verification: where every draft is accepted (`drafted`: the guess, then the drafts after it), then one per
    rejection outcome it covered (`drafted.alternatives`: the guessed token at the rejected position, then the
    drafts after it). A branch with nothing drafted past its guess is left out."""
    branches = []
    if len(drafted.token_ids) >= 2:
        after = drafted.token_ids[1:]
        q = None if drafted.q is None else SparseQ(drafted.q.token_ids[1:], drafted.q.probs[1:])
        probs = None if drafted.draft_probs is None else drafted.draft_probs[1:]
        proposal = Proposal(after, q, probs, drafted.label, drafted.method)
        branches.append(Branch(num_committed + num_assumed + 1, drafted.token_ids[0], proposal))
    for alternative in drafted.alternatives:
        if alternative.proposal.token_ids and alternative.position < num_assumed:
            proposal = replace(alternative.proposal, label=drafted.label, method=drafted.method)
            branches.append(Branch(num_committed + alternative.position + 1, alternative.token, proposal))
    return tuple(branches)


def hit(branches: Sequence[Branch], tokens: list[int]) -> Branch | None:
    """The branch whose context the sequence's committed `tokens` are, if any. A round that committed
    `num_context` tokens accepted every draft before the branch's position (the committed tokens are the
    proposal's up to there), and its last token is the target's own, which must be the guess."""
    for branch in branches:
        if len(tokens) == branch.num_context and tokens[-1] == branch.guess:
            return branch
    return None


# `auto` decides for blocks of rounds, so that a round that uses a branch is mostly timed with the mode that made it.
BLOCK_ROUNDS = 4
# After every this many rounds `auto` tries the mode not in use for a block, so that it follows a change in load or
# placement; each trial the other mode loses doubles the interval, up to MAX_EXPLORE_EVERY (on cores the draft and
# the target share, pre-drafting loses every trial, and costs ever less).
EXPLORE_EVERY = 64
MAX_EXPLORE_EVERY = 4096
WARMUP_ROUNDS = BLOCK_ROUNDS  # rounds of each mode timed before `auto` compares them
WINDOW_ROUNDS = 4 * BLOCK_ROUNDS  # each mode's time per token, and the terms weighed: over this many last rounds
MIN_WEIGHED = BLOCK_ROUNDS  # samples of each term before `auto` weighs them instead of timing per token
# The weighed terms: over this many last pre-drafting rounds, across trials. A trial's block alone is too few: a hit
# saves a whole draft call or nothing, so four rounds cannot tell a hit rate of a third from none.
WEIGHED_ROUNDS = 8 * BLOCK_ROUNDS
CONFIDENCE = 2.0  # standard errors by which pre-drafting must measure costlier before `auto` stops it
VERIFY_SMOOTHING = 0.3  # weight of a new sequential verify in its shape's average


class Overlap:
    """The engine's pre-drafting: whether a round pre-drafts (its mode, and in `auto` what each mode measured), the
    thread that pre-drafts while the engine's thread verifies, and the counts the metrics report. Mutable."""

    def __init__(self, mode: OverlapMode | str) -> None:
        self.mode = OverlapMode(mode)
        self._pool: ThreadPoolExecutor | None = None
        self._rounds = {True: 0, False: 0}
        # Per mode, (seconds, tokens) of its last rounds: a trial's block weighs as much as its rounds.
        self._recent: dict[bool, deque[tuple[float, int]]] = {m: deque(maxlen=WINDOW_ROUNDS) for m in (True, False)}
        self._block: tuple[bool, int] = (False, 0)  # auto: the mode of the block under way, rounds left in it
        self._until_explore = EXPLORE_EVERY  # auto: rounds before the next trial of the mode not in use
        self._explore_every = EXPLORE_EVERY
        self._exploring = False
        # Weighed terms (module docstring): a sequential verify's seconds per shape (rows' bucket, tokens a row);
        # per pre-drafting round, its wait beyond that; per round after one, the drafting its branches saved.
        self._verify: dict[tuple[int, int], float] = {}
        self._extra: deque[float] = deque(maxlen=WEIGHED_ROUNDS)
        self._saved: deque[float] = deque(maxlen=WEIGHED_ROUNDS)
        self._last = False  # whether the last round chosen pre-drafted
        self.branches = 0  # branches pre-drafted (each outcome covered counts)
        self.hits = 0  # branches used as the next round's proposal
        self.rejection_hits = 0  # of them, branches for a rejection outcome
        self.branched_rows = 0  # rows of rounds that pre-drafted branches for their next round
        self.split_rounds = 0  # rounds of one group while the draft drafted the other's (`split_pays`)

    @property
    def enabled(self) -> bool:
        return self.mode is not OverlapMode.OFF

    @property
    def hit_rate(self) -> float:
        """The share of pre-drafted rows whose branch the next round used (0 before any)."""
        return self.hits / self.branched_rows if self.branched_rows else 0.0

    def choose(self) -> bool:
        """Whether this round pre-drafts."""
        if self.mode is not OverlapMode.AUTO:
            self._last = self.mode is OverlapMode.ON
            return self._last
        mode, left = self._block
        if left == 0:
            mode, left = self._next_block(), BLOCK_ROUNDS
        self._block = (mode, left - 1)
        self._last = mode
        return mode

    def _next_block(self) -> bool:
        for mode in (False, True):
            if self._rounds[mode] < WARMUP_ROUNDS:
                return mode
        better = self._better()
        if self._exploring:  # the trial block just ended: did the other mode win?
            self._exploring = False
            lost = better != self._block[0]  # the block that ended was the trial's
            self._explore_every = min(2 * self._explore_every, MAX_EXPLORE_EVERY) if lost else EXPLORE_EVERY
            self._until_explore = self._explore_every
        self._until_explore -= BLOCK_ROUNDS
        if self._until_explore <= 0:  # a trial: the other mode is timed afresh, on this block alone
            self._exploring = True
            self._recent[not better].clear()
            return not better
        return better

    def _better(self) -> bool:
        """Whether pre-drafting is the mode to keep. By the weighed terms, it is unless it costs more than it saves
        by over `CONFIDENCE` standard errors: `auto` runs only where the draft has hardware of its own, where a
        pre-draft is expected to pay, and a hit rate of a third read from a few dozen rounds is uncertain by a
        tenth."""
        if len(self._extra) >= MIN_WEIGHED and len(self._saved) >= MIN_WEIGHED:
            (saved, saved_var), (extra, extra_var) = _mean_var(self._saved), _mean_var(self._extra)
            error = math.sqrt(saved_var / len(self._saved) + extra_var / len(self._extra))
            return saved - extra > -CONFIDENCE * error
        return self._seconds_per_token(True) < self._seconds_per_token(False)

    def _seconds_per_token(self, mode: bool) -> float:
        recent = self._recent[mode]  # not empty: timed through the warm-up
        return sum(s for s, _ in recent) / sum(n for _, n in recent)

    def observe(self, overlapped: bool, seconds: float, tokens: int) -> None:
        """A round (pre-drafting or not) took `seconds` and committed `tokens` over its rows."""
        if tokens <= 0:
            return
        self._rounds[overlapped] += 1
        self._recent[overlapped].append((seconds, tokens))

    def observe_verify(self, overlapped: bool, shape: tuple[int, int], seconds: float) -> None:
        """A round of `shape` (its rows' batch bucket, tokens a row) waited `seconds` from the verify's start until
        its verify (and its pre-draft, if it pre-drafted) had answered."""
        if not overlapped:
            old = self._verify.get(shape)
            self._verify[shape] = seconds if old is None else old + VERIFY_SMOOTHING * (seconds - old)
        elif (sequential := self._sequential_verify(shape)) is not None:
            self._extra.append(seconds - sequential)

    def _sequential_verify(self, shape: tuple[int, int]) -> float | None:
        """A sequential verify's seconds at `shape`: measured, or interpolated between the nearest widths measured
        on either side at its batch bucket; None beyond them."""
        if shape in self._verify:
            return self._verify[shape]
        bucket, width = shape
        widths = [w for b, w in self._verify if b == bucket]
        below = max((w for w in widths if w < width), default=None)
        above = min((w for w in widths if w > width), default=None)
        if below is None or above is None:
            return None
        low, high = self._verify[(bucket, below)], self._verify[(bucket, above)]
        return low + (high - low) * (width - below) / (above - below)

    def observe_saved(self, seconds: float) -> None:
        """This round's drafting took `seconds` less than it would have without the branches the last round
        pre-drafted (0: none was used). Ignored after a round that did not pre-draft."""
        if self._last:
            self._saved.append(seconds)

    def submit(self, call: Callable[[], list[Proposal]]) -> Future[list[Proposal]]:
        """Run `call` (the pre-draft) on the pre-drafting thread."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predraft")
        return self._pool.submit(call)


def split_pays(costs: CostModel, batch_size: int, k: int, hit_rate: float) -> bool:
    """Whether `batch_size` rows at k drafts a row run faster as two groups taking turns, the draft drafting one
    group's next proposals while the target verifies the other's, than as one batch pre-drafting branches that are
    used at `hit_rate`. By the measured costs (d: a draft call, v: a verify), per cycle in which every row runs
    one round, with g the first group's rows and B - g the other's:

        whole:  v(B, k + 1) + (1 - hit_rate) · d(B, k)
        split:  max(v(g, k + 1), d(B - g, k)) + max(v(B - g, k + 1), d(g, k))

    Where a verify costs about the same for fewer rows (a memory-bound target on a GPU) two verifies lose to one;
    where it grows with the rows (a CPU's compute-bound verify) and drafting is dear, the split can win. False
    while a cost it needs is unmeasured, and below two rows."""
    if batch_size < 2 or k < 1:
        return False
    g = (batch_size + 1) // 2
    v_all, d_all = costs.verify_cost(batch_size, k + 1), costs.draft_cost(batch_size, k)
    parts = [costs.verify_cost(n, k + 1) for n in (g, batch_size - g)] + [
        costs.draft_cost(n, k) for n in (batch_size - g, g)
    ]
    if v_all is None or d_all is None or any(c is None for c in parts):
        return False
    v_g, v_rest, d_rest, d_g = (float(c) for c in parts)  # type: ignore[arg-type]
    whole = v_all + (1.0 - hit_rate) * d_all
    return max(v_g, d_rest) + max(v_rest, d_g) < whole


def _mean_var(values: deque[float]) -> tuple[float, float]:
    """The sample mean and variance (n - 1) of at least two values."""
    mean = sum(values) / len(values)
    return mean, sum((v - mean) ** 2 for v in values) / (len(values) - 1)
