"""SuffixDecoding: model-free drafting from suffix structures over this request and earlier ones.

Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications" (arXiv 2411.04975).
Agentic and repeated workloads produce outputs that repeat spans of their own context *and of earlier requests'
outputs*. Two structures are searched each round: one per request (its prompt and output so far, grown as tokens
commit) and one global (the tokens of earlier requests that ended, kept in this drafter instance: per router
replica, since the drafter runs inside the router; replicas do not share it). The longest suffix of the committed
tokens found in either is continued by following, at each step, the most frequent next token. Proposals are
deterministic (q is a point mass), which rejection sampling handles exactly.

The structure is a suffix trie bounded by a depth D (`SuffixTrie`): every substring of length <= D of the indexed
tokens is a path from the root, each node counting its occurrences, so a node's children are the continuations
of that substring with their frequencies, which is what the proposal rule reads. Chosen over a suffix automaton
because it keeps those counts directly, grows token by token, and can forget one document (a request evicted by
age) by walking its paths and decrementing; an automaton supports neither deletion nor per-continuation counts
without extra passes. A plain depth-D trie costs O(D) nodes per token; here a path that occurs once below a node
is not materialised but kept as a reference into the token list (a "tail"), and split one node at a time when a
second occurrence walks into it, so text that does not repeat costs about one node per token.

A match is looked for up to D // 2 tokens, leaving at least D // 2 levels below it to continue from; since a
substring occurring implies its suffixes occur, the longest match is found by binary search over its length.

Adding an ended request to the global structure costs O(tokens x D) where text repeats, too long to hold up a
round: with `background=True` (what `draft.method: suffix` and `hybrid` build) `release` hands it to one
indexing thread, which inserts it a chunk at a time under the structure's lock, so the engine's round goes on
meanwhile (in the router a round mostly waits on its workers, and the thread runs then). Lookups take the same
lock, one request at a time. A request's `start` first waits until every request of its salt released before it
is indexed, so what a request can draft from is what synchronous indexing would give it: the same proposals.

The global structure is bounded twice: by ended requests kept (`max_requests`) and by its estimated size in bytes
(`max_bytes`, `SuffixTrie.bytes`), oldest evicted first. The count alone does not bound memory: where text repeats,
a request of a few thousand tokens materialises up to D nodes a token, some hundred bytes each.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec_core.drafters.base import DraftContext, DraftMethod, DraftRequest, Proposal

log = logging.getLogger(__name__)

# Tokens the indexing thread inserts per hold of the lock: the most a lookup waits for, so it must stay small.
INDEX_CHUNK = 64

# What the structure costs in CPython, by what it is made of (`SuffixTrie.bytes`): an estimate, checked against
# tracemalloc by a test. A node: the object with its four slots (64 bytes) and its entry in its parent's dict
# (a dict's table grows by doubling: about 32 bytes an entry). A node with children: its dict (header and a
# table of at least 8 slots). A token: its slot in the document's list and its int object (ids past 256 are not
# cached by CPython: each is its own object).
NODE_BYTES = 96
DICT_BYTES = 240
TOKEN_BYTES = 48
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class _Node:
    __slots__ = ("count", "children", "tail_doc", "tail_pos")

    def __init__(self, tail_doc: list[int] | None = None, tail_pos: int = 0) -> None:
        self.count = 1  # occurrences of this node's substring
        self.children: dict[int, _Node] | None = None
        # One occurrence continues below this node as tail_doc[tail_pos:], not materialised. Must stay true: a
        # tail's next token is never also a key of `children`.
        self.tail_doc, self.tail_pos = tail_doc, tail_pos


class SuffixTrie:
    """Every substring of length <= `max_depth` of the documents added, with occurrence counts. `extend` adds
    tokens to a document (its list is owned by the trie: never change it from outside); `remove` forgets one."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self.root.count = 0
        # Per document: (start, node, depth) of paths still growing that follow already materialised nodes.
        self._open: dict[int, list[tuple[int, _Node, int]]] = {}
        self.num_nodes = 1
        self.num_dicts = 0  # nodes whose `children` is a dict (never an empty one)

    def extend(self, doc: list[int], new_tokens: Sequence[int]) -> None:
        """Append `new_tokens` to `doc` (mutates it) and index every substring ending in them."""
        open_paths = self._open.setdefault(id(doc), [])
        for t in new_tokens:
            doc.append(t)
            end = len(doc)
            still_open = []
            for start, node, depth in [*open_paths, (end - 1, self.root, 0)]:
                child = self.continuations(node, depth).get(t)
                if child is None:  # a new substring: this occurrence goes on below it as a tail, doc[end:]
                    self._child(node, t, doc if depth + 1 < self.max_depth else None, end)
                    continue
                child.count += 1
                if depth + 1 < self.max_depth:
                    still_open.append((start, child, depth + 1))
            open_paths[:] = still_open

    def close(self, doc: list[int]) -> None:
        """`doc` takes no more tokens."""
        self._open.pop(id(doc), None)

    def remove(self, doc: list[int]) -> None:
        """Forget every occurrence in `doc` (added and closed before)."""
        self.close(doc)
        for start in range(len(doc)):
            node = self.root
            for depth in range(min(self.max_depth, len(doc) - start)):
                t = doc[start + depth]
                children = node.children
                child = children.get(t) if children else None
                if children is None or child is None:  # the rest of this occurrence is node's tail
                    node.tail_doc = None
                    break
                child.count -= 1
                if child.count == 0:
                    del children[t]
                    nodes, dicts = self._size(child)
                    self.num_nodes -= nodes
                    self.num_dicts -= dicts
                    if not children:
                        node.children = None
                        self.num_dicts -= 1
                    break
                node = child
            else:
                if node.tail_doc is doc:  # this occurrence ended here, at the document's end
                    node.tail_doc = None

    @property
    def bytes(self) -> int:
        """The nodes' estimated size in memory (the documents' tokens are their owner's to count)."""
        return NODE_BYTES * self.num_nodes + DICT_BYTES * self.num_dicts

    def longest_match(self, tokens: Sequence[int], max_len: int) -> tuple[int, _Node | None]:
        """The longest m <= max_len such that tokens[-m:] occurs followed by a token, and its node (0, None: none)."""
        lo, hi = 1, min(max_len, len(tokens), self.max_depth - 1)
        best: tuple[int, _Node | None] = (0, None)
        while lo <= hi:
            m = (lo + hi) // 2
            node = self._find(tokens[len(tokens) - m :])
            if node is not None and self.continuations(node, m):
                lo, best = m + 1, (m, node)
            else:
                hi = m - 1
        return best

    def continuations(self, node: _Node, depth: int) -> dict[int, _Node]:
        """The children of `node` (at `depth`): next token -> node, whose count is that continuation's frequency."""
        if node.tail_doc is not None and node.tail_pos < len(node.tail_doc) and depth < self.max_depth:
            self._child(node, node.tail_doc[node.tail_pos], node.tail_doc, node.tail_pos + 1)
            node.tail_doc = None
        return node.children or {}

    def _find(self, pattern: Sequence[int]) -> _Node | None:
        node = self.root
        for depth, t in enumerate(pattern):
            child = self.continuations(node, depth).get(t)
            if child is None:
                return None
            node = child
        return node

    def _child(self, node: _Node, t: int, doc: list[int] | None, tail_pos: int) -> _Node:
        if node.children is None:
            node.children = {}
            self.num_dicts += 1
        child = node.children[t] = _Node(doc, tail_pos)
        self.num_nodes += 1
        return child

    @staticmethod
    def _size(node: _Node) -> tuple[int, int]:
        """The nodes and the dicts of the subtree at `node`."""
        nodes, dicts, below = 0, 0, [node]
        while below:
            n = below.pop()
            nodes += 1
            if n.children:
                dicts += 1
                below.extend(n.children.values())
        return nodes, dicts


