"""Several drafters behind one engine, a sequence each: the A/B test of draft variants.

Each sequence is assigned one variant for its whole life (`assign`, before the engine sees it) and every call about
it goes to that variant's drafter. One round's rows are grouped by variant and each group proposes in its own call;
the calls of a round run at once (a draft worker's call is mostly waiting on its replica), so a round costs the
slowest variant's call, as with one drafter. The target verifies every row in the one pass, whichever variant
proposed it: each row's q is its own drafter's, so acceptance stays exact per row.

The engine prices drafting with one cost model: variants of one size (a draft and its fine-tuned successor, the
usual A/B) cost alike; variants of different sizes share an average, which only moves `auto`'s choice of k.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from specdec_core.drafters.base import Drafter, DraftRequest, Proposal


class VariantDrafter:
    """A `Drafter` over named variants. Sequences never assigned go to `default`."""

    def __init__(self, drafters: Mapping[str, Drafter], default: str, name: str | None = None) -> None:
        if default not in drafters:
            raise ValueError(f"default: no variant named {default!r}")
        self.drafters = dict(drafters)
        self.default = default
        # What a request's `speculation_method` names: the default variant's method, unless told.
        self.name = name or self.drafters[default].name
        self._assigned: dict[str, str] = {}
        self._lock = threading.Lock()  # assign / forget come from the router's event loop, the rest from the engine
        self._pool = ThreadPoolExecutor(max_workers=len(self.drafters), thread_name_prefix="variant-draft")

    # -- assignment (the router) ----------------------------------------------------------------------------------

    def assign(self, seq_id: str, variant: str) -> None:
        if variant not in self.drafters:
            raise KeyError(variant)
        with self._lock:
            self._assigned[seq_id] = variant

    def variant_of(self, seq_id: str) -> str:
        with self._lock:
            return self._assigned.get(seq_id, self.default)

    def forget(self, seq_id: str) -> None:
        """The request ended: drop its assignment (its drafter's state is freed by `release`). Idempotent."""
        with self._lock:
            self._assigned.pop(seq_id, None)

    # -- Drafter --------------------------------------------------------------------------------------------------

    def _drafter(self, seq_id: str) -> Drafter:
        return self.drafters[self.variant_of(seq_id)]

    def start(self, seq_id: str, prompt_ids: Sequence[int], cache_salt: str | None = None) -> int:
        return self._drafter(seq_id).start(seq_id, prompt_ids, cache_salt)

    def cached(self, seq_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        return self._drafter(seq_id).cached(seq_id, token_ids, cache_salt)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(self.variant_of(request.seq_id), []).append(i)
        calls = {name: [requests[i] for i in rows] for name, rows in groups.items()}
        if len(calls) == 1:
            ((name, batch),) = calls.items()
            answers = {name: self.drafters[name].propose(batch)}
        else:
            futures = {name: self._pool.submit(self.drafters[name].propose, batch) for name, batch in calls.items()}
            answers = {name: future.result() for name, future in futures.items()}  # the first failure raises
        proposals: list[Proposal | None] = [None] * len(requests)
        for name, rows in groups.items():
            method = self.drafters[name].name
            for i, proposal in zip(rows, answers[name]):
                proposals[i] = proposal if proposal.method else replace(proposal, method=method)
        return proposals  # type: ignore[return-value]  # every row was in one group

    def observe(self, seq_id: str, num_committed: int) -> None:
        self._drafter(seq_id).observe(seq_id, num_committed)

    def release(self, seq_id: str) -> None:
        self._drafter(seq_id).release(seq_id)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
