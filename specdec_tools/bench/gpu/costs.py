"""Part 4, costs through the engine's own runner (`ModelRunner` with `RunnerConfig.cuda_graphs`, captured as CUDA
graphs when it is made on CUDA; on a CPU the same static-shape forwards run eagerly), on random weights of real
models' shapes (`shapes.py`): per pair, the target's forward at each captured width and batch bucket after a context
(w = 1 is the plain step, w = k + 1 a verify), the draft's step, a speculative round and a plain step through the
engine at batch 1 (`rounds.py`), and what capturing took.

Each forward is set against the device's read limit: the bytes it must read (the weights once, each row's keys and
values over the context) at the bandwidth a large copy within the device reaches (`device.copy_bandwidth`). A
captured forward reads every key of its rows' slots, masked, where an eager one reads up to its longest row: the
slots here hold the context and two widths more, so that the two read nearly alike.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from specdec_core.cuda_graphs import GraphConfig
from specdec_core.runner import RunnerConfig
from specdec_tools.bench.gpu.device import sync
from specdec_tools.bench.gpu.engines import K
from specdec_tools.bench.gpu.rounds import WARM_UP_STEPS, Forward, LoggingRunner, Window, round_windows
from specdec_tools.bench.gpu.shapes import (
    Pair,
    forward_bytes,
    kv_bytes_per_position,
    random_model,
    read_limit_ms,
    weight_bytes_read,
)

WARM_UP_CALLS = 2


@dataclass(frozen=True)
class Sizes:
    """How much the costs part measures: --quick shrinks it to run on a CPU in seconds."""

    context: int  # tokens cached before each forward (and the engine's prompt)
    batches: tuple[int, ...]  # the batch buckets: 1, 2, 4, ... (`cuda_graphs.batch_sizes`)
    widths: tuple[int, ...]  # the captured widths; K + 1 among them
    repeats: int  # timed calls per figure (medians)
    rounds: int  # engine rounds timed, at least: each request is long enough for them at K + 1 tokens a round
    copy_bytes: int  # the bandwidth copy's size

    @property
    def new_tokens(self) -> int:
        """Tokens of each engine request timed."""
        return (WARM_UP_STEPS + self.rounds) * (K + 1)

    @property
    def prompt_tokens(self) -> int:
        """Each engine request's prompt: its tokens end at about the context the forwards are measured after."""
        return max(16, self.context - self.new_tokens)


FULL = Sizes(context=600, batches=(1, 2, 4, 8), widths=(1, 2, 3, 5, 9, 17), repeats=20, rounds=40, copy_bytes=1 << 30)
QUICK = Sizes(context=64, batches=(1, 2), widths=(1, 2, K + 1), repeats=5, rounds=20, copy_bytes=1 << 26)


@dataclass(frozen=True)
class Cost:
    """One forward's median time against its read limit."""

    role: str  # "target" or "draft"
    batch: int
    width: int
    ms: float
    bytes_read: int
    limit_ms: float

    @property
    def ratio(self) -> float:
        return self.ms / self.limit_ms


@dataclass(frozen=True)
class PairCosts:
    """Everything measured of one pair."""

    pair: Pair
    dtype: str
    context: int
    weight_bytes: dict[str, int]  # per role: what a forward reads of its weights
    bandwidth: float  # bytes/s
    forwards: tuple[Cost, ...]
    captures: dict[str, dict[str, Any] | None]  # per role: its `CaptureReport` (None: nothing captured, not CUDA)
    windows: dict[str, Window]  # "speculative" rounds and "plain" steps through the engine at batch 1
    counters: dict[str, dict[str, int]]  # per role: its runner's `GraphCounters` at the end (replays, eager calls)

    def get(self, role: str, batch: int, width: int) -> Cost | None:
        return next((c for c in self.forwards if (c.role, c.batch, c.width) == (role, batch, width)), None)

    def json(self) -> dict[str, Any]:
        return {
            "target": self.pair.target_name,
            "draft": self.pair.draft_name,
            "shapes": {"target": dict(self.pair.target), "draft": dict(self.pair.draft)},
            "dtype": self.dtype,
            "context": self.context,
            "weight_bytes": self.weight_bytes,
            "forwards": [asdict(c) | {"ratio": c.ratio} for c in self.forwards],
            "captures": self.captures,
            "rounds": {name: window.json() for name, window in self.windows.items()},
            "graph_counters": self.counters,
            "k": K,
        }


