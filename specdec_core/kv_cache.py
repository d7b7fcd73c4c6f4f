"""A slot-based KV cache written by position.

Each sequence owns one slot: a fixed run of `capacity` positions in every layer. A forward writes the keys and
values of its new tokens at their absolute positions; the slot's `length` says how many of them are valid.
Rolling back rejected draft tokens is `set_length`: the stale entries beyond the length are simply overwritten
by the next forward and never read before that (the attention mask only admits keys at positions <= the query's).
Nothing is ever copied or recomputed to roll back.

Prefix caching (`prefix_cache.py`) starts a new sequence from positions another slot holds: `copy_prefix` copies
them, once, when the sequence starts; rollback stays a length.

A cache built with `scratch` holds one slot more than `num_slots`: the scratch slot, never allocated, where the
padding rows of a static-shape forward (`cuda_graphs.py`) write, so that they change no sequence's keys.

Sliding-window layers (`Ring`) keep only the last R positions of a slot, position j at index j mod R, so their
memory follows the window, not the context (`models/window.py` reads them). What must stay true: after every
write, the ring still holds the W - 1 positions before any length the slot is set to. A write of positions
[start, end) overwrites what was at positions up to end - 1 - R, so the cache keeps, per slot, the oldest position
its rings still hold (`wrote`), and refuses a length whose window reaches below it (`holds_window`, `set_length`):
a rollback deeper than the ring's slack is an error, never a wrong key. The runner sizes R for the deepest
rollback it makes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec_core.errors import ResourceExhausted


@dataclass(frozen=True)
class Ring:
    """Layers that hold `size` positions per slot, written at position mod size: sliding-window layers."""

    layers: frozenset[int]
    window: int  # W: a query at position i reads keys i-W+1 .. i
    size: int  # R >= W: the W - 1 keys a next query reads, plus the slack for positions written past a length

    def __post_init__(self) -> None:
        if self.size < self.window:
            raise ValueError(f"a ring of {self.size} positions cannot hold a window of {self.window}")


def slot_bytes(
    num_layers: int, num_kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype, ring: Ring | None = None
) -> int:
    """Keys and values of one slot in every layer: `capacity` positions, `ring.size` in a ring layer."""
    rings = 0 if ring is None else len(ring.layers)
    positions = (num_layers - rings) * capacity + rings * (0 if ring is None else ring.size)
    return 2 * positions * num_kv_heads * head_dim * dtype.itemsize


class KVCache:
    """Per-layer key/value storage for `num_slots` sequences of up to `capacity` positions each."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        ring: Ring | None = None,
        scratch: bool = False,
    ) -> None:
        sizes = [ring.size if ring is not None and i in ring.layers else capacity for i in range(num_layers)]
        rows = num_slots + int(scratch)
        self.keys = [torch.zeros(rows, num_kv_heads, n, head_dim, dtype=dtype, device=device) for n in sizes]
        self.values = [torch.zeros(rows, num_kv_heads, n, head_dim, dtype=dtype, device=device) for n in sizes]
        self.capacity = capacity
        self.ring = ring
        self.num_slots = num_slots  # the slots `allocate` hands out; the scratch slot is not one of them
        self.scratch_slot = num_slots if scratch else None
        self.lengths = [0] * num_slots
        self._oldest = [0] * num_slots  # per slot: the oldest position its rings still hold (all later ones too)
        self._free = list(range(num_slots - 1, -1, -1))
        self._head_index = torch.arange(num_kv_heads, device=device).view(1, -1, 1)  # [1, Hkv, 1]

    # -- slot bookkeeping -------------------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def slots_in_use(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def free_slot_ids(self) -> tuple[int, ...]:
        """The free slots, the next one `allocate()` hands out last."""
        return tuple(self._free)

    def allocate(self, slot: int | None = None) -> int:
        """A free slot (this one, when given), of length 0."""
        if not self._free:
            raise ResourceExhausted("kv_slots", f"all {self.num_slots} KV cache slots are in use")
        if slot is None:
            slot = self._free.pop()
        else:
            self._free.remove(slot)
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        """Return a slot to the pool (idempotent)."""
        if slot not in self._free:
            self.lengths[slot] = 0
            self._free.append(slot)

    def set_length(self, slot: int, length: int) -> None:
        """Declare the first `length` positions of `slot` valid: how rejected tokens are rolled back. Refused
        (ValueError) where a ring no longer holds the window before `length`."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"length {length} outside [0, {self.capacity}]")
        if not self.holds_window(slot, length):
            raise ValueError(
                f"slot {slot}: length {length} needs positions from {length - self.window_span(length)}, but its "
                f"sliding-window layers hold only from {self._oldest[slot]} (a rollback deeper than their ring)"
            )
        self.lengths[slot] = length

    def window_span(self, length: int) -> int:
        """How many positions before `length` a next query reads from the rings (0 without rings)."""
        return 0 if self.ring is None else min(length, self.ring.window - 1)

    def holds_window(self, slot: int, length: int, write: tuple[int, int] | None = None) -> bool:
        """Whether the rings of `slot` hold every position a query after its first `length` reads; after a planned
        write of positions [start, end) when `write` is given."""
        if self.ring is None or length == 0:
            return True
        oldest = self._oldest[slot] if write is None else self._oldest_after(slot, *write)
        return oldest <= length - self.window_span(length)

    def wrote(self, slot: int, start: int, end: int) -> None:
        """A forward wrote positions [start, end) of `slot` (a padded row's padding included): the rings lost what
        they held at positions below end - R. Called by whoever writes through the model (the runner)."""
        if self.ring is not None:
            self._oldest[slot] = self._oldest_after(slot, start, end)

    def _oldest_after(self, slot: int, start: int, end: int) -> int:
        # Positions from `start` on are fresh, those below it as intact as they were (a sequence new in a used slot
        # starts at 0: nothing older counts); the write overwrote every position below end - R.
        assert self.ring is not None
        return max(min(self._oldest[slot], start), end - self.ring.size)

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        """Copy the first `length` positions of every layer from slot `source` into `slot` (its length is the
        caller's to set); a ring layer's whole ring, which holds the window before `length` (refused otherwise)."""
        if not self.holds_window(source, length):
            raise ValueError(f"slot {source} no longer holds the window before position {length}")
        for layer, (kc, vc) in enumerate(zip(self.keys, self.values)):  # [slots, Hkv, capacity or R, hd] each
            end = kc.shape[2] if self._is_ring(layer) else length
            kc[slot, :, :end] = kc[source, :, :end]
            vc[slot, :, :end] = vc[source, :, :end]
        self._oldest[slot] = self._oldest[source]

    def _is_ring(self, layer: int) -> bool:
        return self.ring is not None and layer in self.ring.layers

    @property
    def bytes_per_position(self) -> int:
        """Keys and values of one more position of context: in every layer but the rings, which are a fixed
        `ring_bytes` per slot whatever the length."""
        k = self.keys[0]
        full = len(self.keys) - (0 if self.ring is None else len(self.ring.layers))
        return 2 * full * k.shape[1] * k.shape[3] * k.element_size()

    @property
    def ring_bytes(self) -> int:
        """Keys and values of one slot's rings (0 without)."""
        k = self.keys[0]
        return slot_bytes(len(self.keys), k.shape[1], 0, k.shape[3], k.dtype, self.ring)

    def held(self, layer: int) -> int:
        """Positions a slot holds in `layer`: the ring's size, or the capacity."""
        return self.keys[layer].shape[2]

    # -- the forward's view -----------------------------------------------------------------------------------

    def write(
        self,
        layer: int,
        slots: torch.Tensor,  # [B]
        positions: torch.Tensor,  # [B, T]
        k: torch.Tensor,  # [B, T, Hkv, hd]
        v: torch.Tensor,  # [B, T, Hkv, hd]
        single: tuple[int, int] | None = None,  # (slot, start) when B == 1, as Python ints: no device sync
    ) -> None:
        """Write the new keys/values of layer `layer` at their positions in each row's slot (a ring's at position
        mod R: of a forward longer than R, its last R positions, which are the ones that stay)."""
        kc, vc = self.keys[layer], self.values[layer]
        if self._is_ring(layer):
            R = kc.shape[2]
            positions, k, v = positions[:, -R:], k[:, -R:], v[:, -R:]  # [B, T', ...], T' = min(T, R)
            positions, single = positions % R, None  # distinct indices per row; may wrap, so no slice
        if single is not None:
            slot, start = single
            end = start + positions.shape[1]
            kc[slot, :, start:end] = k[0].transpose(0, 1)
            vc[slot, :, start:end] = v[0].transpose(0, 1)
            return
        rows = slots.view(-1, 1, 1)  # [B, 1, 1]
        cols = positions.unsqueeze(1)  # [B, 1, T]
        kc[rows, self._head_index, cols] = k.transpose(1, 2)
        vc[rows, self._head_index, cols] = v.transpose(1, 2)

    def read(
        self,
        layer: int,
        slots: torch.Tensor,  # [B]
        num_keys: int,  # S
        single: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, Hkv, S, hd], [B, Hkv, S, hd])
        """The first S positions of each row's slot: a view for one row, a gather of S positions for a batch."""
        if self._is_ring(layer):
            raise ValueError(f"layer {layer} is a ring: read it whole (`read_held`)")
        kc, vc = self.keys[layer], self.values[layer]
        if single is not None:
            slot = single[0]
            return kc[slot : slot + 1, :, :num_keys], vc[slot : slot + 1, :, :num_keys]
        if num_keys == kc.shape[2]:  # whole slots (a static-shape forward): a gather of rows, no index per position
            return kc[slots], vc[slots]
        rows = slots.view(-1, 1, 1)  # [B, 1, 1]
        read = torch.arange(num_keys, device=slots.device).view(1, 1, -1)  # [1, 1, S]
        return kc[rows, self._head_index, read], vc[rows, self._head_index, read]

    def read_held(
        self,
        layer: int,
        slots: torch.Tensor,  # [B]
        single: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, Hkv, P, hd], [B, Hkv, P, hd]), P = `held(layer)`
        """Every position each row's slot holds in `layer` (a ring whole): a view for one row, a gather for a batch."""
        kc, vc = self.keys[layer], self.values[layer]
        if single is not None:
            slot = single[0]
            return kc[slot : slot + 1], vc[slot : slot + 1]
        return kc[slots], vc[slots]
