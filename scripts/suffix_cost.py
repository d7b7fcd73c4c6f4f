"""The cost of SuffixDecoding's `propose` per round, and the global structure's memory, on synthetic token streams.

A batch of B running requests, each with a context of C tokens, drafts k tokens against a global structure
holding R ended requests of C tokens each (prompts indexed). The text is code-like: spans copied, with edits, from
a pool of snippets, so matches of every length occur. Prints one line per configuration.

    PYTHONPATH=. python scripts/suffix_cost.py
"""

from __future__ import annotations

import random
import time
import tracemalloc

from specdec_core.config import TokenShaping
from specdec_core.drafters.base import DraftRequest
from specdec_core.drafters.suffix import SuffixDrafter


def _text(rng: random.Random, pool: list[list[int]], n: int) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        span = rng.choice(pool)
        start = rng.randrange(len(span))
        out += span[start : start + rng.randint(4, 40)]
        out += [rng.randrange(32000) for _ in range(rng.randint(0, 6))]  # an edit
    return out[:n]


def main() -> None:
    rng = random.Random(0)
    pool = [[rng.randrange(32000) for _ in range(200)] for _ in range(50)]
    for batch, context, ended in [(8, 1024, 256), (32, 1024, 256), (32, 4096, 256)]:
        tracemalloc.start()
        drafter = SuffixDrafter()  # the defaults: depth 32, 256 requests kept
        for i in range(ended):
            drafter.start(f"old{i}", _text(rng, pool, context))
            drafter.release(f"old{i}")
        memory = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        seqs, truth = [], []
        for i in range(batch):
            full = _text(rng, pool, context + 400)  # what the target would write: the context, then 400 more
            tokens, _ = full[:context], truth.append(full)
            t0 = time.perf_counter()
            drafter.start(f"s{i}", tokens)
            start_s = time.perf_counter() - t0
            seqs.append(tokens)
        rounds, total, proposed = 50, 0.0, 0
        for _ in range(rounds):  # at most 50 x 9 tokens: within the 400 the target has
            requests = [DraftRequest(f"s{i}", seqs[i], 8, TokenShaping(), None) for i in range(batch)]
            t0 = time.perf_counter()
            proposals = drafter.propose(requests)
            total += time.perf_counter() - t0
            proposed += sum(len(p.token_ids) for p in proposals)
            for i, p in enumerate(proposals):  # commit the proposal's right prefix and the target's next token
                at, n = len(seqs[i]), 0
                while n < len(p.token_ids) and p.token_ids[n] == truth[i][at + n]:
                    n += 1
                seqs[i] += truth[i][at : at + n + 1]
        t0 = time.perf_counter()
        for i in range(batch):
            drafter.release(f"s{i}")
        release = (time.perf_counter() - t0) / batch
        print(f"B={batch} context={context} global={ended}x{context} tokens: propose {1e3 * total / rounds:.2f} ms/round "
              f"({1e6 * total / rounds / batch:.0f} us/request), {proposed / rounds / batch:.1f} tokens proposed/request; "
              f"start {1e3 * start_s:.1f} ms/request; release (into the global structure) {1e3 * release:.1f} ms/request; "
              f"global structure {memory / 2**20:.0f} MiB ({memory / (ended * context):.0f} B/token)")


if __name__ == "__main__":
    main()
