"""A CPU model's weights backed by transparent huge pages, in place.

Why: decoding streams every weight once a token, and with 4 KB pages a read of a 3 GB model crosses 750,000 pages,
each a TLB miss and a boundary the hardware prefetchers stop at. In 2 MB pages the same read ran faster: the 1.5B
target's matrices at one row took 0.92-0.95 of the time (docs/engine.md). llama.cpp gets this for free where the
kernel backs its memory-mapped GGUF file with huge pages; torch's allocations get it only where transparent huge
pages are `always`, and most hosts set `madvise`.

How, in two steps (`build.prepare_model`): the weights as loaded are copied into memory advised `MADV_HUGEPAGE`
before it is first written (`move_into_huge_pages`: a memory-mapped checkpoint's pages belong to the file's page
cache and cannot be collapsed where they lie); after the kernel surgery, the 2 MB-aligned interior of every tensor
of at least one huge page is advised and collapsed with `MADV_COLLAPSE` (Linux 6.1+; `back_with_huge_pages`), which
moves the bytes into huge pages without changing a virtual address, so every pointer the kernels captured
(`layers_quant.py`, `linear._KernelCall`) stays valid. Where collapsing is refused (an older kernel, huge pages
`never`) the advice alone stays, and the kernel's background collapser may act on it later; nothing fails. Linux
only; elsewhere, and with `SPECDEC_DISABLE_HUGE_PAGES`, nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import sys
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from specdec_core import environment

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


@dataclass(frozen=True)
class HugePages:
    """What `back_with_huge_pages` did: bytes of the weights considered, advised, and collapsed into huge pages."""

    weight_bytes: int
    advised_bytes: int
    collapsed_bytes: int


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def move_into_huge_pages(model: nn.Module) -> int:
    """Copy every CPU parameter and buffer of `model` of at least one huge page into fresh memory advised for huge
    pages before its first write, so that it is faulted in huge pages directly; the bytes moved. For weights as
    loaded, before the kernel surgery captures any address: a memory-mapped checkpoint's tensors live in the file's
    page cache, which `MADV_COLLAPSE` cannot collapse."""
    libc = None if environment.huge_pages_disabled() else _libc()
    if libc is None:
        return 0
    moved, seen = 0, set[int]()
    for module in model.modules():
        for param in module._parameters.values():  # tied modules share the Parameter: one move serves them all
            if param is not None and _movable(param, seen):
                param.data = _advised_like(libc, param.detach())
                moved += param.untyped_storage().nbytes()
        for name, buffer in module._buffers.items():
            if buffer is not None and _movable(buffer, seen):
                module._buffers[name] = _advised_like(libc, buffer)
                moved += buffer.untyped_storage().nbytes()
    return moved


def _movable(tensor: torch.Tensor, seen: set[int]) -> bool:
    """A CPU tensor of at least one huge page not met before (`seen` remembers it)."""
    if id(tensor) in seen or tensor.device.type != "cpu":
        return False
    seen.add(id(tensor))
    return tensor.untyped_storage().nbytes() >= HUGE_PAGE


def _advised_like(libc: ctypes.CDLL, tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `tensor` in memory advised for huge pages before any of it was touched."""
    fresh = torch.empty(tensor.shape, dtype=tensor.dtype)  # allocated, not yet faulted in
    start, end = _interior(fresh.untyped_storage())
    if end > start:
        libc.madvise(start, end - start, MADV_HUGEPAGE)
    return fresh.copy_(tensor)


def back_with_huge_pages(model: nn.Module) -> HugePages:
    """Advise and collapse into huge pages the interior of every CPU parameter and buffer of `model` that spans a
    whole huge page (each storage once); the bytes and addresses are unchanged."""
    libc = None if environment.huge_pages_disabled() else _libc()
    seen: set[int] = set()
    total = advised = collapsed = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type != "cpu" or tensor.untyped_storage().data_ptr() in seen:
            continue
        storage = tensor.untyped_storage()
        seen.add(storage.data_ptr())
        total += storage.nbytes()
        start, end = _interior(storage)
        if libc is None or end <= start:
            continue
        if libc.madvise(start, end - start, MADV_HUGEPAGE) == 0:
            advised += end - start
            collapsed += _collapse(libc, start, end)
    return HugePages(total, advised, collapsed)


def _interior(storage: torch.UntypedStorage) -> tuple[int, int]:
    """The whole huge pages inside `storage`: [start, end) addresses, empty (end <= start) if none."""
    return -(-storage.data_ptr() // HUGE_PAGE) * HUGE_PAGE, (
        storage.data_ptr() + storage.nbytes()
    ) // HUGE_PAGE * HUGE_PAGE


def _collapse(libc: ctypes.CDLL, start: int, end: int) -> int:
    """Collapse [start, end) one huge page at a time (a page the kernel cannot find room for fails alone, and the
    others still collapse); the bytes collapsed. Stops at the first page refused as unsupported (EINVAL: a kernel
    before 6.1, or memory that cannot be collapsed)."""
    collapsed = 0
    for page in range(start, end, HUGE_PAGE):
        if libc.madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0:
            collapsed += HUGE_PAGE
        elif ctypes.get_errno() == errno.EINVAL:
            break
    return collapsed


def log_huge_pages(name: str, report: HugePages) -> None:
    """One line on what a model's weights got, at debug level where there was nothing to collapse."""
    level = logging.INFO if report.advised_bytes else logging.DEBUG
    log.log(
        level,
        "%s: %.2f of %.2f GB of weights in huge pages (%.2f GB advised)",
        name,
        report.collapsed_bytes / 1e9,
        report.weight_bytes / 1e9,
        report.advised_bytes / 1e9,
    )
