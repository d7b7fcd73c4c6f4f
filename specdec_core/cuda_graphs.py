"""The runner's forwards captured as CUDA graphs: static shapes, in buckets of batch size and width.

Launched from Python, a forward of a small model on a GPU waits on its kernel launches, not on the device; a CUDA
graph replays the whole forward's kernels at once. A graph replays fixed kernels over fixed addresses, so each
captured forward has a static shape: a bucket (B rows, W new tokens each) with preallocated inputs, and a call of
b <= B rows of at most W tokens is padded into the smallest bucket that holds it (`bucket_for`). Batch sizes are
1, 2, 4, ... up to `max_batch` (included); widths are listed (decode 1, verify k + 1, a draft's catch-up).

Why `torch.cuda.CUDAGraph` and not `torch.compile(mode="reduce-overhead")`: the forward writes our own slot KV
cache in place, through index tensors; an explicit capture over static buffers that we own keeps those writes where
we put them, captures each bucket exactly once, and never recompiles for a new shape, where compile's graph trees
would trace and record per shape and manage the inputs' memory themselves.

What a static-shape forward does, and what must stay true (a padding row changes no real row's cache or logits):
- it reads every row's whole slot (`KVCache.capacity` keys) masked by position, and never uses `single` (one row's
  views at Python-int offsets): a graph can take neither the number of keys nor an offset as a Python int;
- within a row, tokens past the row's own are 0, at the next positions: they land past the row's length, where
  nothing reads them before a later forward writes over them (the eager path pads to T the same way);
- padding rows hold token 0 at positions 0 .. W-1 of the cache's scratch slot (`KVCache.scratch_slot`), which no
  sequence is ever given;
- each graph writes the logits of all W positions into one output buffer shared by every bucket; a row's last
  ones are gathered from it by a static index. One graph serves verify (all logits) and decode (the last).

Eager instead, and counted (`GraphCounters`): a call wider than the widest bucket (prefill, a long catch-up), with
more rows than `max_batch`, or with a row whose padded width would run past its slot's capacity.

Refused (`unsupported`): sliding-window layers (Gemma 3: their rings are read and written by position modulo the
ring, with bookkeeping of what each slot still holds, which the static path does not do), sparse mixtures of
experts (their routing reads expert counts back to the host, which a capture cannot), and a draft head cut to part
of the vocabulary (its extra ids change with every call).

Without CUDA nothing is captured: the same static-shape forwards run eagerly (what the CPU tests check), and
`capture` is refused.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from specdec_core.kv_cache import KVCache
from specdec_core.models.transformer import Transformer
from specdec_core.models.vocab_head import VocabHead

# Runs of each bucket before its capture: the first runs choose kernels and allocate workspaces (cuBLAS), which
# must not happen inside a capture.
WARM_UP_RUNS = 2

Bucket = tuple[int, int]  # (B rows, W new tokens per row)


@dataclass(frozen=True)
class GraphConfig:
    """Which forwards are captured: every batch size of `batch_sizes(max_batch)` with every width."""

    max_batch: int  # the most rows of a captured forward
    widths: tuple[int, ...]  # new tokens per row (T) of the captured forwards, ascending: e.g. 1 .. k_max + 1

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        check_widths(self.widths)


def check_widths(widths: Sequence[int]) -> None:
    """Refuse (ValueError) widths that are not positive, ascending and distinct, or none at all."""
    if not widths or min(widths) < 1 or list(widths) != sorted(set(widths)):
        raise ValueError(f"widths must be positive, ascending and distinct, got {list(widths)}")


@dataclass(frozen=True)
class CaptureReport:
    """What capturing every bucket took: for a worker's log."""

    buckets: tuple[Bucket, ...]  # in the order captured
    seconds: float  # warm-ups and captures
    # `torch.cuda.memory_allocated` after, less before: what the warm-ups and captures left allocated (workspaces)
    allocated_bytes: int
    # The same of `torch.cuda.memory_reserved`: what the caching allocator took from the device for them, the
    # graphs' private memory pool included
    reserved_bytes: int
    static_bytes: int  # the static inputs and the shared output buffer, allocated with the runner (in neither above)


