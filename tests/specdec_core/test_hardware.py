"""What a worker takes from its machine: usable cores (affinity and cgroup quota, from fake cgroup files), torch
threads, the draft's quantization (from fake CPU flags), and the line it logs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specdec_core import hardware
from specdec_core.errors import InvalidArgument
from specdec_core.hardware import (
    cgroup_cpu_limit,
    resolve_draft_quantization,
    resolve_threads,
    usable_cores,
    worker_summary,
)


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _proc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "proc_self_cgroup"
    path.write_text(text)
    return path


def test_cgroup_v2_quota_of_the_process_cgroup(tmp_path):
    root = tmp_path / "cg"
    _write(root, "kubepods/pod1/cpu.max", "150000 100000\n")
    assert cgroup_cpu_limit(root, _proc(tmp_path, "0::/kubepods/pod1\n")) == pytest.approx(1.5)


def test_cgroup_v2_the_smallest_quota_on_the_way_up_applies(tmp_path):
    root = tmp_path / "cg"
    _write(root, "a/b/cpu.max", "max 100000\n")
    _write(root, "a/cpu.max", "300000 100000\n")
    _write(root, "cpu.max", "400000 100000\n")
    assert cgroup_cpu_limit(root, _proc(tmp_path, "0::/a/b\n")) == pytest.approx(3.0)


def test_cgroup_v2_without_a_quota(tmp_path):
    root = tmp_path / "cg"
    _write(root, "cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(root, _proc(tmp_path, "0::/\n")) is None


def test_cgroup_v2_in_a_container_that_sees_its_own_cgroup_as_root(tmp_path):
    """/proc/self/cgroup names the host's path, which does not exist under the container's mount: root counts."""
    root = tmp_path / "cg"
    _write(root, "cpu.max", "200000 100000\n")
    assert cgroup_cpu_limit(root, _proc(tmp_path, "0::/docker/0123abcd\n")) == pytest.approx(2.0)


@pytest.mark.parametrize("mount", ["cpu,cpuacct", "cpu"])
def test_cgroup_v1_cfs_quota(tmp_path, mount):
    root = tmp_path / "cg"
    _write(root, f"{mount}/job/cpu.cfs_quota_us", "250000\n")
    _write(root, f"{mount}/job/cpu.cfs_period_us", "100000\n")
    text = "12:memory:/job\n4:cpu,cpuacct:/job\n1:name=systemd:/job\n"
    assert cgroup_cpu_limit(root, _proc(tmp_path, text)) == pytest.approx(2.5)


def test_cgroup_v1_minus_one_is_no_quota_and_unknown_files_are_none(tmp_path):
    root = tmp_path / "cg"
    _write(root, "cpu/cpu.cfs_quota_us", "-1\n")
    _write(root, "cpu/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(root, _proc(tmp_path, "3:cpu:/\n0::/\n")) is None
    assert cgroup_cpu_limit(root, tmp_path / "missing") is None
    _write(root, "cpu.max", "garbage\n")
    assert cgroup_cpu_limit(root, _proc(tmp_path, "0::/\n")) is None


@pytest.mark.parametrize(
    "affinity, limit, cores",
    [(8, None, 8), (8, 2.0, 2), (8, 2.5, 2), (2, 4.0, 2), (4, 0.5, 1), (1, None, 1)],
)
def test_usable_cores_are_the_affinity_cut_to_the_quota_rounded_down(affinity, limit, cores):
    assert usable_cores(affinity, limit) == cores


def test_available_cores_reads_this_machine(monkeypatch):
    monkeypatch.setattr(hardware, "affinity_cores", lambda: 6)
    monkeypatch.setattr(hardware, "cgroup_cpu_limit", lambda: 3.5)
    assert hardware.available_cores() == 3


@pytest.mark.parametrize(
    "setting, cores, share, threads",
    [("auto", 2, 1, 2), ("auto", 16, 1, 16), ("auto", 8, 2, 4), ("auto", 2, 4, 1), (3, 16, 1, 3), (3, 2, 2, 3)],
)
def test_threads_auto_takes_the_cores_shared_by_concurrent_ranks_and_a_number_pins_them(setting, cores, share, threads):
    assert resolve_threads(setting, cores, share) == threads


@pytest.mark.parametrize("setting", [0, -1, "many", True, 2.0])
def test_bad_thread_settings_are_refused(setting):
    with pytest.raises(ValueError, match="threads"):
        resolve_threads(setting, 4)


VNNI = {"fpu", "avx2", "avx512f", "avx512bw", "avx512_vnni"}
NO_VNNI = {"fpu", "avx2", "avx512f", "avx512bw"}


@pytest.mark.parametrize(
    "setting, device, dtype, flags, kernels, chosen",
    [
        ("auto", "cpu", "bfloat16", VNNI, True, "int4"),  # 4-bit weights read faster than int8's
        ("auto", "cpu", "bfloat16", NO_VNNI, True, "none"),
        ("auto", "cpu", "bfloat16", {"avx2", "fma"}, True, "int4"),  # AVX2's int8 multiplies bytes without VNNI
        ("auto", "cpu", "bfloat16", {"avx2"}, True, "none"),  # no FMA: no kernels
        ("auto", "cpu", "bfloat16", VNNI, False, "none"),  # SPECDEC_DISABLE_CPU_KERNELS
        ("auto", "cpu", "float32", VNNI, True, "none"),  # the int8 kernel takes bf16 drafts
        ("auto", "cuda", "bfloat16", VNNI, True, "none"),
        ("none", "cpu", "bfloat16", VNNI, True, "none"),
        ("int8", "cpu", "bfloat16", NO_VNNI, True, "int8"),  # as asked (the build warns it cannot)
        ("int4", "cpu", "bfloat16", VNNI, True, "int4"),
    ],
)
def test_draft_quantization_auto_is_what_the_cpu_runs_best(setting, device, dtype, flags, kernels, chosen):
    got = resolve_draft_quantization(setting, device=device, dtype=dtype, cpu_flags=flags, kernels_enabled=kernels)
    assert got == chosen


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization"):
        resolve_draft_quantization("int2", device="cpu", dtype="bfloat16", cpu_flags=VNNI)


def test_worker_summary_names_threads_cores_niceness_and_kernels():
    line = worker_summary("target", 2, 4, "bf16 AVX-512 (native bf16)", 0)
    assert line == "target worker: 2 torch threads (4 cores available, nice 0), kernels: bf16 AVX-512 (native bf16)"
    draft = worker_summary("draft", 1, 1, "int8 VNNI", 15)
    assert draft.startswith("draft worker: 1 torch thread (1 cores available, nice 15)")


PIN_CHILD = """
import os, sys, threading
from specdec_core.hardware import available_cores, pin_process

