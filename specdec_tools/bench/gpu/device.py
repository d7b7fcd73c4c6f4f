"""The device: what it is (part 1, environment), how fast it copies memory (the read limit every cost is set
against), and timing a call on it."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work: a CUDA call returns once launched, not once done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(call: Callable[[], Any], device: torch.device, repeats: int, warm_up: int = 2) -> float:
    """Median milliseconds of `call`, synchronised before and after each, after `warm_up` untimed calls."""
    for _ in range(warm_up):
        call()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        call()
        sync(device)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def environment(device: torch.device, dtypes: list[torch.dtype]) -> dict[str, Any]:
    """Part 1: torch, the device, the dtypes the exactness part checks."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": name,
        "dtypes": [str(d) for d in dtypes],
    }
    print(
        f"environment: torch {env['torch']} (cuda {env['cuda']}), {device} = {name}, dtypes {', '.join(env['dtypes'])}",
        flush=True,
    )
    return env


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes per second the device moves in a copy of `nbytes` within its own memory: each copy reads `nbytes` and
    writes as many, so 2 * nbytes over its median time. Large enough to dwarf a launch, this is what a forward that
    reads its weights once can at best approach: the read limit."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)  # [nbytes]
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, repeats)
    return 2 * nbytes / (ms / 1000)
