"""The online watch's window: running sums checked against recomputing from the rounds themselves."""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import threading
import tracemalloc

import pytest

from specdec_core.watch import AcceptanceWatch, RoundSample, WindowSnapshot


def _round(variant="a", k=4, proposed=None, accepted=0, committed=None, seconds=0.1) -> RoundSample:
    proposed = k if proposed is None else proposed
    committed = accepted + 1 if committed is None else committed
    return RoundSample(variant, k, proposed, accepted, committed, seconds)


def _brute_force(rounds: list[RoundSample], variant: str, max_positions: int) -> WindowSnapshot:
    """The snapshot from its definitions, over the rounds the window should hold."""
    spec = [r for r in rounds if r.k > 0]
    plain = [r for r in rounds if r.k == 0]
    proposed = sum(r.proposed for r in spec)
    accepted = sum(r.accepted for r in spec)
    positions = []
    for j in range(1, max_positions + 1):
        tried = [r for r in spec if r.proposed >= j and r.accepted >= j - 1]
        positions.append(sum(r.accepted >= j for r in tried) / len(tried) if tried else None)

    def rate(rs):
        seconds = sum(r.seconds for r in rs)
        return sum(r.committed for r in rs) / seconds if seconds else None

    return WindowSnapshot(
        variant=variant,
        rounds=len(rounds),
        proposed=proposed,
        accepted=accepted,
        acceptance_rate=accepted / proposed if proposed else None,
        position_acceptance=tuple(positions),
        tokens_per_round=sum(r.committed for r in spec) / len(spec) if spec else None,
        speculative_tokens_per_s=rate(spec),
        plain_tokens_per_s=rate(plain),
    )


def _random_round(rng: random.Random, variant: str) -> RoundSample:
    k = rng.choice([0, 0, 1, 2, 3, 5, 8])
    proposed = rng.choice([k, k, rng.randint(0, k)])  # mostly all k; sometimes fewer, or none (a fallback)
    accepted = rng.randint(0, proposed)
    seconds = rng.choice([0.0, rng.uniform(0.001, 0.5)])  # a zero-length round must not break the sums
    return RoundSample(variant, k, proposed, accepted, accepted + rng.randint(0, 1), seconds)


@pytest.mark.parametrize("seed", range(5))
def test_the_window_matches_a_recomputation_after_every_round_evictions_included(seed):
    rng = random.Random(seed)
    window, positions = rng.choice([1, 3, 17]), rng.choice([1, 4, 6])
    watch = AcceptanceWatch(window_rounds=window, max_positions=positions)
    history = {"x": [], "y": []}
    for _ in range(400):
        variant = rng.choice(list(history))
        sample = _random_round(rng, variant)
        watch.record(sample)
        history[variant].append(sample)
        expected = _brute_force(history[variant][-window:], variant, positions)
        _assert_close(watch.snapshot(variant), expected, at=len(history[variant]))


def _assert_close(actual: WindowSnapshot, expected: WindowSnapshot, at: int) -> None:
    """Equal, but for rounding in the rates (the watch sums seconds as nanoseconds); None only where expected."""
    got, want = dataclasses.asdict(actual), dataclasses.asdict(expected)
    got.update(enumerate(got.pop("position_acceptance")))
    want.update(enumerate(want.pop("position_acceptance")))
    for name, value in want.items():
        same = (
            got[name] == value
            if value is None or isinstance(value, str)
            else math.isclose(got[name], value, rel_tol=1e-6)
        )
        assert same, f"after {at} rounds, {name}: {got[name]} != {value}"


def test_per_position_acceptance_is_conditional_on_reaching_the_position():
    watch = AcceptanceWatch(max_positions=4)
    for accepted in (0, 1, 3, 4):  # rejected at 1; at 2; at 4; all 4 accepted
        watch.record(_round(k=4, accepted=accepted))
    watch.record(_round(k=2, accepted=2))  # short: tries positions 1 and 2 only
    snap = watch.snapshot("a")
    # position 1: tried by all 5, accepted by 4; position 2: tried by 4 (those past 1), accepted by 3;
    # position 3: tried by 2 (the k = 2 round proposed no third), both accepted; position 4: tried 2, accepted 1.
    assert snap.position_acceptance == (4 / 5, 3 / 4, 2 / 2, 1 / 2)
    assert snap.acceptance_rate == (0 + 1 + 3 + 4 + 2) / (4 * 4 + 2)


def test_positions_no_round_reached_are_none_and_positions_past_the_limit_are_dropped():
    watch = AcceptanceWatch(max_positions=3)
    watch.record(_round(k=5, accepted=0))
    watch.record(_round(k=5, accepted=5))
    snap = watch.snapshot("a")
    assert snap.position_acceptance == (1 / 2, 1.0, 1.0)  # positions 4, 5: not kept
    watch = AcceptanceWatch(max_positions=3)
    watch.record(_round(k=3, accepted=0))
    assert watch.snapshot("a").position_acceptance == (0.0, None, None)