@dataclass(frozen=True)
class GraphCounters:
    """Forwards through a bucket, and those run eagerly instead."""

    replays: int = 0  # calls through a bucket: graph replays (on CPU, where nothing is captured, run eagerly)
    eager_prefill: int = 0  # calls wider than the widest bucket: prefill, a long catch-up
    eager_unfit: int = 0  # other calls no bucket takes: more rows than max_batch, a row too near its slot's end


@dataclass(frozen=True)
class Rows:
    """The real rows of one forward: each row's slot, first new position and new tokens."""

    slots: tuple[int, ...]
    starts: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `max_batch`, then `max_batch` itself."""
    sizes = []
    size = 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return (*sizes, max_batch)


def buckets(config: GraphConfig) -> tuple[Bucket, ...]:
    """Every captured (B, W), largest first: the order of capture, so that the smaller graphs fit in the memory
    the larger ones' captures freed in the shared pool."""
    every = [(b, w) for b in batch_sizes(config.max_batch) for w in config.widths]
    return tuple(sorted(every, key=lambda bw: (bw[0] * bw[1], bw), reverse=True))


def bucket_for(batch: int, width: int, config: GraphConfig) -> Bucket | None:
    """The smallest captured (B, W) with B >= batch and W >= width; None where none is that large (the call then
    runs eagerly)."""
    b = next((size for size in batch_sizes(config.max_batch) if size >= batch), None)
    w = next((size for size in config.widths if size >= width), None)
    return None if b is None or w is None else (b, w)


def unsupported(model: Transformer) -> str | None:
    """Why the static-shape forward cannot run `model` (None: it can)."""
    args = model.args
    if args.windowed_layers:
        return "sliding-window layers (Gemma 3): the static-shape forward does not handle their rings"
    if args.moe is not None:
        return "a sparse mixture of experts: its routing reads expert counts back to the host, which a graph cannot"
    if isinstance(model.lm_head, VocabHead):
        return "an LM head cut to part of the vocabulary (draft.vocabulary): its extra ids change with every call"
    return None


def pack(rows: Rows, bucket: Bucket, scratch: int) -> torch.Tensor:  # [2*B*W + 2*B] int64
    """The static inputs of `bucket` for `rows`, in one tensor (one copy to the device per call): tokens [B, W],
    positions [B, W], slots [B], and each row's last real index [B]; padded as the module docstring says."""
    B, W = bucket
    pad = B - len(rows.slots)
    tokens = [t for row in rows.tokens for t in (*row, *[0] * (W - len(row)))] + [0] * (pad * W)
    starts = [*rows.starts, *[0] * pad]  # a padding row at positions 0 .. W-1 of the scratch slot
    positions = [start + i for start in starts for i in range(W)]
    slots = [*rows.slots, *[scratch] * pad]
    last = [len(row) - 1 for row in rows.tokens] + [0] * pad
    return torch.tensor(tokens + positions + slots + last, dtype=torch.long)


class StaticInputs:
    """One bucket's preallocated inputs: views of one buffer, which a call fills with one copy."""

    def __init__(self, bucket: Bucket, device: torch.device) -> None:
        B, W = bucket
        n = B * W
        self.bucket = bucket
        self.buffer = torch.zeros(2 * n + 2 * B, dtype=torch.long, device=device)  # laid out as `pack` makes it
        self.tokens = self.buffer[:n].view(B, W)  # [B, W]
        self.positions = self.buffer[n : 2 * n].view(B, W)  # [B, W]
        self.slots = self.buffer[2 * n : 2 * n + B]  # [B]
        self.last = self.buffer[2 * n + B :].view(B, 1, 1)  # [B, 1, 1]


