"""A sequence's draft session: each transition, and that a drafter's failure costs speculation, never the request
(nothing a drafter raises leaves a transition)."""

from __future__ import annotations

import pytest

from specdec_core.drafters.base import Proposal
from specdec_core.drafters.session import DraftSession, DraftState, allowed, drafts_failed, start_drafting
from specdec_core.errors import InvalidArgument
from specdec_core.faults import Faults


class _Drafter:
    """Records its calls; raises from the ones named in `fail`."""

    def __init__(self, name: str = "draft_model", fail: tuple[str, ...] = (), cached: int = 0) -> None:
        self.name, self.fail, self.cached_tokens = name, set(fail), cached
        self.calls: list[tuple] = []

    def _call(self, what: str, *args) -> None:
        self.calls.append((what, *args))
        if what in self.fail:
            raise RuntimeError(f"{what} failed")

    def start(self, seq_id, prompt_ids, cache_salt=None) -> int:
        self._call("start", seq_id, len(prompt_ids), cache_salt)
        return self.cached_tokens

    def cached(self, seq_id, token_ids, cache_salt=None) -> int:
        self._call("cached", seq_id)
        return self.cached_tokens

    def propose(self, requests) -> list[Proposal]:
        self._call("propose", [r.seq_id for r in requests])
        return [Proposal([1], None) for _ in requests]

    def observe(self, seq_id, num_committed) -> None:
        self._call("observe", seq_id, num_committed)

    def release(self, seq_id) -> None:
        self._call("release", seq_id)


class _Batched(_Drafter):
    def start_many(self, starts) -> list[int]:
        self._call("start_many", [seq_id for seq_id, _, _ in starts])
        return [self.cached_tokens] * len(starts)


def _session(seq_id: str = "r") -> DraftSession:
    return DraftSession(seq_id, cache_salt="salt")


def test_a_new_session_holds_nothing_and_may_use_both_drafters():
    session = _session()
    assert (session.model, session.free) == (DraftState.IDLE, DraftState.IDLE)
    assert not session.drafting and session.may_draft and session.may_use_free


@pytest.mark.parametrize(
    "method,expected",
    [
        (None, (True, True)),
        ("auto", (True, True)),
        ("none", (False, False)),
        ("suffix", (False, True)),
        ("draft_model", (True, False)),
    ],
)
def test_what_a_request_allows_follows_its_speculation_method(method, expected):
    assert allowed(method, _Drafter("draft_model"), _Drafter("suffix")) == expected


def test_a_method_not_run_is_refused_naming_every_choice():
    with pytest.raises(InvalidArgument) as err:
        allowed("ngram", _Drafter("draft_model"), _Drafter("suffix"))
    assert err.value.field == "speculation_method"
    assert all(name in err.value.message for name in ("auto", "suffix", "draft_model", "none"))
    with pytest.raises(InvalidArgument):
        allowed("draft_model", None, None)  # plain decoding runs no method
    assert allowed("none", None, None) == (False, False)


def test_a_start_makes_the_session_active_with_all_it_has_read():
    drafter, session = _Drafter(cached=3), _session()
    starts = start_drafting(drafter, [session], [[1, 2, 3, 4, 5]])
    assert session.model is DraftState.ACTIVE and session.drafted_upto == 5
    assert drafter.calls == [("start", "r", 5, "salt")]
    assert [(s.num_tokens, s.cached) for s in starts] == [(5, (3,))]
    assert session.unread(drafter, [1, 2, 3, 4, 5, 6, 7]) == 2  # what was committed since


def test_a_refused_start_fails_the_session_for_good_and_the_others_start():
    drafter = _Drafter(fail=("start",))
    session = _session()
    assert start_drafting(drafter, [session], [[1, 2]]) == []
    assert session.model is DraftState.FAILED and not session.may_draft and not session.drafting
    session.drop(drafter, Faults("drafter"))  # a failed session holds nothing to release
    assert ("release", "r") not in drafter.calls