def runner_config(sizes: Sizes) -> RunnerConfig:
    """Slots for the largest batch, each holding the context (or an engine request) and two widths more: a captured
    forward reads the whole slot."""
    widest = max(sizes.widths)
    return RunnerConfig(
        num_slots=max(sizes.batches),
        max_seq_len=max(sizes.context, sizes.prompt_tokens + sizes.new_tokens) + 2 * widest,
        max_extend=max(16, widest),
        cuda_graphs=GraphConfig(max_batch=max(sizes.batches), widths=sizes.widths),
    )


def prompt(vocab: int, n: int) -> list[int]:
    """`n` random token ids, seeded, away from the special ids at either end."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(10, min(30000, vocab - 1), (n,), generator=gen).tolist()


def forward_ms(runner: LoggingRunner, slots: list[int], width: int, context: int, repeats: int) -> float:
    """Median ms of one forward of `width` new tokens in each of `slots` after `context` cached (all logits when
    width > 1, as a verify needs), each rolled back after (a length moved: not timed)."""
    tokens = [[11] * width for _ in slots]
    times = []
    for i in range(WARM_UP_CALLS + repeats):
        sync(runner.device)
        t0 = time.perf_counter()
        runner.extend(slots, tokens, all_logits=width > 1)
        sync(runner.device)
        if i >= WARM_UP_CALLS:
            times.append(time.perf_counter() - t0)
        for slot in slots:
            runner.truncate(slot, context)
    return 1000 * statistics.median(times)


def measure(runner: LoggingRunner, grid: list[tuple[int, int]], sizes: Sizes, bandwidth: float) -> list[Cost]:
    """The forwards of `grid` (batch, width), each against its read limit, over slots holding the context."""
    slots = [runner.allocate() for _ in range(max(b for b, _ in grid))]
    runner.extend(slots, [prompt(runner.vocab_size, sizes.context)] * len(slots))  # eager: wider than any bucket
    weights, kv = weight_bytes_read(runner.model), kv_bytes_per_position(runner.model)
    out = []
    for batch, width in grid:
        ms = forward_ms(runner, slots[:batch], width, sizes.context, sizes.repeats)
        nbytes = forward_bytes(weights, kv, batch, sizes.context + width)
        out.append(Cost(runner.role, batch, width, ms, nbytes, read_limit_ms(nbytes, bandwidth)))
    for slot in slots:
        runner.release(slot)
    return out


def pair_costs(pair: Pair, sizes: Sizes, dtype: torch.dtype, bandwidth: float, device: torch.device) -> PairCosts:
    """One pair: both models built on the device, their runners made (captured on CUDA), every forward measured,
    then the engine's rounds over the same runners."""
    config, log = runner_config(sizes), []
    target = LoggingRunner(random_model(pair.target, device, dtype, seed=1), config, "target", log)
    draft = LoggingRunner(random_model(pair.draft, device, dtype, seed=2), config, "draft", log)
    grids = {
        "target": [(b, w) for b in sizes.batches for w in sizes.widths],
        "draft": [(1, w) for w in sizes.widths] + [(b, 1) for b in sizes.batches[1:]],
    }
    forwards = [c for runner in (target, draft) for c in measure(runner, grids[runner.role], sizes, bandwidth)]
    prices = {(c.role, c.batch, c.width): c.ms for c in forwards}

    def price(forward: Forward) -> float | None:
        return None if forward.bucket is None else prices.get((forward.role, *forward.bucket))

    start = prompt(target.vocab_size, sizes.prompt_tokens)
    windows = round_windows(target, draft, start, sizes.new_tokens, price, device)
    return PairCosts(
        pair=pair,
        dtype=str(dtype).removeprefix("torch."),
        context=sizes.context,
        weight_bytes={r.role: weight_bytes_read(r.model) for r in (target, draft)},
        bandwidth=bandwidth,
        forwards=tuple(forwards),
        captures={r.role: None if r.capture_report is None else asdict(r.capture_report) for r in (target, draft)},
        windows=windows,
        counters={r.role: asdict(r.graph_counters()) for r in (target, draft)},
    )


def release(device: torch.device) -> None:
    """Give the last pair's memory back before the next is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
