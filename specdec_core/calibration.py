"""Measuring what rounds cost before serving, so that `auto` starts from measured costs instead of exploring.

`auto` picks k from the seconds that draft calls and verify forwards take at the current batch size
(`adaptive.CostModel`). A batch size it has not measured is explored: its first rounds try k = 1 .. explore_up_to
a few times each. Under load that exploration is dear, and it falls on real requests: every row of the batch pays
a draft start and wider verifies. The first wave of concurrent requests then spends its early rounds exploring at a
batch size where speculation may not pay, and runs slower than the waves that follow it.

Calibration runs those rounds before any request arrives, on synthetic sequences and through the engine's own
round code: at batch sizes 1, 2, 4, ... up to the target's free slots, plain rounds and then rounds at each
k = 1 .. explore_up_to, `samples` times each. The costs it records are the ones traffic would teach (gRPC
included when the workers are remote), and live rounds keep refining them. The sequences are cancelled at the
end, freeing their caches; the acceptance the rounds saw is forgotten (synthetic text says nothing about real
requests' acceptance). Each sequence has a prefix-cache salt of its own: its starts read their whole context, as
a new request's would, and no request ever shares its synthetic text (the entries it leaves are evicted first).
"""

from __future__ import annotations

import copy
import logging
import time
import uuid
from dataclasses import dataclass, replace

from specdec_core.config import SamplingParams
from specdec_core.engine import SpecEngine
from specdec_core.request import Request

log = logging.getLogger(__name__)

# Ordinary code, tokenized by the target's tokenizer: any text would do, this one drafts like real traffic.
TEXT = '''def moving_average(values: list[float], window: int) -> list[float]:
    """Averages of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total, out = 0.0, []
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i + 1 >= window:
            out.append(total / window)
    return out
'''


@dataclass(frozen=True)
class Calibration:
    batch_sizes: tuple[int, ...]  # measured, in order
    rounds: int  # rounds run in all
    seconds: float


def batch_sizes(largest: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to `largest`, and `largest` itself: one size in each of the cost model's buckets."""
    sizes: list[int] = []
    while largest > 0 and (not sizes or sizes[-1] < largest):
        sizes.append(min(2 * sizes[-1], largest) if sizes else 1)
    return tuple(sizes)


def calibrate(
    engine: SpecEngine, max_batch: int | None = None, context: int = 64, samples: int | None = None
) -> Calibration:
    """Run calibration rounds on `engine` (idle: no request queued or running) and leave their costs in
    `engine.costs`. `context`: prompt tokens per synthetic sequence; `samples`: rounds per (batch size, k),
    by default the policy's `explore_samples`."""
    if engine.has_work:
        raise RuntimeError("calibrate an idle engine: its rounds would be shared with requests")
    policy = engine.config.policy
    up_to = policy.explore_k if engine.drafter is not None else 0  # what `auto` would explore
    samples = policy.explore_samples if samples is None else samples
    free = engine.target.free_slots
    sizes = batch_sizes(free if max_batch is None else min(free, max_batch))
    # The first sequence takes part in every round (samples per k, and the admission step, per size); it must
    # still be running after the last, so its room exceeds what those rounds can commit (its prefill token too).
    rounds_each = len(sizes) * ((up_to + 1) * samples + 1)
    prompt, params = _synthetic_request(engine, context, max_tokens=rounds_each * (up_to + 1) + 2)
    saved = copy.deepcopy(engine.acceptance), copy.deepcopy(engine.acceptance_by_label)
    config = engine.config
    engine.config = replace(config, plain_runs=False)  # a round at a time, each one measured
    tag, start = uuid.uuid4().hex[:8], time.perf_counter()
    ids: list[str] = []
    done: list[int] = []
    try:
        for size in sizes:
            while len(ids) < size:
                ids.append(f"calibration-{tag}-{len(ids)}")
                # A salt of its own: with prefix caching, every start reads its whole context, as a new one would.
                # Only the draft model (`engine.drafter`) is calibrated: a hybrid's free proposals cost no draft call.
                method = engine.drafter.name if engine.drafter is not None else None
                engine.add_request(Request(ids[-1], tuple(prompt), params, 0, method, cache_salt=ids[-1]))
            engine.step()  # prefills the new sequences (and runs a round for the others)
            if not _measure(engine, ids, up_to, samples):
                log.warning("calibration stopped at batch size %d: a sequence ended", size)
                break
            done.append(size)
    finally:
        for seq_id in ids:
            engine.abort(seq_id)
        engine.acceptance, engine.acceptance_by_label = saved
        engine.config = config
    return Calibration(tuple(done), len(done) * (up_to + 1) * samples, time.perf_counter() - start)


def _measure(engine: SpecEngine, ids: list[str], up_to: int, samples: int) -> bool:
    """`samples` rounds of the sequences `ids` at each k = 0..up_to. False where a sequence ended (out of room, or
    a failed round): the batch size would then go unmeasured."""
    for k in range(up_to + 1):
        if engine.num_running < len(ids) or not all(engine.set_speculation(i, k) for i in ids):
            return False
        for _ in range(samples):
            engine.step()
    return engine.num_running == len(ids)


def _synthetic_request(engine: SpecEngine, context: int, max_tokens: int) -> tuple[list[int], SamplingParams]:
    """`context` tokens of code (repeated as needed; fewer where the context window is small) and greedy params
    that never stop early, with room for `max_tokens` (as much as the window holds)."""
    vocab = engine.target.vocab_size
    ids = [t for t in engine.tokenizer.encode(TEXT) if 0 <= t < vocab] or list(range(1, min(vocab, 64)))
    limit = engine.target.max_seq_len
    context = max(1, min(context, limit // 4))
    prompt = (ids * (context // len(ids) + 1))[:context]
    return prompt, SamplingParams(temperature=0.0, max_tokens=max(1, min(max_tokens, limit - context)), ignore_eos=True)
