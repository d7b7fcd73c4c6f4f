"""Sliding-window attention over a ring of cached keys (Gemma 3's local layers).

A windowed layer's query at position i sees the keys at i-W+1 .. i: W positions, itself included, as transformers
counts (`kv > q - W`). Its cache layer is a ring (`kv_cache.Ring`): position j lives at index j mod R, R >= W, so
its memory follows the window, not the context.

A forward's new keys are attended *directly*, beside the ring as it was before the forward: the ring is read
first, the new keys appended, then written. So a forward of any length (a prefill longer than the ring
included) never overwrites a key one of its own queries reads; and, the ring holding at least the W - 1 positions
before the forward's first (`KVCache.holds_window`), every query finds its whole window. Which position a ring
index holds follows from the row's first new position alone (p - R + ((j - p) mod R)), so rows of a batch at
different positions need nothing more. A cache layer that is not a ring (R = the slot's capacity, positions below
it) reads the same way: index j holds position j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec_core.kv_cache import KVCache


@dataclass(frozen=True)
class WindowTables:
    """What the windowed layers of one forward share."""

    layers: frozenset[int]  # the windowed layers
    cos: torch.Tensor  # [B, T, 1, hd] their rotary tables (their own RoPE base)
    sin: torch.Tensor  # [B, T, 1, hd]
    mask: torch.Tensor  # [B, 1, T, R + T] True where a query sees a key: the ring's R, then the T new ones


def window_tables(
    positions: torch.Tensor,  # [B, T]
    window: int,  # W
    ring_size: int,  # R: positions a windowed cache layer holds per slot
    layers: frozenset[int],
    cos: torch.Tensor,  # [B, T, 1, hd]
    sin: torch.Tensor,  # [B, T, 1, hd]
) -> WindowTables:
    query = positions.unsqueeze(-1)  # [B, T, 1]
    held = held_positions(positions[:, :1], ring_size)  # [B, R]
    old = (held >= 0).unsqueeze(1) & (held.unsqueeze(1) > query - window)  # [B, T, R]; all below every query
    new = positions.unsqueeze(1)  # [B, 1, T]
    fresh = (new <= query) & (new > query - window)  # [B, T, T]
    return WindowTables(layers, cos, sin, torch.cat([old, fresh], dim=-1).unsqueeze(1))  # mask [B, 1, T, R + T]


def held_positions(starts: torch.Tensor, ring_size: int) -> torch.Tensor:  # starts [B, 1] -> [B, R]
    """The position each ring index holds before a forward whose first new position is `starts` (negative:
    nothing yet). Exact for the W - 1 positions before `starts`, which the ring keeps intact; older indices may
    hold a later position's (rejected) key, but no query's window reaches them."""
    index = torch.arange(ring_size, device=starts.device)  # [R]
    return starts - ring_size + torch.remainder(index - starts, ring_size)  # [B, R]


def ring_and_new(
    cache: KVCache,
    layer: int,
    slots: torch.Tensor,  # [B]
    positions: torch.Tensor,  # [B, T]
    k: torch.Tensor,  # [B, T, Hkv, hd], rotated
    v: torch.Tensor,  # [B, T, Hkv, hd]
    single: tuple[int, int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, Hkv, R + T, hd], [B, Hkv, R + T, hd])
    """The keys and values a windowed layer's queries choose from (`WindowTables.mask`): the ring as it was, then
    the new ones; and the new ones written into the ring, *after* it was read."""
    ring_k, ring_v = cache.read_held(layer, slots, single)  # [B, Hkv, R, hd] each
    keys = torch.cat([ring_k, k.transpose(1, 2)], dim=2)  # copies: the write below cannot reach it
    values = torch.cat([ring_v, v.transpose(1, 2)], dim=2)
    cache.write(layer, slots, positions, k, v, single)
    return keys, values
