"""A slot-based KV cache written by position.

Each sequence owns one slot: a fixed run of `capacity` positions in every layer. A forward writes the keys and
values of its new tokens at their absolute positions; the slot's `length` says how many of them are valid.
Rolling back rejected draft tokens is `set_length`: the stale entries beyond the length are simply overwritten
by the next forward and never read before that (the attention mask only admits keys at positions <= the query's).
Nothing is ever copied or recomputed to roll back.

Prefix caching (`prefix_cache.py`) starts a new sequence from positions another slot holds: `copy_prefix` copies
them, once, when the sequence starts; rollback stays a length.
"""

from __future__ import annotations

import torch

from specdec_core.errors import ResourceExhausted


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
    ) -> None:
        shape = (num_slots, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.num_slots = num_slots
        self.lengths = [0] * num_slots
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
        """Declare the first `length` positions of `slot` valid: how rejected tokens are rolled back."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"length {length} outside [0, {self.capacity}]")
        self.lengths[slot] = length

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        """Copy the first `length` positions of every layer from slot `source` into `slot` (its length is the
        caller's to set)."""
        for kc, vc in zip(self.keys, self.values):  # [slots, Hkv, capacity, hd] each
            kc[slot, :, :length] = kc[source, :, :length]
            vc[slot, :, :length] = vc[source, :, :length]

    @property
    def bytes_per_position(self) -> int:
        """Keys and values of one position in every layer."""
        k = self.keys[0]
        return 2 * len(self.keys) * k.shape[1] * k.shape[3] * k.element_size()

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
        """Write the new keys/values of layer `layer` at their positions in each row's slot."""
        kc, vc = self.keys[layer], self.values[layer]
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
        kc, vc = self.keys[layer], self.values[layer]
        if single is not None:
            slot = single[0]
            return kc[slot : slot + 1, :, :num_keys], vc[slot : slot + 1, :, :num_keys]
        rows = slots.view(-1, 1, 1)  # [B, 1, 1]
        read = torch.arange(num_keys, device=slots.device).view(1, 1, -1)  # [1, 1, S]
        return kc[rows, self._head_index, read], vc[rows, self._head_index, read]
