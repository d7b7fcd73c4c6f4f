"""SuffixDecoding: the depth-bounded suffix trie against brute force, the proposal rule, the global structure's
bound and reuse across requests, and exactness through the engine."""

from __future__ import annotations

import random
import threading
import tracemalloc
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec_core.config import SamplingParams, TokenShaping
from specdec_core.drafters.base import DraftRequest
from specdec_core.drafters.suffix import SuffixDrafter, SuffixTrie, _Global


def _occurrences(docs, pattern, max_depth):
    """Brute force: next token -> count over every occurrence of `pattern` followed by a token within depth."""
    m, found = len(pattern), Counter()
    if m >= max_depth:
        return found
    for doc in docs:
        for s in range(len(doc) - m):
            if list(doc[s : s + m]) == list(pattern):
                found[doc[s + m]] += 1
    return found


def _brute_longest(docs, tokens, max_len, max_depth):
    for m in range(min(max_len, len(tokens), max_depth - 1), 0, -1):
        if _occurrences(docs, tokens[len(tokens) - m :], max_depth):
            return m
    return 0


def _counts(trie, pattern):
    node, depth = trie.root, 0
    for t in pattern:
        node = trie.continuations(node, depth).get(t)
        if node is None:
            return Counter()
        depth += 1
    return Counter({t: child.count for t, child in trie.continuations(node, depth).items()})


sequences = st.lists(st.integers(0, 3), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    docs=st.lists(sequences, min_size=1, max_size=4),
    chunk=st.integers(1, 7),
    depth=st.integers(2, 9),
    query=st.lists(st.integers(0, 3), min_size=1, max_size=12),
)
def test_longest_match_and_counts_equal_brute_force(docs, chunk, depth, query):
    trie = SuffixTrie(depth)
    held = []
    for tokens in docs:  # grown in chunks, as a request's tokens commit
        doc: list[int] = []
        for i in range(0, len(tokens), chunk):
            trie.extend(doc, tokens[i : i + chunk])
            # Queries between chunks materialise tails: they must not change what later chunks index.
            trie.longest_match(doc, depth)
        held.append(doc)
    m, node = trie.longest_match(query, depth)
    assert m == _brute_longest(held, query, depth, depth)
    for n in range(1, min(len(query), depth) + 1):
        assert _counts(trie, query[-n:]) == _occurrences(held, query[-n:], depth)


@settings(max_examples=80, deadline=None)
@given(
    docs=st.lists(sequences, min_size=2, max_size=5),
    depth=st.integers(2, 8),
    query=st.lists(st.integers(0, 3), min_size=1, max_size=10),
    drop=st.data(),
)
def test_removing_a_document_forgets_exactly_its_occurrences(docs, depth, query, drop):
    trie = SuffixTrie(depth)
    held = []
    for tokens in docs:
        doc: list[int] = []
        trie.extend(doc, tokens)
        trie.close(doc)
        trie.longest_match(query, depth)  # materialise some tails before removal
        held.append(doc)
    for i in sorted(drop.draw(st.sets(st.integers(0, len(held) - 1))), reverse=True):
        trie.remove(held.pop(i))
    for n in range(1, min(len(query), depth) + 1):
        assert _counts(trie, query[-n:]) == _occurrences(held, query[-n:], depth)
    assert (trie.num_nodes, trie.num_dicts) == _walk(trie.root)  # what the size estimate counts stays true
    if not held:
        assert not trie.root.children and trie.num_nodes == 1 and trie.num_dicts == 0


def _walk(root):
    """(nodes, nodes with children) under `root`, counted."""
    nodes, dicts, below = 0, 0, [root]
    while below:
        node = below.pop()
        nodes += 1
        if node.children:
            dicts += 1
            below.extend(node.children.values())
    return nodes, dicts


def test_text_that_does_not_repeat_costs_about_a_node_per_token():
    trie = SuffixTrie(32)
    trie.extend([], list(range(1000)))
    assert trie.num_nodes <= 1001  # a plain depth-32 trie would hold ~32000


def _request(seq, tokens, k, probs=False):
    return DraftRequest(
        seq_id=seq, token_ids=tokens, num_tokens=k, shaping=TokenShaping(), uniform=None, return_probs=probs
    )


