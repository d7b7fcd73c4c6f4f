"""A CPU model's weights collapsed into huge pages in place (`huge_pages.py`): the same bytes at the same addresses,
in huge pages where the host allows it, small tensors and a disabled switch left alone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from specdec_core import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _smaps(tensor: torch.Tensor) -> list[dict[str, str]]:
    """The fields of each mapping of this process's smaps that holds part of `tensor`'s storage."""
    begin = tensor.untyped_storage().data_ptr()
    end = begin + tensor.untyped_storage().nbytes()
    found: list[dict[str, str]] = []
    fields: dict[str, str] | None = None  # the mapping being read, if it holds part of the tensor
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):  # a mapping's first line: its address range
            low, high = (int(v, 16) for v in head.split("-"))
            fields = {} if low < end and high > begin else None
            if fields is not None:
                found.append(fields)
        elif fields is not None and head.endswith(":"):
            fields[head[:-1]] = line.split(":", 1)[1].strip()
    return found


def _huge_bytes(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that hold `tensor`'s storage."""
    return sum(int(fields["AnonHugePages"].split()[0]) * 1024 for fields in _smaps(tensor))


def _advised(tensor: torch.Tensor) -> bool:
    """Whether a mapping that holds `tensor`'s storage is advised for huge pages (smaps' `hg` flag)."""
    return any("hg" in fields.get("VmFlags", "").split() for fields in _smaps(tensor))


def _model() -> nn.Module:
    model = nn.Module()
    model.big = nn.Parameter(torch.randn(6 * huge_pages.HUGE_PAGE // 2).to(torch.bfloat16), requires_grad=False)
    model.register_buffer("small", torch.arange(100, dtype=torch.int32))
    model.tied = model.big  # one storage, counted once
    return model


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or "[never]" in (THP.read_text() if THP.exists() else "[never]"),
    reason="no transparent huge pages on this host",
)
def test_weights_are_collapsed_into_huge_pages_in_place():
    model = _model()
    before, address = model.big.detach().clone(), model.big.data_ptr()
    report = huge_pages.back_with_huge_pages(model)
    assert report.weight_bytes == model.big.untyped_storage().nbytes() + model.small.untyped_storage().nbytes()
    assert report.advised_bytes >= 4 * huge_pages.HUGE_PAGE  # the interior of 6 MB: at least 4 whole huge pages
    assert model.big.data_ptr() == address and torch.equal(model.big, before)
    if report.collapsed_bytes == 0:
        pytest.skip("this kernel refuses MADV_COLLAPSE (before Linux 6.1): advised only")
    assert _huge_bytes(model.big) >= report.collapsed_bytes


def test_nothing_is_advised_when_switched_off(monkeypatch):
    monkeypatch.setenv("SPECDEC_DISABLE_HUGE_PAGES", "1")
    model = _model()
    report = huge_pages.back_with_huge_pages(model)
    assert report.advised_bytes == report.collapsed_bytes == 0
    assert report.weight_bytes == model.big.untyped_storage().nbytes() + model.small.untyped_storage().nbytes()


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or "[never]" in (THP.read_text() if THP.exists() else "[never]"),
    reason="no transparent huge pages on this host",
)
def test_weights_as_loaded_are_copied_into_huge_pages_keeping_ties_and_values():
    """Before the kernels capture addresses, each large weight moves to memory advised for huge pages before its
    first write (a memory-mapped checkpoint's pages cannot be collapsed where they are); a tie stays one tensor."""
    model = nn.Module()
    model.embed, model.head = nn.Linear(8, 8), nn.Linear(8, 8)
    big = torch.randn(3 * huge_pages.HUGE_PAGE // 4, 2)  # 6 MB of fp32
    model.embed.weight = model.head.weight = nn.Parameter(big.clone(), requires_grad=False)
    model.register_buffer("table", big[:, 0].clone())  # 3 MB: a buffer, moved too
    small = model.embed.bias.data_ptr()
    old = model.embed.weight.data_ptr()
    moved = huge_pages.move_into_huge_pages(model)
    assert moved == big.numel() * 4 + big.shape[0] * 4
    assert model.embed.weight is model.head.weight and model.embed.weight.data_ptr() != old
    assert torch.equal(model.embed.weight, big) and torch.equal(model.table, big[:, 0])
    assert model.embed.bias.data_ptr() == small  # under a huge page: left where it is
    # Advised before its first write; whether the faults found free huge pages depends on the host's memory (the
    # collapse after the surgery, `back_with_huge_pages`, takes what they did not).
    assert _advised(model.embed.weight) and _advised(model.table)
