"""A draft model on cores of its own, in one process: what `specdec bench methods --draft-cores` runs the draft on.

A separate draft device (a GPU, a node, a worker pinned apart with `cpu_affinity`) computes while the target does.
In one process that is two threads pinned to disjoint cores: the engine's thread (the target's forwards) on the
target's cores, and one thread that makes every call of the draft model on the draft's. The engine calls the
drafter as it calls a remote one; each call is handed to the draft's thread and waited for, so that sequential
rounds keep the draft off the target's cores too, and pre-drafting (`draft.overlap`) runs the draft's forwards
there while the target verifies.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from deployments.compute_thread import ComputeThread
from specdec_core.drafters.base import Drafter, DraftRequest, Proposal


def pin_this_thread(cores: Sequence[int]) -> None:
    """The calling thread, and the threads it starts from now on, run on `cores` only."""
    os.sched_setaffinity(0, set(cores))


class PinnedDrafter:
    """`drafter`, every call of it made on a thread of its own pinned to `cores`."""

    def __init__(self, drafter: Drafter, cores: Sequence[int]) -> None:
        self.inner = drafter
        self.name = drafter.name
        self._thread = ComputeThread(f"draft-on-{','.join(map(str, cores))}")
        self._thread.run(pin_this_thread, cores)

    def start(self, seq_id: str, prompt_ids: Sequence[int], cache_salt: str | None = None) -> int:
        return self._thread.run(self.inner.start, seq_id, prompt_ids, cache_salt)

    def start_many(self, starts: Sequence[tuple[str, Sequence[int], str | None]]) -> list[int]:
        start_many = getattr(self.inner, "start_many", None)
        if start_many is None:
            return [self.start(*one) for one in starts]
        return self._thread.run(start_many, starts)

    def cached(self, seq_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        return self._thread.run(self.inner.cached, seq_id, token_ids, cache_salt)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        return self._thread.run(self.inner.propose, requests)

    def observe(self, seq_id: str, num_committed: int) -> None:
        self._thread.run(self.inner.observe, seq_id, num_committed)

    def release(self, seq_id: str) -> None:
        self._thread.run(self.inner.release, seq_id)

    def __getattr__(self, name: str) -> Any:  # what else the engine or a report reads of the drafter
        return getattr(self.inner, name)