def _propose(drafter, tokens, k, seq="s"):
    (proposal,) = drafter.propose([_request(seq, tokens, k)])
    assert proposal.q is None  # point masses
    return proposal


def test_follows_the_most_frequent_continuation():
    d = SuffixDrafter(max_depth=16, min_match=2, min_prob=0.0)
    # After (1, 2): 3 twice then 4 once; after (1, 2, 3): 5 both times.
    tokens = [1, 2, 3, 5, 9, 1, 2, 4, 8, 1, 2, 3, 5, 7, 1, 2]
    d.start("s", tokens)
    proposal = _propose(d, tokens, 2)
    assert proposal.token_ids == [3, 5] and proposal.label == "suffix-2-3"


def test_a_low_frequency_continuation_stops_the_proposal():
    d = SuffixDrafter(max_depth=16, min_match=2, min_prob=0.5)
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]  # three continuations of (1, 2), each a third
    d.start("s", tokens)
    assert _propose(d, tokens, 4).token_ids == []


def test_a_short_match_proposes_nothing_and_k_and_the_match_length_cap_it():
    d = SuffixDrafter(max_depth=16, min_match=3)
    tokens = [7, 1, 2, 3, 4, 5, 6, 8, 1, 2]  # (1, 2) matches: shorter than min_match
    d.start("s", tokens)
    empty = _propose(d, tokens, 4)
    assert empty.token_ids == [] and empty.label is None
    tokens = [7, 1, 2, 3, 4, 5, 6, 9, 7, 1, 2]  # (7, 1, 2) matches: 3 tokens, k = 4 -> 3 proposed
    d.start("t", tokens)
    assert _propose(d, tokens, 4, seq="t").token_ids == [3, 4, 5]
    assert _propose(d, tokens, 2, seq="t").token_ids == [3, 4]


def test_the_request_structure_follows_committed_tokens():
    d = SuffixDrafter(max_depth=16, min_match=2)
    tokens = [10, 11, 12, 13]
    d.start("s", tokens)
    assert _propose(d, tokens, 2).token_ids == []
    tokens += [10, 11]  # committed later: (10, 11) recurs
    d.observe("s", len(tokens))
    proposal = d.propose([_request("s", tokens, 2, probs=True)])[0]
    assert proposal.token_ids == [12, 13] and proposal.draft_probs == (1.0, 1.0)


def test_a_later_request_reuses_an_earlier_output():
    d = SuffixDrafter(max_depth=64, min_match=2, index_prompts=False)
    prompt, output = [1, 2, 3], list(range(100, 140))
    live = list(prompt)
    d.start("a", live)
    d.propose([_request("a", live, 4)])
    live += output  # the engine's live list: the last round's tokens arrive without another propose
    d.release("a")
    d.release("a")  # idempotent
    again = [5, 6] + output[:20]  # a new request that repeats the earlier output
    d.start("b", again)
    proposal = _propose(d, again, 16, seq="b")
    assert proposal.token_ids == output[20:36] and proposal.label == "suffix-16-31"
    # The prompt was not indexed: nothing follows it in the global structure.
    d.start("c", [9, 1, 2])
    assert _propose(d, [9, 1, 2], 4, seq="c").token_ids == []


def test_requests_of_another_cache_salt_learn_nothing_from_it():
    d = SuffixDrafter(max_depth=32)
    output = list(range(100, 130))
    d.start("a", list(output), cache_salt="tenant-1")
    d.release("a")
    d.start("b", output[:10], cache_salt="tenant-2")
    assert _propose(d, output[:10], 8, seq="b").token_ids == []
    d.start("c", output[:10], cache_salt="tenant-1")
    assert _propose(d, output[:10], 8, seq="c").token_ids == output[10:18]


