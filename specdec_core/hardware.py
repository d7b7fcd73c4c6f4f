"""What this machine gives a worker: the cores its process may run on, the torch threads it takes, and the draft
quantization its CPU can run.

Why not Ray's `num_cpus`: that is a reservation for Ray's scheduler, not a limit. Ray pins no cores, so a worker
that reserved 1 CPU may run on every core of the node (and Ray starts it with OMP_NUM_THREADS=1, so without being
told it runs on one). What does limit a process is its CPU affinity (a cpuset) and its cgroup's CPU quota
(a container's `--cpus`, a Kubernetes CPU limit): `available_cores` reads both.

The functions that decide are pure (they take the cgroup files' directory, the CPU flags, the core counts), so
tests pass fakes; the defaults read this machine.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from specdec_core.errors import InvalidArgument

AUTO = "auto"
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")

# What the int8 draft kernel needs of the CPU (`gemm_int8.c`, built for what -march=native has): on a CPU with
# AVX-512 (F and BW) the kernels are built for it, and the int8 kernel needs VNNI's int8 dot products; without
# AVX-512 they are built for AVX2 with FMA, whose int8 kernel multiplies bytes with `vpmaddubsw`.
INT8_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_vnni"})
AVX512_FLAGS = frozenset({"avx512f", "avx512bw"})
AVX2_FLAGS = frozenset({"avx2", "fma"})


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where unknown). Read here only: the kernels' build, the
    draft's quantization and the reports all ask this function."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in info.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def int8_kernel_runs(cpu_flags: Iterable[str]) -> bool:
    """Whether the kernels built for a CPU with these flags include the int8 draft kernel."""
    flags = frozenset(cpu_flags)
    return INT8_CPU_FLAGS <= flags if AVX512_FLAGS <= flags else AVX2_FLAGS <= flags


DRAFT_QUANTIZATIONS = ("none", "int8", "int4", AUTO)


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> float | None:
    """The CPU quota of this process's cgroup in cores (quota / period), None when none applies or none is known.

    cgroup v2: `cpu.max` ("max 100000" or "150000 100000"); v1: `cpu.cfs_quota_us` (-1: none) over
    `cpu.cfs_period_us`, in the `cpu` controller's hierarchy. The process's own cgroup and every ancestor limit
    it, so the smallest quota found on the way up to `root` applies. Inside a container the cgroup path read from
    `proc_cgroup` may not exist under `root` (the container sees its own cgroup as the root): missing directories
    are skipped, and `root` itself is always read.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        names = controllers.split(",") if controllers else []
        if not controllers:  # v2: "0::/path"
            limits += _limits_up(root, path, _v2_limit)
        elif "cpu" in names:  # v1: "N:cpu,cpuacct:/path", mounted as root/cpu,cpuacct (and often root/cpu)
            for mount in dict.fromkeys([root / controllers, root / "cpu"]):
                limits += _limits_up(mount, path, _v1_limit)
    return min(limits, default=None)


def _limits_up(base: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The limits `read` finds in `base / path` and each of its ancestors up to `base` itself."""
    parts = [p for p in path.strip().split("/") if p]
    found = []
    for depth in range(len(parts), -1, -1):
        limit = read(base.joinpath(*parts[:depth]))
        if limit is not None:
            found.append(limit)
    return found


def _v2_limit(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return _ratio(quota, period)


def _v1_limit(directory: Path) -> float | None:
    try:
        quota = (directory / "cpu.cfs_quota_us").read_text().strip()
        period = (directory / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None  # v1 writes -1 for none


def usable_cores(affinity: int, limit: float | None) -> int:
    """The cores a process can keep busy: its affinity, cut to its quota rounded down (threads beyond a quota are
    throttled at every period's end, which stalls all of a parallel region's threads), at least 1."""
    cores = affinity if limit is None else min(affinity, math.floor(limit))
    return max(1, cores)


def affinity_cores() -> int:
    """The cores this process may be scheduled on (its cpuset), or the machine's count where that is unknown."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def available_cores() -> int:
    """This process's usable cores: `usable_cores` of its affinity and cgroup quota."""
    return usable_cores(affinity_cores(), cgroup_cpu_limit())


def resolve_threads(setting: int | str, cores: int, share: int = 1) -> int:
    """A worker's torch threads. A number is taken as it is. `auto`: the worker's `cores`, split evenly among the
    `share` processes of one replica that compute at the same time on them (the tensor-parallel ranks of a replica,
    packed on one machine), at least 1."""
    if setting == AUTO:
        return max(1, cores // max(1, share))
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"threads must be a positive number or {AUTO!r}, got {setting!r}")
    return setting


def resolve_draft_quantization(
    setting: str, *, device: str, dtype: str, cpu_flags: Iterable[str], kernels_enabled: bool = True
) -> str:
    """The draft's quantization: `none`, `int8` or `int4` as given; `auto`, for a bfloat16 draft on the CPU kernels
    (not switched off, with the int8 kernel built: AVX2, or AVX-512 with VNNI): int4, else none (CUDA and other
    devices too). A draft step is bound by reading the weights, and reading 4-bit ones measured faster than int8's
    on both AVX2 and AVX-512 (docs/engine.md, "Draft quantization"); calls of many rows take int8 weights on fbgemm
    either way. Either changes only the drafts, so only the acceptance rate: the output stays the target's."""
    if setting not in DRAFT_QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {DRAFT_QUANTIZATIONS}, got {setting!r}")
    if setting != AUTO:
        return setting
    flags = frozenset(cpu_flags)
    if device != "cpu" or dtype != "bfloat16" or not kernels_enabled or not int8_kernel_runs(flags):
        return "none"
    return "int4"


def pin_process(cores: Iterable[int], tasks: Path = Path("/proc/self/task")) -> frozenset[int]:
    """Run this process, every thread it has and every thread it starts after, on `cores` (CPU ids): its CPU
    affinity, as `taskset` sets it, for each of its threads (a thread's affinity is its own on Linux; new threads
    inherit their creator's). Returns the cores now allowed. Cores outside those it may run on now are refused
    with `InvalidArgument` naming `cpu_affinity`."""
    wanted = frozenset(cores)
    allowed = frozenset(os.sched_getaffinity(0))
    if not wanted or not wanted <= allowed:
        raise InvalidArgument(
            "cpu_affinity", f"cores {sorted(wanted)} are not all among this process's cores {sorted(allowed)}"
        )
    for task in sorted(tasks.iterdir()):
        try:
            os.sched_setaffinity(int(task.name), wanted)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return frozenset(os.sched_getaffinity(0))


def use_threads(setting: int | str, share: int = 1) -> tuple[int, int]:
    """Set this process's torch threads from `setting` (`resolve_threads` over `available_cores`); returns
    (threads, cores available). A worker calls it once, before building its model."""
    import torch

    cores = available_cores()
    threads = resolve_threads(setting, cores, share)
    torch.set_num_threads(threads)
    return threads, cores


def worker_summary(kind: str, threads: int, cores: int, kernels: str, niceness: int) -> str:
    """The line a worker logs once at start: what it computes with. `kernels`: `kernels.report.kernel_path`;
    `niceness`: the process's (`os.getpriority`), which decides who gets the cores when others want them too."""
    plural = "s" if threads != 1 else ""
    cores_part = f"{cores} cores available, nice {niceness}"
    return f"{kind} worker: {threads} torch thread{plural} ({cores_part}), kernels: {kernels}"
