"""The model runner: one model, its KV cache, and batched forwards over sequences of different lengths.

The runner's contract is small. `extend(slots, token_lists)` appends each row's tokens to its slot (writing
their keys/values at the next positions) and returns logits; `truncate(slot, n)` rolls a slot back to its first
`n` tokens. Prefill, decode and verify are all `extend` with different token counts and logit selections:

- prefill: the prompt, logits of its last position (the distribution of the first new token);
- decode:  one token, its logits;
- verify:  the last committed token plus k draft tokens, logits at all k+1 positions.

With prefix caching (`RunnerConfig.prefix_caching`), `allocate(reuse, salt)` starts a slot with the longest prefix
of `reuse` cached for `salt` (`prefix_cache.py`), and `release` keeps the slot's contents as a cache entry.

With CUDA graphs (`RunnerConfig.cuda_graphs`, `cuda_graphs.py`), calls that fit a bucket run as static-shape forwards:
replayed graphs on CUDA (captured when the runner is built), the same forwards run eagerly elsewhere; other calls
run eagerly as before. The cache holds one scratch slot more, for the padding rows, counted in the KV budget.
Models the static forward cannot run (sliding-window rings, mixtures of experts, a cut head) are refused, not
quietly run eagerly: a config that asks for graphs gets them or an error.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from specdec_core.cuda_graphs import CaptureReport, GraphConfig, GraphCounters, GraphedForwards, Rows
from specdec_core.errors import ResourceExhausted
from specdec_core.kv_cache import KVCache, Ring, slot_bytes
from specdec_core.models.transformer import ModelArgs, Transformer
from specdec_core.prefix_cache import PrefixCacheStats, PrefixIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerConfig:
    num_slots: int = 8  # concurrent sequences held in the cache
    max_seq_len: int = 2048  # tokens per sequence (prompt + output); capped by the model's positions
    max_extend: int = 16  # most tokens one forward may append to a row outside prefill (k + 1)
    # A KV cache budget: fewer slots than num_slots when that many would not fit. The cache is allocated whole
    # at start, so memory never grows with traffic: requests wait for a free slot instead.
    max_cache_bytes: int | None = None
    # Keep released slots as prefix-cache entries, and start new sequences from the longest cached prefix of their
    # tokens (`prefix_cache.py`). Off here, so that an in-process engine (benchmarks) computes every prompt; the
    # service turns it on (`prefix_caching` in its config, on by default).
    prefix_caching: bool = False
    # Capture forwards of these batch sizes and widths as CUDA graphs (`cuda_graphs.py`); None: every forward eager.
    cuda_graphs: GraphConfig | None = None


def slots_within_budget(
    config: RunnerConfig,
    num_layers: int,
    num_kv_heads: int,
    capacity: int,
    head_dim: int,
    dtype: torch.dtype,
    ring: Ring | None = None,
) -> int:
    """`config.num_slots`, or as many as `config.max_cache_bytes` holds besides the scratch slot CUDA graphs need;
    a budget too small for one is refused."""
    if config.max_cache_bytes is None:
        return config.num_slots
    per_slot = slot_bytes(num_layers, num_kv_heads, capacity, head_dim, dtype, ring)  # keys and values
    scratch = int(config.cuda_graphs is not None)
    fits = config.max_cache_bytes // per_slot - scratch
    if fits < 1:
        raise ResourceExhausted(
            "kv_cache_max_bytes",
            f"{config.max_cache_bytes} bytes hold no sequence: one slot of {capacity} positions needs {per_slot} bytes"
            + (" (and CUDA graphs one more, for padding rows)" if scratch else ""),
        )
    return min(config.num_slots, fits)


def window_ring(args: ModelArgs, capacity: int, max_extend: int) -> Ring | None:
    """The ring of a model's sliding-window layers (None without): the W - 1 positions a next query reads, plus
    2 * max_extend + 1 of slack for what is written past a length and rolled back (a verify's rejected drafts; a
    draft's assumed tokens and its drafts past them, each at most max_extend; a padded row's padding). Never more
    than the capacity: a ring that large is the full layout."""
    if args.sliding_window is None or not args.windowed_layers:
        return None
    size = min(args.sliding_window + 2 * max_extend, capacity)
    return Ring(frozenset(args.windowed_layers), min(args.sliding_window, size), size)


class ModelRunner:
    """Owns a `Transformer` and its `KVCache`; every public method works on a batch of slots."""

    def __init__(self, model: Transformer, config: RunnerConfig = RunnerConfig()) -> None:
        self.model = model
        self.config = config
        args = model.args
        self.max_seq_len = min(config.max_seq_len, args.max_position_embeddings)
        param = next(model.parameters())
        self.device = param.device
        attn = model.layers[0].self_attn
        capacity = self.max_seq_len + config.max_extend
        ring = window_ring(args, capacity, config.max_extend)
        num_slots = slots_within_budget(
            config, args.num_layers, attn.num_kv_heads, capacity, args.head_dim, param.dtype, ring
        )
        # Padded rows of a batch write a few positions past their own end: the slack keeps those writes
        # inside the slot. They are beyond the row's length, so never read.
        self.cache = KVCache(
            num_layers=args.num_layers,
            num_slots=num_slots,
            num_kv_heads=attn.num_kv_heads,
            capacity=capacity,
            head_dim=args.head_dim,
            dtype=param.dtype,
            device=self.device,
            ring=ring,
            scratch=config.cuda_graphs is not None,
        )
        self.prefix = PrefixIndex(num_slots, self.cache.holds_window) if config.prefix_caching else None
        self.computed_tokens = 0  # positions written by forwards: what the model computed, cache hits excluded
        self.graphs = None if config.cuda_graphs is None else self._graphs(config.cuda_graphs)
        self.capture_report: CaptureReport | None = None
        if self.graphs is not None and self.device.type == "cuda":
            self.capture()

    def _graphs(self, config: GraphConfig) -> GraphedForwards:
        # No forward has more rows than the cache has slots: larger buckets would never be used.
        fitted = replace(config, max_batch=min(config.max_batch, self.cache.num_slots))
        return GraphedForwards(self.model, self.cache, fitted)

    def capture(self) -> CaptureReport:
        """Capture the forwards of `RunnerConfig.cuda_graphs` as CUDA graphs (again, after the model changed:
        a graph replays the kernels it captured). Refused without them, and on a device other than CUDA."""
        if self.graphs is None:
            raise ValueError("this runner has no cuda_graphs to capture (RunnerConfig.cuda_graphs)")
        self.capture_report = self.graphs.capture()
        report = self.capture_report
        log.info(
            "captured %d CUDA graphs in %.1f s: %.1f MiB allocated, %.1f MiB reserved, %.1f MiB of static buffers",
            len(report.buckets),
            report.seconds,
            report.allocated_bytes / 2**20,
            report.reserved_bytes / 2**20,
            report.static_bytes / 2**20,
        )
        return report

    def graph_counters(self) -> GraphCounters:
        """Forwards through a CUDA-graph bucket and those run eagerly instead (all zero without graphs)."""
        return GraphCounters() if self.graphs is None else self.graphs.counters

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def allocate(self, reuse: Sequence[int] = (), salt: str | None = None) -> int:
        """A free slot for a new sequence. With prefix caching it starts with the longest prefix of `reuse` that
        the cache holds for `salt` (its `length`: those tokens need no computing), possibly evicting the least
        recently used cache entry; without, it is empty."""
        if self.prefix is None or not self.cache.free_slots:
            return self.cache.allocate()
        reuse = list(reuse)
        plan = self.prefix.plan(reuse, salt, self.cache.free_slot_ids)
        slot = self.cache.allocate(plan.slot)
        if plan.source is not None and plan.source != slot:
            self.cache.copy_prefix(plan.source, slot, plan.length)
        self.prefix.claim(plan, salt, len(reuse))
        self.cache.set_length(slot, plan.length)
        return slot

    def fork(self, source: int, length: int) -> int:
        """A free slot holding a copy of the first `length` positions of `source`: a branch of its sequence that
        can be extended and dropped without touching it. ResourceExhausted when no slot is free."""
        if length > self.cache.lengths[source]:
            raise ValueError(f"slot {source} holds {self.cache.lengths[source]} positions, not {length}")
        if not self.cache.free_slots:
            raise ResourceExhausted("kv_slots", f"all {self.cache.num_slots} KV cache slots are in use")
        slot = self.cache.allocate(None if self.prefix is None else self.prefix.spare(self.cache.free_slot_ids))
        self.cache.copy_prefix(source, slot, length)
        self.cache.set_length(slot, length)
        if self.prefix is not None:
            self.prefix.fork(source, slot, length)
        return slot

    def discard(self, slot: int) -> None:
        """Free `slot` without offering what it holds to the prefix cache (a branch that lost: its prefix is
        its sequence's own, held elsewhere)."""
        self.truncate(slot, 0)
        self.release(slot)

    def cached_prefix(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """How many leading `tokens` an `allocate` for `salt` would start with now (0 without prefix caching)."""
        return 0 if self.prefix is None else self.prefix.held(tokens, salt)

    def release(self, slot: int) -> None:
        """The slot's sequence ended. With prefix caching its contents stay as a cache entry (still a free slot)."""
        if self.prefix is not None:
            self.prefix.release(slot)
        self.cache.release(slot)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Counters of the prefix cache (all zero without one)."""
        if self.prefix is None:
            return PrefixCacheStats()
        stats = self.prefix.stats()
        held = stats.positions * self.cache.bytes_per_position + stats.entries * self.cache.ring_bytes
        return replace(stats, bytes=held)

    def length(self, slot: int) -> int:
        return self.cache.lengths[slot]

    def truncate(self, slot: int, length: int) -> None:
        """Keep only the first `length` tokens of `slot` (rollback: moves a length, copies nothing)."""
        if length > self.cache.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.cache.lengths[slot]} to {length}")
        self.cache.set_length(slot, length)
        if self.prefix is not None:
            self.prefix.truncated(slot, length)

    @torch.inference_mode()
    def extend(
        self,
        slots: Sequence[int],
        token_lists: Sequence[Sequence[int]],
        all_logits: bool = False,
        extra_vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append each row's tokens to its slot and return logits.

        Returns [B, T, V] float32 when `all_logits` (row b valid in its first len(token_lists[b]) positions),
        else [B, V]: the logits after each row's last token. Mutates the cache: lengths advance by the tokens
        appended (only once the forward has succeeded: a failed one leaves every slot's valid prefix as it was).
        `extra_vocab`: ids a model with a cut head (`models.vocab_head`) scores besides its own; None for others.
        """
        counts = [len(t) for t in token_lists]
        starts = [self.cache.lengths[s] for s in slots]
        for slot, start, n in zip(slots, starts, counts):
            if n == 0:
                raise ValueError(f"slot {slot}: nothing to append")
            if start + n > self.max_seq_len:
                raise ResourceExhausted("max_seq_len", f"sequence would reach {start + n} > {self.max_seq_len} tokens")
        T = max(counts)
        if max(starts) + T > self.cache.capacity:
            raise ValueError("rows of very different lengths in one batch: padding would leave the cache slot")
        if not all(self.cache.holds_window(s, a + n, (a, a + T)) for s, a, n in zip(slots, starts, counts)):
            raise ValueError("rows of very different lengths in one batch: padding would overwrite a window's keys")
        logits, width = self._forward(slots, starts, token_lists, all_logits, extra_vocab)  # [B, T or 1, V]
        for slot, start, n, row in zip(slots, starts, counts, token_lists):
            self.cache.wrote(slot, start, start + width)
            self.cache.set_length(slot, start + n)
            if self.prefix is not None:
                self.prefix.wrote(slot, start, row)
        self.computed_tokens += sum(counts)
        return logits if all_logits else logits[:, 0]

    @torch.inference_mode()
    def extend_next(
        self,
        slots: Sequence[int],
        tokens: torch.Tensor,  # [B] long, on the model's device: one new token per row
        extra_vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [B, V]
        """`extend` by one token a row whose ids stay on the device (e.g. the argmax of the last step's logits):
        a chain of steps with no copy to the host between them. The prefix cache forgets the slots' positions from
        here on until `record` tells it the tokens: what it holds must stay a prefix of what the slot holds."""
        starts = [self.cache.lengths[s] for s in slots]
        if (longest := max(starts) + 1) > self.max_seq_len:
            raise ResourceExhausted("max_seq_len", f"sequence would reach {longest} > {self.max_seq_len} tokens")
        placeholders = [[0] for _ in slots]  # the shapes of the call; the ids come from `tokens`
        logits, width = self._forward(slots, starts, placeholders, False, extra_vocab, tokens)  # [B, 1, V]
        for slot, start in zip(slots, starts):
            self.cache.wrote(slot, start, start + width)
            self.cache.set_length(slot, start + 1)
            if self.prefix is not None:
                self.prefix.truncated(slot, start)
        self.computed_tokens += len(slots)
        return logits[:, 0]

    def record(self, slot: int, start: int, tokens: Sequence[int]) -> None:
        """The ids `extend_next` wrote at positions start.. of `slot`, now known on the host: the prefix cache may
        offer them again. Positions the cache no longer holds, or after a gap, are not recorded."""
        if self.prefix is None or len(self.prefix.tokens(slot)) != start:
            return
        self.prefix.wrote(slot, start, list(tokens)[: max(0, self.cache.lengths[slot] - start)])

    def _padded(self, token_lists: Sequence[Sequence[int]], T: int) -> torch.Tensor:  # [B, T] on the device
        tokens = torch.zeros(len(token_lists), T, dtype=torch.long)  # [B, T], rows padded at the end
        for b, row in enumerate(token_lists):
            tokens[b, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        return tokens.to(self.device)

    def _forward(
        self,
        slots: Sequence[int],
        starts: Sequence[int],
        token_lists: Sequence[Sequence[int]],
        all_logits: bool,
        extra_vocab: torch.Tensor | None,
        device_tokens: torch.Tensor | None = None,  # [B]: one token a row, on the device, in place of token_lists
    ) -> tuple[torch.Tensor, int]:  # [B, T or 1, V], and the width every row wrote
        """Through a CUDA-graph bucket where one takes the call (rows padded to its width W), else eagerly (T)."""
        if self.graphs is not None and extra_vocab is None:
            rows = Rows(tuple(slots), tuple(starts), tuple(tuple(row) for row in token_lists))
            graphed = self.graphs.run(rows, all_logits, device_tokens)
            if graphed is not None:
                return graphed
        logits = self._eager(slots, starts, token_lists, all_logits, extra_vocab, device_tokens)
        return logits, max(len(t) for t in token_lists)

    def _eager(
        self,
        slots: Sequence[int],
        starts: Sequence[int],
        token_lists: Sequence[Sequence[int]],
        all_logits: bool,
        extra_vocab: torch.Tensor | None,
        device_tokens: torch.Tensor | None = None,  # [B]: one token a row, in place of token_lists
    ) -> torch.Tensor:  # [B, T or 1, V]
        """One forward launched from Python, shaped to the call: rows padded to the longest, keys read up to the
        furthest row's last position, views for a single row."""
        counts = [len(t) for t in token_lists]
        T = max(counts)
        tokens = device_tokens.view(-1, 1) if device_tokens is not None else self._padded(token_lists, T)  # [B, T]
        positions = torch.tensor(starts).unsqueeze(1) + torch.arange(T)  # [B, T]
        num_keys = max(starts) + T
        single = (slots[0], starts[0]) if len(slots) == 1 else None
        index = None
        if not all_logits:
            index = torch.tensor(counts).sub(1).unsqueeze(1)  # [B, 1]: each row's last real token
        extra = {} if extra_vocab is None else {"extra_vocab": extra_vocab}
        return self.model(
            tokens,
            positions.to(self.device),
            self.cache,
            torch.tensor(slots, device=self.device),
            num_keys,
            single,
            None if index is None else index.to(self.device),
            **extra,
        )