def test_the_global_structure_keeps_the_most_recent_requests():
    d = SuffixDrafter(max_depth=16, max_requests=2)
    for i in range(4):
        d.start(f"r{i}", [i, 50 + i, 60 + i, 70 + i, 80 + i])
        d.release(f"r{i}")
    assert len(d.global_.docs) == 2 and d.global_.num_tokens == 10
    for i, kept in [(0, False), (1, False), (2, True), (3, True)]:
        d.start(f"q{i}", [i, 50 + i])
        assert (_propose(d, [i, 50 + i], 2, seq=f"q{i}").token_ids == [60 + i, 70 + i]) == kept
    nodes = d.global_.tries[None].num_nodes
    for i in range(20):  # many more requests: the structure stays bounded
        d.start(f"x{i}", [i, 50 + i, 60 + i, 70 + i, 80 + i])
        d.release(f"x{i}")
    assert len(d.global_.docs) == 2 and d.global_.tries[None].num_nodes <= nodes + 10


def _released(d: SuffixDrafter, seq: str, tokens: list[int]) -> None:
    d.start(seq, tokens)
    d.release(seq)


def test_the_global_structure_is_bounded_by_its_size_in_bytes():
    """Evicted oldest first once over `max_bytes`, whatever `max_requests` allows; what is kept still proposes."""
    one = SuffixDrafter(max_depth=16)
    _released(one, "x", [900] + list(range(1000, 1030)))
    size = one.global_.bytes
    d = SuffixDrafter(max_depth=16, max_requests=256, max_bytes=int(2.5 * size))  # room for two such requests
    docs = [[900 + i] + list(range(1000 + 100 * i, 1030 + 100 * i)) for i in range(6)]
    for i, doc in enumerate(docs):
        _released(d, f"r{i}", doc)
        with d.global_.lock:
            assert d.global_.bytes <= d.global_.max_bytes
    assert [doc[0] for _, doc in d.global_.docs] == [904, 905]
    assert d.global_.num_tokens == 62
    for i, doc in enumerate(docs):  # evicted requests propose nothing; kept ones their continuation
        d.start(f"q{i}", doc[:3])
        assert _propose(d, doc[:3], 3, seq=f"q{i}").token_ids == (doc[3:6] if i >= 4 else [])
    assert (d.global_.tries[None].num_nodes, d.global_.tries[None].num_dicts) == _walk(d.global_.tries[None].root)


def test_a_request_larger_than_the_byte_budget_alone_is_not_kept():
    d = SuffixDrafter(max_depth=16, max_bytes=20_000)
    _released(d, "small", list(range(1000, 1010)))
    _released(d, "huge", [7, 8] * 2000)  # repeats: nodes at every depth
    assert not d.global_.docs and not d.global_.tries and d.global_.num_tokens == 0
    _released(d, "next", list(range(1000, 1010)))  # the structure goes on serving
    d.start("q", [1000, 1001])
    assert _propose(d, [1000, 1001], 3, seq="q").token_ids == [1002, 1003]


@pytest.mark.parametrize(
    "make",
    [
        lambda rng: [(j % 50) + 300 for j in range(1500)],  # repeats: nodes with one child each, D a token
        lambda rng: [rng.randrange(1000, 150_000) for _ in range(1500)],  # no repeats: about a leaf a token
        lambda rng: [rng.randrange(300, 320) for _ in range(1500)],  # a small alphabet: bushy near the root
    ],
    ids=["periodic", "random", "small-alphabet"],
)
def test_the_size_estimate_is_close_to_the_memory_the_structure_holds(make):
    """`bytes` is what the budget is spent by: it must neither hide most of the memory nor overstate it much."""
    rng = random.Random(0)
    tracemalloc.start()
    try:
        g = _Global(max_depth=32, max_requests=100)
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(3):
            g.add(None, [int(str(t)) for t in make(rng)])  # fresh int objects, as tokens off the wire are
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.75 * held <= g.bytes <= 1.5 * held


def _workload(seed: int, requests: int = 12) -> list[tuple[str | None, list[int]]]:
    """Requests that repeat spans of each other, under two salts."""
    rng = random.Random(seed)
    pool = [[rng.randrange(200) for _ in range(60)] for _ in range(4)]
    out = []
    for i in range(requests):
        tokens: list[int] = []
        while len(tokens) < 300:
            span = rng.choice(pool)
            at = rng.randrange(40)
            tokens += span[at : at + rng.randint(5, 20)] + [rng.randrange(200)]
        out.append((("a", "b")[i % 2], tokens))
    return out


