"""Cache-aware placement: which replica most likely holds a new sequence's prompt prefix in its prefix cache.

The router cannot see the workers' caches; it remembers what it sent where. For each replica it keeps the
prompts of the sequences it recently placed there (per cache salt, least recently placed dropped first), and a
new sequence goes to the replica with the longest remembered common prefix, unless that replica is full or
much busier than the least loaded one (SGLang's cache-aware router balances the same two forces). The memory is
approximate by design: a worker may have evicted the entry; then the placement costs one prefill, as any other.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_PROMPTS_PER_REPLICA = 256  # remembered prompts per replica (about the sequences its cache can hold)
MIN_MATCH_TOKENS = 16  # a shorter common prefix saves too little prefill to outweigh balance
MAX_EXTRA_LOAD = 2  # a prefix match may send a sequence to a replica this many sessions busier than the least


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass(frozen=True)
class Candidate:
    address: str
    load: int  # this router's sessions on the replica
    has_room: bool  # fewer sessions than slots


class PrefixAffinity:
    """Per replica, the prompts recently placed there; thread-safety is the caller's (ReplicaPool's lock)."""

    def __init__(self, max_prompts: int = MAX_PROMPTS_PER_REPLICA) -> None:
        self.max_prompts = max_prompts
        self._prompts: dict[str, OrderedDict[tuple[str, int], np.ndarray]] = {}
        self._serial = 0

    def record(self, address: str, salt: str | None, token_ids: Sequence[int]) -> None:
        """`token_ids` were placed on `address` (the sequence's cache will hold them, and its output after)."""
        if not token_ids:
            return
        self._serial += 1
        prompts = self._prompts.setdefault(address, OrderedDict())
        prompts[(salt or "", self._serial)] = np.asarray(token_ids, dtype=np.int64)
        while len(prompts) > self.max_prompts:
            prompts.popitem(last=False)

    def match(self, address: str, salt: str | None, token_ids: Sequence[int]) -> int:
        """The longest common prefix of `token_ids` with a prompt remembered on `address` under the same salt."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        best = 0
        for (entry_salt, _), prompt in self._prompts.get(address, {}).items():
            if entry_salt == (salt or ""):
                best = max(best, common_prefix(tokens, prompt))
        return best

    def forget(self, address: str) -> None:
        """The replica is gone: what it held is gone with it."""
        self._prompts.pop(address, None)

    def choose(self, candidates: Sequence[Candidate], salt: str | None, token_ids: Sequence[int]) -> str | None:
        """The replica to prefer for `token_ids`: the longest match among replicas with room and not much busier
        than the least loaded; None when no match is long enough (the caller balances load alone)."""
        if not token_ids or not candidates:
            return None
        least = min(c.load for c in candidates)
        best, best_match = None, MIN_MATCH_TOKENS - 1
        for c in candidates:
            if not c.has_room or c.load > least + MAX_EXTRA_LOAD:
                continue
            matched = self.match(c.address, salt, token_ids)
            if matched > best_match or (matched == best_match and best is not None and c.load < best.load):
                best, best_match = c, matched
        return None if best is None else best.address