def test_several_start_in_one_call_where_the_drafter_offers_it_else_one_by_one():
    drafter, sessions = _Batched(), [_session("a"), _session("b")]
    starts = start_drafting(drafter, sessions, [[1, 2], [3, 4, 5]])
    assert drafter.calls == [("start_many", ["a", "b"])] and len(starts) == 1 and starts[0].num_tokens == 5
    assert [s.drafted_upto for s in sessions] == [2, 3] and all(s.drafting for s in sessions)
    failing, sessions = _Batched(fail=("start_many",)), [_session("a"), _session("b")]
    starts = start_drafting(failing, sessions, [[1, 2], [3, 4, 5]])
    assert [c[0] for c in failing.calls] == ["start_many", "start", "start"] and len(starts) == 2
    assert all(s.drafting for s in sessions)


def test_unread_asks_the_drafters_cache_once_per_start_and_survives_its_failure():
    drafter, session = _Drafter(cached=4), _session()
    assert session.unread(drafter, list(range(10))) == 6
    assert session.unread(drafter, list(range(12))) == 8
    assert drafter.calls == [("cached", "r")]
    broken = _Drafter(fail=("cached",))
    assert _session().unread(broken, list(range(10))) == 10  # priced at the whole context
    assert _session().unread(None, list(range(10))) == 0


def test_a_failed_observe_drops_the_session_to_be_started_again():
    drafter, faults, session = _Drafter(fail=("observe",)), Faults("drafter"), _session()
    start_drafting(drafter, [session], [[1, 2]])
    session.observe(drafter, None, 3, faults)
    assert session.model is DraftState.IDLE and session.may_draft and session.draft_cached is None
    assert drafter.calls[-1] == ("release", "r") and faults.failures == 1


def test_a_release_that_raises_is_counted_and_the_session_dropped_all_the_same():
    drafter, faults, session = _Drafter(fail=("release",)), Faults("drafter"), _session()
    start_drafting(drafter, [session], [[1, 2]])
    session.drop(drafter, faults)
    assert session.model is DraftState.IDLE and faults.failures == 1


def test_a_failed_propose_drops_every_session_of_the_call():
    drafter, faults, sessions = _Drafter(), Faults("drafter"), [_session("a"), _session("b")]
    start_drafting(drafter, sessions, [[1], [2]])
    drafts_failed(sessions, drafter, faults, RuntimeError("gone"))
    assert all(s.model is DraftState.IDLE for s in sessions) and faults.failures == 1
    assert [c for c in drafter.calls if c[0] == "release"] == [("release", "a"), ("release", "b")]


def test_the_free_drafter_starts_once_and_a_failed_start_stops_it_for_the_request():
    free, session = _Drafter("suffix"), _session()
    assert session.start_free(free, [1, 2]) and session.start_free(free, [1, 2, 3])
    assert [c[0] for c in free.calls] == ["start"] and session.free is DraftState.ACTIVE
    broken, other = _Drafter("suffix", fail=("start",)), _session()
    assert not other.start_free(broken, [1]) and other.free is DraftState.FAILED and not other.may_use_free
    assert not other.start_free(broken, [1]) and len(broken.calls) == 1  # never tried again


def test_stopping_the_free_drafter_releases_what_it_holds_and_swallows_a_failed_release():
    free, session = _Drafter("suffix", fail=("release",)), _session()
    session.start_free(free, [1])
    session.stop_free(free)
    assert session.free is DraftState.FAILED and free.calls[-1] == ("release", "r")
    session.release(None, free, Faults("drafter"))  # nothing left to release
    assert free.calls.count(("release", "r")) == 1


def test_the_end_of_a_request_releases_both_drafters():
    drafter, free, faults, session = _Drafter(), _Drafter("suffix"), Faults("drafter"), _session()
    start_drafting(drafter, [session], [[1]])
    session.start_free(free, [1])
    session.observe(drafter, free, 2, faults)
    assert drafter.calls[-1] == ("observe", "r", 2) and free.calls[-1] == ("observe", "r", 2)
    session.release(drafter, free, faults)
    assert (session.model, session.free) == (DraftState.IDLE, DraftState.IDLE)
    assert drafter.calls[-1] == ("release", "r") and free.calls[-1] == ("release", "r")
    assert faults.failures == 0