def _drive(d: SuffixDrafter, workload) -> list[list[int]]:
    """Each request starts with its first 40 tokens, proposes at every later position, and ends."""
    proposals = []
    for i, (salt, tokens) in enumerate(workload):
        live = tokens[:40]
        d.start(f"r{i}", live, cache_salt=salt)
        for t in tokens[40:]:
            proposals.append(d.propose([_request(f"r{i}", live, 8)])[0].token_ids)
            live.append(t)
        d.release(f"r{i}")
    return proposals


def test_background_indexing_proposes_what_synchronous_indexing_does():
    workload = _workload(0)
    background = SuffixDrafter(max_requests=5, background=True)
    proposals = _drive(background, workload)
    assert proposals == _drive(SuffixDrafter(max_requests=5), workload)
    assert sum(map(len, proposals)) > 1000  # the global structure was drawn on
    background.flush()
    assert background._indexer.pending == 0 and len(background.global_.docs) == 5


def test_lookups_go_on_while_a_request_is_indexed_and_the_next_start_waits_for_it(monkeypatch):
    """The indexing thread is held inside its first chunk: release has returned, a running request drafts from
    the structure meanwhile, and the next request starts only once its predecessor is in."""
    from specdec_core.drafters import suffix as module

    d = SuffixDrafter(background=True)
    shared = list(range(100, 140))
    d.start("other", shared, cache_salt="b")
    d.release("other")
    d.start("reader", shared[:10], cache_salt="b")
    entered, go = threading.Event(), threading.Event()
    real_add = module._Global.add

    def held_add(self, salt, tokens, chunk=None):
        if salt == "a":
            entered.set()
            assert go.wait(10)
        return real_add(self, salt, tokens, chunk)

    monkeypatch.setattr(module._Global, "add", held_add)
    d.start("first", list(range(300, 340)), cache_salt="a")
    d.release("first")
    assert entered.wait(10) and d._indexer.pending == 1
    assert _propose(d, shared[:10], 8, seq="reader").token_ids == shared[10:18]
    started = threading.Event()
    waiter = threading.Thread(target=lambda: (d.start("next", [300, 301], cache_salt="a"), started.set()))
    waiter.start()
    assert not started.wait(0.2)  # held: "first" is not indexed yet
    go.set()
    waiter.join(10)
    assert started.is_set()
    assert _propose(d, [300, 301], 8, seq="next").token_ids == list(range(302, 304))


def test_a_request_that_fails_to_index_is_logged_and_the_thread_goes_on(monkeypatch, caplog):
    from specdec_core.drafters import suffix as module

    d = SuffixDrafter(background=True)
    real_add = module._Global.add

    def failing_add(self, salt, tokens, chunk=None):
        if tokens[0] == 1:
            raise RuntimeError("boom")
        return real_add(self, salt, tokens, chunk)

    monkeypatch.setattr(module._Global, "add", failing_add)
    for i, first in enumerate((1, 2)):
        d.start(f"r{i}", [first] + list(range(100, 120)))
        d.release(f"r{i}")
    d.flush()
    assert "indexing an ended request failed" in caplog.text
    assert len(d.global_.docs) == 1 and d.global_.docs[0][1][0] == 2


def test_options_are_validated():
    with pytest.raises(ValueError):
        SuffixDrafter(max_depth=8, min_match=5)
    with pytest.raises(ValueError):
        SuffixDrafter(max_requests=-1)
    with pytest.raises(ValueError):
        SuffixDrafter(max_bytes=-1)
    with pytest.raises(ValueError):
        SuffixDrafter(min_prob=1.5)


def test_greedy_suffix_drafting_through_the_engine_equals_plain_decoding(tiny_target):
    """Greedy: token for token. Sampled output follows the target's law (tests/specdec_core/test_statistical.py)."""
    from tests.helpers import make_engine, run_to_completion

    text = "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n"
    ids = tiny_target.tokenizer(text)["input_ids"] * 2
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    expected, _, _ = run_to_completion(make_engine(tiny_target), [("r", ids, params, 0)])["r"]
    engine = make_engine(tiny_target, "suffix")
    proposed = 0
    for request_id in ("first", "again"):  # the second also finds the first's output in the global structure
        tokens, _, last = run_to_completion(engine, [(request_id, ids, params, 4)])[request_id]
        assert tokens == expected
        proposed += last.stats.proposed
    assert proposed > 0
