"""The router's memory of which replica holds which prompt prefix, and the choice it makes with it."""

from __future__ import annotations

import numpy as np

from deployments.affinity import MAX_EXTRA_LOAD, MIN_MATCH_TOKENS, Candidate, PrefixAffinity, common_prefix

SYSTEM = list(range(100, 140))  # a 40-token shared prefix


def test_common_prefix():
    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4])) == 2
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert common_prefix(np.array([], dtype=np.int64), np.array([1])) == 0


def test_the_replica_holding_the_longest_prefix_is_chosen():
    affinity = PrefixAffinity()
    affinity.record("a", None, SYSTEM + [1, 2, 3])
    affinity.record("b", None, SYSTEM[:20] + [9, 9])
    both = [Candidate("a", 1, True), Candidate("b", 0, True)]
    assert affinity.choose(both, None, SYSTEM + [1, 2, 3, 4, 5]) == "a"
    assert affinity.match("b", None, SYSTEM + [7]) == 20


def test_salts_are_separate_namespaces():
    affinity = PrefixAffinity()
    affinity.record("a", "tenant-1", SYSTEM)
    candidates = [Candidate("a", 0, True), Candidate("b", 0, True)]
    assert affinity.choose(candidates, "tenant-1", SYSTEM + [1]) == "a"
    assert affinity.choose(candidates, "tenant-2", SYSTEM + [1]) is None
    assert affinity.choose(candidates, None, SYSTEM + [1]) is None


def test_short_matches_full_or_much_busier_replicas_leave_the_choice_to_load():
    affinity = PrefixAffinity()
    affinity.record("a", None, SYSTEM)
    short = SYSTEM[: MIN_MATCH_TOKENS - 1] + [0]
    assert affinity.choose([Candidate("a", 0, True), Candidate("b", 0, True)], None, short) is None
    assert affinity.choose([Candidate("a", 0, False), Candidate("b", 0, True)], None, SYSTEM) is None
    busy = [Candidate("a", MAX_EXTRA_LOAD + 1, True), Candidate("b", 0, True)]
    assert affinity.choose(busy, None, SYSTEM) is None
    assert affinity.choose([Candidate("a", MAX_EXTRA_LOAD, True), Candidate("b", 0, True)], None, SYSTEM) == "a"


def test_memory_is_bounded_and_forgotten_with_the_replica():
    affinity = PrefixAffinity(max_prompts=2)
    affinity.record("a", None, SYSTEM)
    affinity.record("a", None, [1] * 30)
    affinity.record("a", None, [2] * 30)
    assert affinity.match("a", None, SYSTEM) == 0  # the oldest was dropped
    assert affinity.match("a", None, [2] * 30) == 30
    affinity.forget("a")
    assert affinity.match("a", None, [2] * 30) == 0
