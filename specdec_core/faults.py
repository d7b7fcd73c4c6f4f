"""Failures of a part the engine can do without (a drafter): logged once per burst, and met with a growing rest.

A drafter that raises costs its rows their drafts, never their requests (`SpecEngine._propose`): the round goes
on as plain decoding. Should it keep failing, retrying it every round would write a traceback a round and pay for
restarting its sequences each time; `Faults` spaces the retries out instead, and says once that the part failed and
once that it answers again.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class Faults:
    """The failures of one part, as the engine meets them. A burst is a run of failed calls with no successful one
    between: its first failure is logged with its traceback, its end with how many calls failed, nothing in between.
    After the n-th failure of a burst the part rests 2^(n-1) - 1 rounds (0, 1, 3, 7, ... up to `max_rest`): one
    failure costs one round's drafts; a part that keeps failing is tried about once every `max_rest` rounds."""

    def __init__(self, what: str, max_rest: int = 64) -> None:
        self.what = what
        self.max_rest = max_rest
        self.failures = 0  # failed calls in the current burst (0: none)
        self._rest = 0  # rounds left before the part is called again
        self._step = 0  # the rest after the latest failure

    def resting(self) -> bool:
        """Whether to leave the part out of this round. Mutates: call it once per round that would call the part."""
        if self._rest == 0:
            return False
        self._rest -= 1
        return True

    def failed(self, error: BaseException) -> None:
        """A call to the part raised `error`."""
        if self.failures == 0:
            log.warning(
                "the %s failed; its sequences go on without it (exact, only slower) until it answers again: %s",
                self.what,
                error,
                exc_info=error,
            )
        self._step = 0 if self.failures == 0 else min(2 * self._step + 1, self.max_rest)
        self._rest = self._step
        self.failures += 1

    def succeeded(self) -> None:
        """A call to the part returned: a burst of failures, if one was running, has ended."""
        if self.failures:
            log.info("the %s answers again, after %d failed calls", self.what, self.failures)
            self.failures = 0