before = threading.Event(); stop = threading.Event()
def idle():
    before.set(); stop.wait()
old = threading.Thread(target=idle); old.start(); before.wait()  # a thread that exists before the pinning
pin_process([int(c) for c in sys.argv[1].split(",")])
seen = {}
new = threading.Thread(target=lambda: seen.update(new=sorted(os.sched_getaffinity(0)))); new.start(); new.join()
tasks = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
print(sorted(set(map(tuple, tasks.values()))), seen["new"], available_cores())
stop.set(); old.join()
"""


def test_pinning_applies_to_the_process_its_threads_and_those_it_starts_after():
    """In a process of its own: the affinity of every thread is read back (one started before pinning, the main one,
    one started after), and `auto` threads count the pinned cores."""
    import subprocess
    import sys

    allowed = sorted(os.sched_getaffinity(0))
    cores = allowed[-1:]
    out = subprocess.run(
        [sys.executable, "-c", PIN_CHILD, ",".join(map(str, cores))], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [f"[({cores[0]},)]", f"[{cores[0]}]", "1"]  # every thread on the core; auto counts 1 core


def test_cores_a_process_may_not_use_are_refused_naming_the_key():
    with pytest.raises(InvalidArgument, match="cpu_affinity"):
        hardware.pin_process([max(os.sched_getaffinity(0)) + 1000])
    with pytest.raises(InvalidArgument, match="cpu_affinity"):
        hardware.pin_process([])
