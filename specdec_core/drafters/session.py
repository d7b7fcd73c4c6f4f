"""One sequence's standing with its drafters: a small state machine per drafter, and what the request allows.

Each drafter (the draft model, and a hybrid's free drafter) is, for each sequence, in one `DraftState`:

    IDLE --start--> ACTIVE --a failed call (model: propose, observe)--> IDLE   (started again the next time it drafts)
    IDLE --start fails--> FAILED                                               (no more drafts from it, for good)
    ACTIVE --the free drafter's propose fails--> FAILED
    ACTIVE --release (the request ended)--> IDLE

Every transition that calls a drafter catches what the drafter raises: a drafter's failure costs the sequence its
speculation, never the request, whose output stays the target's. The engine decides when to start, observe or
release; what each step does to the state, and which failures are survived how, is said here once.

Lives in `drafters` (not beside the engine) so that `drafters.hybrid` can use it: the layering contract forbids a
cycle between `specdec_core`'s modules.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from specdec_core.config import AUTO
from specdec_core.drafters.base import Drafter
from specdec_core.errors import InvalidArgument
from specdec_core.faults import Faults

log = logging.getLogger(__name__)

NO_SPECULATION = "none"  # a request's `speculation_method` for plain decoding


class DraftState(enum.Enum):
    IDLE = "idle"  # the drafter holds nothing for the sequence: not started yet, or dropped after a failed call
    ACTIVE = "active"  # the drafter holds state for it
    FAILED = "failed"  # the drafter could not take it: it goes on without this drafter's proposals


def allowed(speculation_method: str | None, drafter: Drafter | None, free: Drafter | None) -> tuple[bool, bool]:
    """Whether a request with this `speculation_method` may use the draft model (`drafter`) and the free drafter:
    both for "auto" (or None); neither for "none"; else the one it names, or `InvalidArgument` naming the choices."""
    if speculation_method in (None, AUTO):
        return True, True
    if speculation_method == NO_SPECULATION:
        return False, False
    methods = tuple(d.name for d in (free, drafter) if d is not None)
    if drafter is None or speculation_method not in methods:
        choices = ", ".join((AUTO, *methods, NO_SPECULATION))
        raise InvalidArgument("speculation_method", f"{speculation_method!r} is not run here; choose one of {choices}")
    return speculation_method == drafter.name, free is not None and speculation_method == free.name


@dataclass
class DraftSession:
    """Mutable: the engine's record of what its drafters hold for one sequence."""

    seq_id: str
    cache_salt: str | None  # the drafters share cached prefixes only among sequences of one salt
    model_allowed: bool = True  # the request may use the draft model (`speculation_method`)
    free_allowed: bool = True  # ... and the free drafter
    model: DraftState = DraftState.IDLE
    free: DraftState = DraftState.IDLE
    drafted_upto: int = 0  # committed tokens after its last round with drafts: the draft model has read up to here
    draft_cached: int | None = None  # while IDLE: of its tokens, what the draft model's prefix cache holds (asked once)

    @property
    def drafting(self) -> bool:
        """The draft model holds state for the sequence."""
        return self.model is DraftState.ACTIVE

    @property
    def may_draft(self) -> bool:
        """The draft model may draft for it: the sequence was not refused a start."""
        return self.model is not DraftState.FAILED

    @property
    def may_use_free(self) -> bool:
        """The free drafter may propose for it: the request allows it, and it has not failed the sequence."""
        return self.free_allowed and self.free is not DraftState.FAILED

    # -- the draft model -----------------------------------------------------------------------------------------

    def unread(self, drafter: Drafter | None, tokens: Sequence[int]) -> int:
        """Context the draft model would read before drafting: the tokens committed since its last round with drafts;
        if it holds nothing, all of them but what its prefix cache holds (a conversation's next turn finds the last
        one there), asked once per start. Mutates: remembers that answer."""
        if self.drafting:
            return len(tokens) - self.drafted_upto
        if drafter is None:
            return 0
        if self.draft_cached is None:
            try:
                self.draft_cached = drafter.cached(self.seq_id, tokens, self.cache_salt)
            except Exception as exc:  # an estimate: without it a start is priced at the whole context
                log.warning("drafter could not say what it holds of %s: %s", self.seq_id, exc)
                self.draft_cached = 0
        return len(tokens) - self.draft_cached

    def started(self, num_tokens: int) -> None:
        """The draft model started the sequence with its `num_tokens` committed tokens: IDLE -> ACTIVE."""
        self.model, self.drafted_upto = DraftState.ACTIVE, num_tokens

    def drafted(self, num_tokens: int) -> None:
        """A round with drafts ended with `num_tokens` committed: the draft model has read them all."""
        if self.drafting:
            self.drafted_upto = num_tokens

    def observe(self, drafter: Drafter | None, free: Drafter | None, num_committed: int, faults: Faults) -> None:
        """Tell the drafters that hold state for the sequence its committed length. A draft model that raises is
        dropped (`drop`: started again later); a free drafter that raises is stopped for the sequence
        (`stop_free`). Either costs proposals, never the request."""
        if self.drafting and drafter is not None:
            try:
                drafter.observe(self.seq_id, num_committed)
            except Exception as exc:
                faults.failed(exc)
                self.drop(drafter, faults)
        if self.free is DraftState.ACTIVE and free is not None:
            try:
                free.observe(self.seq_id, num_committed)
            except Exception:
                log.warning("the %s drafter failed to observe %s", free.name, self.seq_id, exc_info=True)
                self.stop_free(free)

    def drop(self, drafter: Drafter | None, faults: Faults) -> None:
        """ACTIVE -> IDLE on the draft model: what it holds for the sequence is freed (or lost, if the release
        raises too); it is started again, with all the sequence has committed, the next round it drafts."""
        if self.drafting and drafter is not None:
            self.model, self.draft_cached = DraftState.IDLE, None
            try:
                drafter.release(self.seq_id)
            except Exception as exc:  # what it held is lost either way
                faults.failed(exc)

    def release(self, drafter: Drafter | None, free: Drafter | None, faults: Faults) -> None:
        """The request ended: both drafters free what they hold for it."""
        self.drop(drafter, faults)
        if self.free is DraftState.ACTIVE and free is not None:
            self.free = DraftState.IDLE
            free.release(self.seq_id)

    # -- the free drafter ----------------------------------------------------------------------------------------

    def start_free(self, free: Drafter, tokens: Sequence[int]) -> bool:
        """IDLE -> ACTIVE on the free drafter (it indexes the context: no model runs), or FAILED where that raised.
        Whether it holds the sequence now."""
        if self.free is DraftState.IDLE:
            try:
                free.start(self.seq_id, tokens, self.cache_salt)
            except Exception as exc:
                log.warning("the %s drafter could not start %s: %s", free.name, self.seq_id, exc)
                self.free = DraftState.FAILED
                return False
            self.free = DraftState.ACTIVE
        return self.free is DraftState.ACTIVE

    def stop_free(self, free: Drafter) -> None:
        """-> FAILED on the free drafter, released if it held the sequence: the request goes on without it."""
        was_active, self.free = self.free is DraftState.ACTIVE, DraftState.FAILED
        if was_active:
            try:
                free.release(self.seq_id)
            except Exception:  # it has failed already: what it holds is lost either way
                log.warning("the %s drafter failed to release %s", free.name, self.seq_id, exc_info=True)


