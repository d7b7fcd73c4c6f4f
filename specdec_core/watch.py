"""The online watch: per draft variant, a sliding window over its last rounds, read as acceptance and throughput.

A draft that served well for weeks can stop paying without any error: the target is updated, the traffic drifts to
another language, a quantised draft is deployed by mistake. What shows it is acceptance (accepted / proposed draft
tokens, overall and per position) and whether a speculative round still yields more tokens per second than a plain
one. The router records every round of every sequence here and exports snapshots as gauges (deployments.prometheus,
`WatchMetrics`); alert rules compare them with the variant's own past (k8s/monitoring/specdec-alerts.yaml).

Words as in `adaptive`: a round proposes `proposed` draft tokens (k of them, fewer where the drafter had fewer), the
target accepts a prefix of `accepted`, and the round commits `committed` tokens (the accepted ones and the
recovered or bonus token). Position j (1-based) is *tried* in a round when the j-th draft was proposed and drafts
1..j-1 were accepted; the per-position acceptance at j is accepted-at-j / tried-at-j, the conditional rate a_j of
`adaptive`'s model E(k) = 1 + a_1 + a_1 a_2 + ... .

Rates per second are per sequence: the rows of a batched round each record the round's wall time, so a window of
B-row rounds reads tokens per second per row; speculative and plain rounds compare at like batch sizes.

Memory is bounded per variant (`window_rounds` samples); the variants themselves are the caller's to `forget`.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RoundSample:
    """One sequence's round, as the router saw it."""

    variant: str  # the draft variant's name ("default" for a single `draft:` config)
    k: int  # speculation length chosen (0 = a plain decoding round)
    proposed: int  # draft tokens proposed (0..k); 0 with k > 0 is a round that asked for drafts and got none
    accepted: int  # of those, accepted (a prefix: positions 1..accepted)
    committed: int  # tokens the round added to the sequence
    seconds: float  # the round's wall time (shared by the rows of a batch)

    def __post_init__(self) -> None:
        if not isinstance(self.variant, str) or not self.variant:
            raise ValueError(f"variant must be a non-empty string, got {self.variant!r}")
        _check_int("k", self.k, 0)
        _check_int("proposed", self.proposed, 0, self.k)
        _check_int("accepted", self.accepted, 0, self.proposed)
        _check_int("committed", self.committed, 0)
        if not (isinstance(self.seconds, (int, float)) and math.isfinite(self.seconds) and self.seconds >= 0):
            raise ValueError(f"seconds must be a finite number >= 0, got {self.seconds!r}")


@dataclass(frozen=True)
class WindowSnapshot:
    """A variant's window as it stands. Rates are None where the window holds nothing to divide by."""

    variant: str
    rounds: int  # rounds in the window, speculative and plain
    proposed: int
    accepted: int
    acceptance_rate: float | None  # accepted / proposed over the window; None if nothing was proposed
    # The i-th entry is a_{i+1}: accepted at position i+1 / tried at position i+1 (see the module's docstring); None
    # where no round tried that position. Length: the watch's max_positions.
    position_acceptance: tuple[float | None, ...]
    tokens_per_round: float | None  # committed per speculative round (k > 0)
    speculative_tokens_per_s: float | None  # committed / seconds over speculative rounds
    plain_tokens_per_s: float | None  # committed / seconds over plain rounds (k == 0); None if the window has none


class _Sums:
    """One variant's running sums over its window. Integers only (seconds as nanoseconds): adding a round and
    later taking it away again leaves them exactly as they were, however long the watch runs."""

    def __init__(self, max_positions: int) -> None:
        self.spec_rounds = self.proposed = self.accepted = self.spec_committed = self.spec_ns = 0
        self.plain_rounds = self.plain_committed = self.plain_ns = 0
        self.tried = [0] * max_positions  # rounds that tried position j + 1
        self.hits = [0] * max_positions  # rounds that accepted position j + 1

    def add(self, s: RoundSample, sign: int) -> None:
        """Adds `s` (sign 1) or takes it away (sign -1)."""
        ns = sign * round(s.seconds * 1e9)
        if s.k == 0:
            self.plain_rounds += sign
            self.plain_committed += sign * s.committed
            self.plain_ns += ns
            return
        self.spec_rounds += sign
        self.proposed += sign * s.proposed
        self.accepted += sign * s.accepted
        self.spec_committed += sign * s.committed
        self.spec_ns += ns
        # Positions 1..accepted+1 were tried (up to what was proposed); 1..accepted were accepted.
        for j in range(min(s.proposed, s.accepted + 1, len(self.tried))):
            self.tried[j] += sign
            if j < s.accepted:
                self.hits[j] += sign

    def snapshot(self, variant: str) -> WindowSnapshot:
        return WindowSnapshot(
            variant=variant,
            rounds=self.spec_rounds + self.plain_rounds,
            proposed=self.proposed,
            accepted=self.accepted,
            acceptance_rate=_ratio(self.accepted, self.proposed),
            position_acceptance=tuple(_ratio(h, t) for h, t in zip(self.hits, self.tried)),
            tokens_per_round=_ratio(self.spec_committed, self.spec_rounds),
            speculative_tokens_per_s=_ratio(self.spec_committed * 1e9, self.spec_ns),
            plain_tokens_per_s=_ratio(self.plain_committed * 1e9, self.plain_ns),
        )


class AcceptanceWatch:
    """The last `window_rounds` rounds of each draft variant, with acceptance for positions 1..`max_positions`.

    Thread-safe (the router records from its round loop and exports from another task); `record` is O(1) in the
    window's length (O(max_positions) at most, for the per-position counts).
    """

    def __init__(self, window_rounds: int = 1024, max_positions: int = 16) -> None:
        _check_int("window_rounds", window_rounds, 1)
        _check_int("max_positions", max_positions, 1)
        self.window_rounds = window_rounds
        self.max_positions = max_positions
        self._lock = threading.Lock()
        self._windows: dict[str, tuple[deque[RoundSample], _Sums]] = {}

    def record(self, sample: RoundSample) -> None:
        """Adds `sample` to its variant's window, evicting the window's oldest round once it is full."""
        if not isinstance(sample, RoundSample):
            raise ValueError(f"sample must be a RoundSample, got {type(sample).__name__}")
        with self._lock:
            rounds, sums = self._windows.get(sample.variant) or self._new(sample.variant)
            rounds.append(sample)
            sums.add(sample, 1)
            if len(rounds) > self.window_rounds:
                sums.add(rounds.popleft(), -1)

    def snapshot(self, variant: str) -> WindowSnapshot | None:
        """The variant's window now; None for a variant with no rounds recorded (or forgotten)."""
        with self._lock:
            window = self._windows.get(variant)
            return None if window is None else window[1].snapshot(variant)

    def variants(self) -> list[str]:
        with self._lock:
            return sorted(self._windows)

    def forget(self, variant: str) -> None:
        """Drops the variant's window (a variant taken out of service); unknown names are ignored."""
        with self._lock:
            self._windows.pop(variant, None)

    def _new(self, variant: str) -> tuple[deque[RoundSample], _Sums]:
        window = self._windows[variant] = (deque(), _Sums(self.max_positions))
        return window


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