@dataclass
class _Request:
    trie: SuffixTrie
    doc: list[int] = field(default_factory=list)  # the committed tokens indexed so far
    num_prompt: int = 0  # tokens given at `start`: the prompt (and any output of rounds without drafts)
    cache_salt: str | None = None
    # The caller's committed tokens as last seen: the engine passes its live list, so at release this holds the
    # final output, including the last round's tokens that no propose saw. Read only.
    source: Sequence[int] = ()


@dataclass
class _Global:
    """Ended requests' tokens, one trie per cache salt (requests share what they learn only within a salt, as
    they share prefix caches), evicted oldest-ended first beyond `max_requests` requests or `max_bytes` (`bytes`)
    in all. Read and written under `lock`."""

    max_depth: int
    max_requests: int
    max_bytes: int = DEFAULT_MAX_BYTES
    tries: dict[str | None, SuffixTrie] = field(default_factory=dict)
    docs: deque[tuple[str | None, list[int]]] = field(default_factory=deque)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _per_salt: Counter[str | None] = field(default_factory=Counter)  # docs held per salt
    _tokens: int = 0  # tokens of `docs`

    def add(self, salt: str | None, tokens: Sequence[int], chunk: int | None = None) -> None:
        """Index `tokens` under `salt`, taking the lock once per `chunk` tokens (None: once). Older requests are
        evicted as it grows, so the structure stays within `max_bytes` but for one chunk; a request larger than
        `max_bytes` alone is dropped, as soon as it is seen to be."""
        if self.max_requests == 0 or self.max_bytes == 0 or not tokens:
            return
        step = chunk or len(tokens)
        doc: list[int] = []
        for at in range(0, len(tokens), step):
            with self.lock:
                trie = self.tries.get(salt)
                if trie is None:
                    trie = self.tries[salt] = SuffixTrie(self.max_depth)
                trie.extend(doc, tokens[at : at + step])
                self._evict(indexing=(salt, len(doc)))
                if self.bytes + TOKEN_BYTES * len(doc) > self.max_bytes:  # nothing older is left: it alone is too big
                    self._drop(salt, doc)
                    return
        with self.lock:
            trie.close(doc)  # type: ignore[union-attr]  # set in the loop: tokens is not empty
            self.docs.append((salt, doc))
            self._per_salt[salt] += 1
            self._tokens += len(doc)
            self._evict()

    @property
    def bytes(self) -> int:
        """The structure's estimated size in memory: its tries' nodes and its documents' tokens. Under `lock`."""
        return sum(trie.bytes for trie in self.tries.values()) + TOKEN_BYTES * self._tokens

    @property
    def num_tokens(self) -> int:
        with self.lock:
            return self._tokens

    def _evict(self, indexing: tuple[str | None, int] | None = None) -> None:
        """Evict the oldest documents while over either bound. `indexing`: the salt and tokens so far of a
        document being added, which count towards `max_bytes` and keep their salt's trie."""
        extra = TOKEN_BYTES * indexing[1] if indexing else 0
        while self.docs and (len(self.docs) > self.max_requests or self.bytes + extra > self.max_bytes):
            salt, doc = self.docs.popleft()
            self._per_salt[salt] -= 1
            self._tokens -= len(doc)
            self.tries[salt].remove(doc)
            self._forget_if_empty(salt, keep=indexing is not None and indexing[0] == salt)

    def _drop(self, salt: str | None, doc: list[int]) -> None:
        """Forget `doc`, being added, whole."""
        self.tries[salt].remove(doc)
        log.debug("suffix: an ended request of %d tokens is larger than max_bytes alone: not kept", len(doc))
        self._forget_if_empty(salt, keep=False)

    def _forget_if_empty(self, salt: str | None, keep: bool) -> None:
        if not keep and not self._per_salt[salt]:
            del self.tries[salt]
            self._per_salt.pop(salt, None)


