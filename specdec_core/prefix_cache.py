"""Prefix caching on the slot-based KV cache: which tokens each slot holds, and the slots of finished sequences
kept as cache entries that a new sequence can start from.

The cache is written by position, so a slot's first `length` positions hold exactly the keys and values of the
first `length` tokens fed to it, whatever forward wrote them (prefill, decode, verify, a draft step) and whatever
was rolled back after. The index keeps those tokens per slot, in step with every write and rollback (the runner
tells it), so that `tokens[:length]` always says what is valid: an entry can never hold keys of other tokens.

A released slot stays where it is, with its keys and values, as an *entry* (least recently used first) until a new
sequence needs a slot and no never-used one is left. Entries count as free slots: admission is unchanged, and the
memory is the same preallocated cache (no copy, no growth). A new sequence asks for the longest prefix of its
tokens that any slot of its salt holds, a running sequence's or an entry's: it takes a free slot and the runner
copies that many positions of every layer into it; an entry whose tokens are all in the prefix, or one that has
to be evicted anyway, is taken over in place (no copy). Salts never mix: a request shares cached prefixes only
with requests of the same salt (None is one shared namespace of its own).

Slots are few (tens), so the longest prefix is found by a scan over them; a token-level radix tree or hashed
blocks pay off only with many more candidates. `docs/engine.md` (Prefix caching) has the measurements behind
copying positions rather than sharing blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Reuse:
    """Where a new sequence goes and what it starts with."""

    slot: int  # the free slot it takes
    source: int | None  # the slot whose first `length` positions it starts with (== slot: taken over, no copy)
    length: int  # tokens it starts with: cached, not computed


@dataclass(frozen=True)
class PrefixCacheStats:
    queried_tokens: int = 0  # tokens looked up: every prompt token a cache could have supplied
    hit_tokens: int = 0  # of those, the tokens found (reused, not computed)
    evictions: int = 0  # entries dropped to make room for a new sequence
    entries: int = 0  # released slots kept as cache entries now
    positions: int = 0  # positions those entries hold
    bytes: int = 0  # KV bytes those positions take (set by the runner, which knows the cache's shape)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (compared a block at a time, in C)."""
    n = min(len(a), len(b))
    i = 0
    while i < n:
        j = min(i + 256, n)
        if a[i:j] != b[i:j]:
            while a[i] == b[i]:
                i += 1
            return i
        i = j
    return n