@dataclass(frozen=True)
class Start:
    """One call that started sequences on the draft model: what the cost model learns starting costs from."""

    num_tokens: int  # context handed over, all sequences together
    cached: tuple[int, ...]  # per sequence, the tokens found in the drafter's prefix cache instead of read
    seconds: float


def start_drafting(drafter: Drafter, sessions: list[DraftSession], contexts: list[Sequence[int]]) -> list[Start]:
    """Start `sessions` (IDLE) on the draft model, each with its committed tokens (`contexts`): in one call where
    the drafter offers `start_many` and there are several, else one by one. A session the drafter refuses becomes
    FAILED and decodes plainly from then on. Returns the calls that succeeded."""
    start_many = getattr(drafter, "start_many", None)
    if len(sessions) > 1 and start_many is not None:
        t0 = time.perf_counter()
        try:
            cached = start_many([(s.seq_id, tokens, s.cache_salt) for s, tokens in zip(sessions, contexts)])
        except Exception as exc:  # all or none started: each is tried alone below, so one cannot fail the rest
            log.warning("drafter could not start %d sequences together, trying each: %s", len(sessions), exc)
        else:
            seconds = time.perf_counter() - t0
            for session, tokens in zip(sessions, contexts):
                session.started(len(tokens))
            return [Start(sum(len(tokens) for tokens in contexts), tuple(cached), seconds)]
    starts = []
    for session, tokens in zip(sessions, contexts):
        t0 = time.perf_counter()
        try:
            cached_one = drafter.start(session.seq_id, tokens, session.cache_salt)
        except Exception as exc:
            log.warning("drafter could not start %s, it decodes without drafts: %s", session.seq_id, exc)
            session.model = DraftState.FAILED
            continue
        seconds = time.perf_counter() - t0
        session.started(len(tokens))
        starts.append(Start(len(tokens), (cached_one,), seconds))
    return starts


def drafts_failed(sessions: list[DraftSession], drafter: Drafter | None, faults: Faults, error: Exception) -> None:
    """A draft model call for `sessions` raised: what it holds for them is in no known state, so each is dropped
    (`DraftSession.drop`) and started again the next round it drafts. Their output stays the target's."""
    faults.failed(error)
    for session in sessions:
        session.drop(drafter, faults)