class GraphedForwards:
    """A model's static-shape forwards over a cache with a scratch slot: captured as CUDA graphs by `capture`,
    else run eagerly. `run` writes the cache as the eager forward does; lengths stay the caller's."""

    def __init__(self, model: Transformer, cache: KVCache, config: GraphConfig) -> None:
        if cache.scratch_slot is None:
            raise ValueError("static-shape forwards need a cache with a scratch slot (KVCache(scratch=True))")
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"cuda_graphs: not for a model with {why}")
        self.model, self.cache, self.config = model, cache, config
        self.scratch = cache.scratch_slot
        device = cache.keys[0].device
        self.device = device
        self.inputs = {bucket: StaticInputs(bucket, device) for bucket in buckets(config)}
        # Every bucket's logits land in the corner of this one buffer: no graph keeps an output of its own alive.
        shape = (config.max_batch, config.widths[-1], model.vocab_size)
        self.logits = torch.zeros(shape, dtype=torch.float32, device=device)  # [max B, max W, V]
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.counters = GraphCounters()

    def run(
        self, rows: Rows, all_logits: bool, device_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int] | None:
        """Logits of `rows` through their bucket, [b, T, V] when `all_logits` else [b, 1, V] (each row's last
        ones; fresh tensors, not the static buffer), and the width every row wrote (its bucket's W); None where no
        bucket takes them (counted: the caller runs them eagerly). Mutates the cache's keys/values only.
        `device_tokens` [b] (rows of one token each): the tokens, already on the device, in place of `rows.tokens`
        (copied device to device: the host never waits for them)."""
        b, T = len(rows.slots), max(len(t) for t in rows.tokens)
        bucket = bucket_for(b, T, self.config)
        if bucket is None or max(rows.starts) + bucket[1] > self.cache.capacity:
            wide = T > self.config.widths[-1]
            self.counters = replace(
                self.counters,
                eager_prefill=self.counters.eager_prefill + int(wide),
                eager_unfit=self.counters.eager_unfit + int(not wide),
            )
            return None
        inputs = self.inputs[bucket]
        inputs.buffer.copy_(pack(rows, bucket, self.scratch))
        if device_tokens is not None:
            inputs.tokens[:b, 0].copy_(device_tokens)
        graph = self.graphs.get(bucket)
        if graph is None:
            self._forward(inputs)
        else:
            graph.replay()
        self.counters = replace(self.counters, replays=self.counters.replays + 1)
        W = bucket[1]
        if all_logits:
            return self.logits[:b, :T].clone(), W  # [b, T, V]: the next call overwrites the buffer
        index = inputs.last[:b].expand(-1, -1, self.logits.shape[-1])  # [b, 1, V]
        return self.logits[:b, :W].gather(1, index), W  # [b, 1, V]

    def _forward(self, inputs: StaticInputs) -> None:
        """The static-shape forward of one bucket: what a graph captures."""
        B, W = inputs.bucket
        logits = self.model(inputs.tokens, inputs.positions, self.cache, inputs.slots, self.cache.capacity)
        self.logits[:B, :W].copy_(logits)  # [B, W, V]

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Capture every bucket as a CUDA graph (again, if captured before), largest first, into one memory pool.
        Every row of a capture is a padding row: it writes only the scratch slot. Refused without CUDA."""
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device: this model and cache are on {self.device.type}")
        self.graphs = {}
        torch.cuda.synchronize(self.device)
        allocated, reserved = torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
        start = time.perf_counter()
        # One pool for every graph: their intermediates share memory, which is safe in any order of replays since
        # what outlives a replay (the cache, the inputs, `self.logits`) lies outside the pool.
        pool = torch.cuda.graph_pool_handle()
        for bucket, inputs in self.inputs.items():  # largest first (`buckets`)
            inputs.buffer.copy_(pack(Rows((), (), ()), bucket, self.scratch))
            self._warm_up(inputs)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(inputs)
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        return CaptureReport(
            buckets=tuple(self.inputs),
            seconds=time.perf_counter() - start,
            allocated_bytes=torch.cuda.memory_allocated(self.device) - allocated,
            reserved_bytes=torch.cuda.memory_reserved(self.device) - reserved,
            static_bytes=self.static_bytes,
        )

    @property
    def static_bytes(self) -> int:
        """Bytes of the static inputs of every bucket and of the shared output buffer."""
        tensors = [inputs.buffer for inputs in self.inputs.values()] + [self.logits]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _warm_up(self, inputs: StaticInputs) -> None:
        # On a side stream, as torch's capture asks: the warm-up's allocations stay out of the capturing stream.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARM_UP_RUNS):
                self._forward(inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