def test_none_where_there_is_nothing_to_divide_by():
    watch = AcceptanceWatch(max_positions=2)
    assert watch.snapshot("a") is None
    watch.record(_round(k=0, proposed=0, committed=1, seconds=0.05))  # plain decoding only
    snap = watch.snapshot("a")
    assert (snap.rounds, snap.acceptance_rate, snap.position_acceptance) == (1, None, (None, None))
    assert snap.tokens_per_round is None and snap.speculative_tokens_per_s is None
    assert snap.plain_tokens_per_s == pytest.approx(20.0)
    watch.record(_round(k=3, proposed=0, committed=1, seconds=0.1))  # asked for drafts, got none: a fallback
    snap = watch.snapshot("a")
    assert snap.acceptance_rate is None and snap.tokens_per_round == 1.0
    assert snap.speculative_tokens_per_s == pytest.approx(10.0)


def test_speculative_and_plain_rates_come_from_their_own_rounds():
    watch = AcceptanceWatch()
    watch.record(_round(k=4, accepted=3, committed=4, seconds=0.2))
    watch.record(_round(k=4, accepted=1, committed=2, seconds=0.1))
    watch.record(_round(k=0, proposed=0, committed=1, seconds=0.05))
    snap = watch.snapshot("a")
    assert snap.rounds == 3 and snap.tokens_per_round == 3.0
    assert snap.speculative_tokens_per_s == pytest.approx(6 / 0.3)
    assert snap.plain_tokens_per_s == pytest.approx(1 / 0.05)


def test_variants_are_separate_and_forgotten_alone():
    watch = AcceptanceWatch(window_rounds=2)
    watch.record(_round("draft-b", accepted=4))
    for _ in range(5):
        watch.record(_round("draft-a", accepted=0))
    assert watch.variants() == ["draft-a", "draft-b"]
    assert watch.snapshot("draft-a").acceptance_rate == 0.0 and watch.snapshot("draft-a").rounds == 2
    assert watch.snapshot("draft-b").acceptance_rate == 1.0 and watch.snapshot("draft-b").rounds == 1
    watch.forget("draft-a")
    watch.forget("never-seen")
    assert watch.variants() == ["draft-b"] and watch.snapshot("draft-a") is None


def test_memory_stays_bounded_however_many_rounds_are_recorded():
    watch = AcceptanceWatch(window_rounds=64)
    samples = [_round(accepted=i % 5) for i in range(5)]  # reused: only the window's own memory may grow
    tracemalloc.start()
    try:
        for i in range(2_000):
            watch.record(samples[i % 5])
        before, _ = tracemalloc.get_traced_memory()
        for i in range(50_000):
            watch.record(samples[i % 5])
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - before < 16_384  # unbounded, 48,000 more deque entries would hold ~400 KB
    assert watch.snapshot("a").rounds == 64


def test_concurrent_records_are_all_counted():
    # Threads recording the same new variants at once: without the lock, two can each make a variant's window and
    # one window (with its rounds) is lost.
    watch = AcceptanceWatch()
    samples = [_round(f"v{i}", k=3, accepted=1) for i in range(5_000)]
    start = threading.Barrier(4)

    def record_all():
        start.wait()
        for sample in samples:
            watch.record(sample)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often
    try:
        threads = [threading.Thread(target=record_all) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    lost = {s.variant: 4 - watch.snapshot(s.variant).rounds for s in samples if watch.snapshot(s.variant).rounds != 4}
    assert not lost, f"{len(lost)} variants lost rounds"
    assert watch.snapshot("v0") == _brute_force([samples[0]] * 4, "v0", watch.max_positions)


@pytest.mark.parametrize(
    "field, value",
    [
        ("variant", ""),
        ("k", -1),
        ("k", 1.5),
        ("proposed", 5),
        ("accepted", 5),
        ("committed", -1),
        ("seconds", -0.1),
        ("seconds", float("nan")),
        ("seconds", float("inf")),
        ("k", True),
    ],
)
def test_bad_samples_are_refused_naming_the_field(field, value):
    fields = dict(variant="a", k=4, proposed=4, accepted=4, committed=5, seconds=0.1)
    fields[field] = value
    if field == "accepted":
        fields["proposed"] = 3
    with pytest.raises(ValueError, match=field):
        RoundSample(**fields)


@pytest.mark.parametrize("field, value", [("window_rounds", 0), ("max_positions", 0), ("window_rounds", 2.0)])
def test_bad_watch_arguments_are_refused_naming_them(field, value):
    with pytest.raises(ValueError, match=field):
        AcceptanceWatch(**{field: value})
    with pytest.raises(ValueError, match="sample"):
        AcceptanceWatch().record(("a", 1, 1, 1, 2, 0.1))
