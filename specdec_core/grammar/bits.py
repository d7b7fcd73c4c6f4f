"""Packed token masks as the grammar engine fills them: 32 tokens per 32-bit word, token 32 * w + j at bit j of
word w (llguidance's layout, and xgrammar's).

They stay numpy arrays: these are small operations on the engine's loop, and small torch operations can cost
orders of magnitude more than numpy's when torch's thread pool is busy.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch

if sys.byteorder != "little":  # unpack_bitmask reads a word's bytes low to high
    raise ImportError("specdec_core.grammar needs a little-endian host")


def unpack_bitmask(
    words: np.ndarray,  # [..., W] uint32 (or int32)
    n: int,  # tokens: bits past 32 * W are 0 (the model's padding ids)
) -> torch.Tensor:  # [..., n] bool
    raw = np.ascontiguousarray(words).view(np.uint8)  # [..., 4W]: each word's bytes, low to high
    bits = np.unpackbits(raw, axis=-1, bitorder="little")  # [..., 32W] uint8 0/1, token order
    if n > bits.shape[-1]:
        bits = np.concatenate([bits, np.zeros(bits.shape[:-1] + (n - bits.shape[-1],), np.uint8)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(bits[..., :n])).view(torch.bool)


@dataclass(frozen=True)
class PackedMasks:
    """The tokens allowed at consecutive positions, packed as above: how a constrained row's masks travel from the
    grammar to the target (`PrefillItem.allowed`, `VerifyItem.allowed`). 4 bytes per 32 tokens (19 KB a position
    at 152k ids, against 152 KB as bool), and the form a wire would carry as bytes; unpacked only where the
    logits are masked."""

    words: np.ndarray  # [n, W] uint32
    vocab_size: int  # V: the width of the logits they mask; ids past 32 * W are never allowed

    def __len__(self) -> int:
        return self.words.shape[0]  # n

    def dense(self) -> torch.Tensor:  # [n, V] bool
        return unpack_bitmask(self.words, self.vocab_size)


def popcount(words: np.ndarray) -> int:  # words: [W] uint32
    """The number of tokens a packed mask allows."""
    return int(np.bitwise_count(words.view(np.uint32)).sum())


def has(words: np.ndarray, token: int) -> bool:  # words: [W] uint32
    return bool((int(words[token >> 5]) >> (token & 31)) & 1)


def set_bit(words: np.ndarray, token: int, value: bool) -> None:  # words: [W] uint32, changed in place
    bit = np.uint32(1 << (token & 31))
    words[token >> 5] = (words[token >> 5] | bit) if value else (words[token >> 5] & ~bit)


def only_token(words: np.ndarray) -> int:  # words: [W] uint32 with exactly one bit set
    word = int(np.flatnonzero(words)[0])
    return 32 * word + int(words[word]).bit_length() - 1