class _Indexer:
    """One daemon thread adding ended requests to a `_Global`, in the order released."""

    def __init__(self, global_: _Global) -> None:
        self.global_ = global_
        self._jobs: deque[tuple[str | None, list[int]]] = deque()
        self._pending = 0
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, salt: str | None, tokens: list[int]) -> None:
        with self._changed:
            self._jobs.append((salt, tokens))
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="suffix-indexer", daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def wait(self) -> None:
        """Return once nothing is pending."""
        with self._changed:
            self._changed.wait_for(lambda: not self._pending)

    @property
    def pending(self) -> int:
        with self._changed:
            return self._pending

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._jobs)
                salt, tokens = self._jobs.popleft()
            try:
                self.global_.add(salt, tokens, INDEX_CHUNK)
            except Exception:  # a lost request costs later drafts a source, never the engine
                log.exception("suffix: indexing an ended request failed")
            finally:
                with self._changed:
                    self._pending -= 1
                    self._changed.notify_all()


class SuffixDrafter:
    """Continue the longest suffix match found in the request's own tokens or in earlier requests' (see module)."""

    name = "suffix"

    def __init__(
        self,
        max_depth: int = 32,
        min_match: int = 2,
        max_requests: int = 256,
        min_prob: float = 0.1,
        max_bytes: int = DEFAULT_MAX_BYTES,
        index_prompts: bool = True,
        background: bool = False,
    ) -> None:
        if max_depth < 2:
            raise ValueError(f"need max_depth >= 2, got {max_depth}")
        if not 1 <= min_match <= max_depth // 2:
            raise ValueError(f"need 1 <= min_match <= max_depth // 2, got min_match={min_match}, max_depth={max_depth}")
        if max_requests < 0:
            raise ValueError(f"need max_requests >= 0, got {max_requests}")
        if max_bytes < 0:
            raise ValueError(f"need max_bytes >= 0, got {max_bytes}")
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"need 0 <= min_prob <= 1, got {min_prob}")
        self.max_depth, self.min_match, self.min_prob, self.index_prompts = (
            max_depth,
            min_match,
            min_prob,
            index_prompts,
        )
        self.global_ = _Global(max_depth, max_requests, max_bytes)
        self._indexer = _Indexer(self.global_) if background else None
        self._requests: dict[str, _Request] = {}

    def flush(self) -> None:
        """Return once every request released so far is in the global structure."""
        if self._indexer is not None:
            self._indexer.wait()

    def start(self, seq_id: str, prompt_ids: Sequence[int], cache_salt: str | None = None) -> int:
        # What a request may draft from is every request released before it (eviction is across salts, so all
        # of them): what synchronous indexing would give it.
        self.flush()
        state = _Request(SuffixTrie(self.max_depth), num_prompt=len(prompt_ids), cache_salt=cache_salt)
        state.trie.extend(state.doc, prompt_ids)
        state.source = prompt_ids
        self._requests[seq_id] = state
        return 0

    def cached(self, seq_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        return 0

    def observe(self, seq_id: str, num_committed: int) -> None:
        """Nothing to roll back: the structures only ever hold committed tokens."""

    def release(self, seq_id: str) -> None:
        """The request's tokens (its output, and its prompt when `index_prompts`) join the global structure."""
        state = self._requests.pop(seq_id, None)
        if state is None:
            return
        tokens = state.source if len(state.source) >= len(state.doc) else state.doc
        ended = list(tokens[0 if self.index_prompts else state.num_prompt :])
        if self._indexer is None:
            self.global_.add(state.cache_salt, ended)
        else:
            self._indexer.submit(state.cache_salt, ended)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        proposals = []
        for r in requests:
            tokens, m = self._lookup(r)
            # A longer match is a better guess: the label (the match length's power-of-two bucket) lets the
            # engine learn how much better, and verify only what each bucket earns.
            probs = (1.0,) * len(tokens) if r.return_probs else None
            proposals.append(Proposal(tokens, q=None, draft_probs=probs, label=_label(m) if tokens else None))
        return proposals

    def _lookup(self, request: DraftRequest) -> tuple[list[int], int]:
        """The most frequent continuation of the longest match in either structure, and the match length."""
        state = self._requests[request.seq_id]
        tokens = request.token_ids
        state.trie.extend(state.doc, tokens[len(state.doc) :])
        state.source = tokens
        best = self._best(state.trie, tokens, request.num_tokens, (0, 0.0, []))
        with self.global_.lock:
            if (shared := self.global_.tries.get(state.cache_salt)) is not None:
                best = self._best(shared, tokens, request.num_tokens, best)
        return best[2], best[0]

    def _best(
        self, trie: SuffixTrie, tokens: Sequence[int], k: int, best: tuple[int, float, list[int]]
    ) -> tuple[int, float, list[int]]:
        """`best`, or `trie`'s proposal where its (match length, score) beats it."""
        m, node = trie.longest_match(tokens, self.max_depth // 2)
        if m < self.min_match or node is None:
            return best
        # SuffixDecoding's rule of thumb: speculate about as many tokens as the match is long.
        draft, score = self._follow(trie, node, m, min(k, m))
        return (m, score, draft) if (m, score) > best[:2] else best

    def _follow(self, trie: SuffixTrie, node: _Node, depth: int, budget: int) -> tuple[list[int], float]:
        """Up to `budget` tokens, each the most frequent continuation, while the product of their conditional
        frequencies stays >= min_prob; and the sum of those products (the expected number accepted, were the
        frequencies the acceptance rates: SuffixDecoding's score)."""
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < budget:
            children = trie.continuations(node, depth)
            if not children:
                break
            total = sum(child.count for child in children.values())
            t, child = max(children.items(), key=lambda item: item[1].count)
            prob *= child.count / total
            if prob < self.min_prob:
                break
            draft.append(t)
            score += prob
            node, depth = child, depth + 1
        return draft, score


def _label(match_len: int) -> str:
    """The bucket [2^i, 2^(i+1)) holding the match length: suffix-1, suffix-2-3, suffix-4-7, ..."""
    lo = 1 << (match_len.bit_length() - 1)
    return f"suffix-{lo}" if lo == 1 else f"suffix-{lo}-{2 * lo - 1}"


def _build(context: DraftContext) -> SuffixDrafter:
    spec = context.spec
    return SuffixDrafter(
        max_depth=spec.suffix_max_depth,
        min_match=spec.suffix_min_match,
        max_requests=spec.suffix_max_requests,
        min_prob=spec.suffix_min_prob,
        max_bytes=spec.suffix_max_bytes,
        index_prompts=spec.suffix_index_prompts,
        background=True,
    )


METHOD = DraftMethod(SuffixDrafter.name, runs_draft_model=False, build=_build)
