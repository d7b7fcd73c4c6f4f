"""scripts/draft_tree_gain.py and scripts/hybrid_ceiling.py without a model: rank trees, their acceptance and
costs, Sequoia's tree of the most frequent paths, and the oracle's dynamic program against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from tests.scripts import scripts_loaded


@pytest.fixture(scope="module")
def scripts():
    with scripts_loaded("tree_verify_gain", "draft_tree_gain", "hybrid_ceiling") as modules:
        yield modules[1], modules[2]


def test_a_tree_accepts_the_longest_prefix_of_the_ranks_it_holds(scripts):
    trees, _ = scripts
    tree = trees.RankTree(frozenset({(1,), (2,), (1, 1), (1, 2), (2, 1), (1, 1, 1)}))
    assert tree.accepted([1, 1, 1, 5]) == 3
    assert tree.accepted([1, 2, 1]) == 2  # (1, 2, 1) is not in the tree
    assert tree.accepted([2, 1, 1]) == 2
    assert tree.accepted([3, 1]) == 0
    assert tree.accepted([1]) == 1  # the output ends
    assert trees.RankTree.chain(3).accepted([1, 1, 2, 1]) == 2


def test_level_widths_count_the_nodes_that_have_children(scripts):
    trees, _ = scripts
    assert trees.RankTree.chain(4).level_widths() == [1, 1, 1, 1]  # a chain of k: k forwards of one token
    tree = trees.RankTree(frozenset({(1,), (2,), (3,), (1, 1), (1, 2), (2, 1), (1, 1, 1)}))
    assert tree.level_widths() == [1, 2, 1]  # root; (1) and (2); (1, 1)


def test_the_best_tree_holds_the_most_frequent_paths_and_their_prefixes(scripts):
    trees, _ = scripts
    rng = random.Random(3)
    rank_lists = [[min(1 + int(rng.expovariate(1.5)), 9) for _ in range(200)] for _ in range(5)]
    counts = trees.path_counts(rank_lists)
    # Brute force: each path's count is the positions where the ranks start with it.
    for path in list(counts)[:50]:
        expected = sum(1 for ranks in rank_lists for p in range(len(ranks)) if tuple(ranks[p : p + len(path)]) == path)
        assert counts[path] == expected
    for size in (1, 4, 16, 40):
        tree = trees.best_tree(counts, size)
        assert len(tree) == size
        assert all(path[:-1] in tree.paths for path in tree.paths if len(path) > 1)
        assert min(counts[p] for p in tree.paths) >= max(counts[p] for p in counts if p not in tree.paths)


def test_replay_commits_the_accepted_tokens_and_one_more(scripts):
    trees, _ = scripts
    # 8 output tokens after the first: a chain of 2 accepts 2 (+1), then 0 (+1), then 2 (+1), then the last one.
    ranks = [1, 1, 1, 3, 1, 1, 4, 1]
    r = trees.replay(trees.RankTree.chain(2), [ranks], round_seconds=0.5)
    assert (r.rounds, r.tokens, r.seconds) == (4, 8, 2.0)


def _brute_force(length, options):
    """Every sequence of choices, exhaustively: the least total seconds."""
    best = float("inf")
    for choices in itertools.product(range(8), repeat=length):
        p, seconds = 1, 0.0
        for c in choices:
            if p >= length:
                break
            opts = options(p)
            step, cost, _ = opts[c % len(opts)]
            p, seconds = min(p + step, length), seconds + cost
        if p >= length:
            best = min(best, seconds)
    return best


def test_the_oracle_finds_the_fastest_rounds(scripts):
    _, ceiling = scripts
    rng = random.Random(7)
    for _ in range(20):
        length = rng.randint(2, 7)
        table = {p: [(1, 1.0, "plain")] + [(rng.randint(1, 4), rng.uniform(0.8, 3.0), "x") for _ in range(2)]
                 for p in range(1, length)}
        seconds, kinds = ceiling.fastest(length, lambda p: table[p])
        assert seconds == pytest.approx(_brute_force(length, lambda p: table[p]))
        assert sum(kinds.values()) >= 1