class PrefixIndex:
    """Per slot: the tokens whose keys and values it holds, its salt, and whether it is a running sequence's
    (live) or a cache entry. Bookkeeping only: the runner moves the tensors. `restorable(slot, n)`: whether the
    slot's first n positions can start a sequence (a sliding-window cache's ring may no longer hold the window
    before n: `KVCache.holds_window`); such a prefix is not offered."""

    def __init__(self, num_slots: int, restorable: Callable[[int, int], bool] = lambda slot, n: True) -> None:
        self._restorable = restorable
        self._tokens: list[list[int]] = [[] for _ in range(num_slots)]
        self._salts: list[str | None] = [None] * num_slots
        self._live: set[int] = set()
        self._entries: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._queried = self._hits = self._evictions = 0
        self._entry_positions = 0  # kept as entries come and go: `stats` reads counters only (any thread may ask)

    # -- in step with the cache -------------------------------------------------------------------------------

    def wrote(self, slot: int, start: int, tokens: Sequence[int]) -> None:
        """A forward wrote `tokens` at positions start.. of `slot` (and everything after them is invalid)."""
        held = self._tokens[slot]
        del held[start:]
        held.extend(map(int, tokens))

    def truncated(self, slot: int, length: int) -> None:
        del self._tokens[slot][length:]

    def tokens(self, slot: int) -> list[int]:
        """The tokens `slot` holds (a copy)."""
        return list(self._tokens[slot])

    # -- sequences come and go ----------------------------------------------------------------------------------

    def plan(self, tokens: Sequence[int], salt: str | None, free: Sequence[int]) -> Reuse:
        """Where a new sequence of `salt` that starts with `tokens` goes, and which cached prefix it takes. `free`:
        the cache's free slots (never-used ones and entries), not empty, in the order the cache hands them out."""
        best, length, whole = self._longest(tokens, salt)
        unused = [s for s in free if s not in self._entries]
        lru = next(iter(self._entries), None)
        if best is not None and (whole or (not unused and best == lru)):
            return Reuse(best, best, length)
        slot = unused[-1] if unused else lru
        assert slot is not None  # `free` is not empty: with no entry to take over, a free slot is unused
        return Reuse(slot, best if length else None, length)

    def held(self, tokens: Sequence[int], salt: str | None) -> int:
        """How many leading `tokens` some slot of `salt` holds: what a sequence allocated now would start with. A
        look only: nothing is claimed, and nothing counts as queried."""
        return self._longest(tokens, salt)[1]

    def _longest(self, tokens: Sequence[int], salt: str | None) -> tuple[int | None, int, bool]:
        """The slot of `salt` holding the longest prefix of `tokens`, that length, and whether the slot is an entry
        holding nothing more. Entries first, most recent first, then running slots; among equal prefixes an entry
        that holds nothing more wins (taken over without a copy or a loss)."""
        want = list(tokens)
        best, length, whole = None, 0, False
        for slot in [*reversed(self._entries), *sorted(self._live)]:
            if self._salts[slot] != salt:
                continue
            n = common_prefix(want, self._tokens[slot])
            if n and (n, self._whole_entry(slot, n)) > (length, whole) and self._restorable(slot, n):
                best, length, whole = slot, n, self._whole_entry(slot, n)
        return best, length, whole

    def _whole_entry(self, slot: int | None, length: int) -> bool:
        return slot is not None and slot in self._entries and len(self._tokens[slot]) == length

    def claim(self, reuse: Reuse, salt: str | None, queried: int) -> None:
        """The new sequence took `reuse.slot` (after the runner copied the prefix, if any); `queried` tokens were
        looked up."""
        slot = reuse.slot
        if slot in self._entries:
            del self._entries[slot]
            self._entry_positions -= len(self._tokens[slot])
            if reuse.source != slot:
                self._evictions += 1
        if reuse.source is None:
            self._tokens[slot] = []
        elif reuse.source == slot:
            del self._tokens[slot][reuse.length :]
        else:
            self._tokens[slot] = self._tokens[reuse.source][: reuse.length]
            if reuse.source in self._entries:
                self._entries.move_to_end(reuse.source)  # a hit: recently used
        self._salts[slot] = salt
        self._live.add(slot)
        self._queried += queried
        self._hits += reuse.length

    def spare(self, free: Sequence[int]) -> int:
        """The free slot a fork takes (`fork`): one no entry holds, else the least recently used entry."""
        unused = [s for s in free if s not in self._entries]
        return unused[-1] if unused else next(iter(self._entries))

    def fork(self, source: int, slot: int, length: int) -> None:
        """`slot` now holds the first `length` tokens of the live `source` (a branch of its sequence, the runner
        copied them): live, of the source's salt. Not a lookup: the hit counters are untouched."""
        if slot in self._entries:
            del self._entries[slot]
            self._entry_positions -= len(self._tokens[slot])
            self._evictions += 1
        self._tokens[slot] = self._tokens[source][:length]
        self._salts[slot] = self._salts[source]
        self._live.add(slot)

    def release(self, slot: int) -> None:
        """A sequence ended: its slot becomes the most recent entry (none when it holds nothing). Idempotent."""
        if slot not in self._live:
            return
        self._live.discard(slot)
        if self._tokens[slot]:
            self._entries[slot] = None
            self._entry_positions += len(self._tokens[slot])

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            queried_tokens=self._queried,
            hit_tokens=self._hits,
            evictions=self._evictions,
            entries=len(self._entries),
            positions=self._entry_positions,
        )
