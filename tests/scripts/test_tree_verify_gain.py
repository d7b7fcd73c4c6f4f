"""scripts/tree_verify_gain.py without a model: greedy acceptance of a tree, and a one-branch tree being the
suffix drafter's own chain."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

from specdec_core.config import TokenShaping
from specdec_core.drafters.base import DraftRequest
from specdec_core.drafters.suffix import SuffixDrafter

SCRIPT = Path(__file__).parents[2] / "scripts" / "tree_verify_gain.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("tree_verify_gain", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_the_deepest_matching_branch_is_accepted(script):
    # root -> 5 -> 6 -> 7   (first branch: right for one token)
    #      -> 8 -> 9 -> 10  (second branch: right for three)
    #              -> 11
    tree = script.Tree(parents=(-1, 0, 1, -1, 3, 4, 4), tokens=(5, 6, 7, 8, 9, 10, 11))
    assert tree.branches
    assert script.accepted_length(tree, [8, 9, 10, 12]) == 3
    assert script.accepted_length(tree, [8, 9, 11]) == 3
    assert script.accepted_length(tree, [5, 9, 10]) == 1  # 9 below 5 is not in the tree
    assert script.accepted_length(tree, [8, 9]) == 2  # the continuation ends
    assert script.accepted_length(tree, [4]) == 0
    assert script.accepted_length(script.Tree.chain([1, 2, 3]), [1, 2, 4]) == 2


def test_one_branch_is_the_drafters_chain(script):
    rng = random.Random(0)
    spans = [[rng.randrange(50) for _ in range(12)] for _ in range(6)]
    text = [t for _ in range(40) for t in rng.choice(spans)[: rng.randint(3, 12)]]
    drafter = SuffixDrafter()
    drafter.start("old", text[:150])
    drafter.release("old")  # the global trie holds it
    drafter.start("new", text[150:160])
    tokens = list(text[150:160])
    shapes = [script.TreeShape(1, 16), script.TreeShape(1, 3)]
    proposed = 0
    for t in text[160:]:
        tokens.append(t)
        for k in (16, 4):
            chain, trees = script.propose(drafter, DraftRequest("new", tokens, k, TokenShaping(), None), shapes)
            assert trees[shapes[0]] == script.Tree.chain(chain)
            assert trees[shapes[1]] == script.Tree.chain(chain[:3])
            proposed += len(chain)
    assert proposed > 0
