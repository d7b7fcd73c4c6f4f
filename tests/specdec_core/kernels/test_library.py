"""The kernel cache: a private directory, libraries named by what they are built from, and only verified bytes
loaded. Built from a one-line C file, so these run wherever a C compiler does (no AVX-512 needed). And the
kernels' C signatures: a status a kernel returns is raised."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specdec_core.kernels import library
from tests.specdec_core.kernels.marks import needs_kernels

COMPILER = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(COMPILER is None, reason="needs a C compiler")
ROOT = Path(__file__).resolve().parents[3]


def _spec(src_dir: Path, answer: int = 42, flags: tuple[str, ...] = ()) -> library.LibrarySpec:
    src_dir.mkdir(parents=True, exist_ok=True)
    source = src_dir / "answer.c"
    source.write_text(f"int specdec_answer(void) {{ return {answer}; }}\n")
    return library.LibrarySpec(name="libanswer", sources=(source,), flags=("-shared", "-fPIC", *flags))


def _answer(lib: ctypes.CDLL) -> int:
    lib.specdec_answer.restype = ctypes.c_int
    return lib.specdec_answer()


def _cached(directory: Path) -> tuple[Path, Path]:
    """The one library in the cache and its recorded digest."""
    (lib_path,) = directory.glob("libanswer-*.so")
    return lib_path, lib_path.with_name(lib_path.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


_LOAD = """
import ctypes, logging, sys
from pathlib import Path
from specdec_core.kernels import library
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
spec = library.LibrarySpec(name="libanswer", sources=(Path(sys.argv[1]),), flags=("-shared", "-fPIC"))
lib = library.load(spec, sys.argv[2], Path(sys.argv[3]))
lib.specdec_answer.restype = ctypes.c_int
print(lib.specdec_answer())
"""


def _load_elsewhere(spec: library.LibrarySpec, directory: Path) -> subprocess.Popen:
    """`library.load` in another process (as another worker would; and this process's dlopen has not seen it)."""
    return subprocess.Popen(
        [sys.executable, "-c", _LOAD, str(spec.sources[0]), COMPILER, str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _built_elsewhere(spec: library.LibrarySpec, directory: Path) -> None:
    out, err = _load_elsewhere(spec, directory).communicate(timeout=300)
    assert out.strip() == "42", err


def test_a_library_is_built_once_into_a_0700_directory_with_its_digest(tmp_path, caplog):
    directory = tmp_path / "cache" / "kernels"
    spec = _spec(tmp_path / "src")
    old_umask = os.umask(0)  # created 0700 by mkdir itself, not by a umask that happens to be strict
    try:
        with caplog.at_level(logging.INFO, logger=library.__name__):
            assert _answer(library.load(spec, COMPILER, directory)) == 42
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert not any("was mode" in r.getMessage() for r in caplog.records)  # never open, not even for a moment
    lib_path, digest_path = _cached(directory)
    assert digest_path.read_text().strip() == _sha256(lib_path)
    built = lib_path.stat().st_mtime_ns
    assert _answer(library.load(spec, COMPILER, directory)) == 42
    assert lib_path.stat().st_mtime_ns == built  # reused, not rebuilt
    assert sorted(p.name for p in directory.iterdir() if p.name.startswith(".")) == []  # no temp files left


def test_a_tampered_library_is_rebuilt_and_never_loaded(tmp_path, caplog):
    directory = tmp_path / "kernels"
    spec = _spec(tmp_path / "src")
    _built_elsewhere(spec, directory)
    lib_path, digest_path = _cached(directory)
    good = digest_path.read_text().strip()
    # The tampered file is a working library that answers 666: loaded, it would show.
    evil_dir = tmp_path / "evil"
    evil = library.load(_spec(tmp_path / "evil_src", answer=666), COMPILER, evil_dir)
    assert _answer(evil) == 666
    (evil_path, _) = _cached(evil_dir)
    lib_path.write_bytes(evil_path.read_bytes())
    assert _sha256(lib_path) != good

    with caplog.at_level(logging.WARNING, logger=library.__name__):
        assert _answer(library.load(spec, COMPILER, directory)) == 42
    assert any("does not match its recorded SHA-256" in r.getMessage() for r in caplog.records)
    assert _sha256(lib_path) == digest_path.read_text().strip() != _sha256(evil_path)


def test_a_truncated_library_is_rebuilt(tmp_path):
    directory = tmp_path / "kernels"
    spec = _spec(tmp_path / "src")
    _built_elsewhere(spec, directory)
    lib_path, digest_path = _cached(directory)
    lib_path.write_bytes(lib_path.read_bytes()[:1000])
    # In another process: dlopen of a truncated library can crash its caller, and a crash must fail only this test.
    out, err = _load_elsewhere(spec, directory).communicate(timeout=300)
    assert out.strip() == "42", err
    assert "does not match its recorded SHA-256" in err and "compiled libanswer" in err
    assert _sha256(lib_path) == digest_path.read_text().strip()
    assert lib_path.stat().st_size > 1000


def test_a_library_others_can_write_is_rebuilt(tmp_path, caplog):
    directory = tmp_path / "kernels"
    spec = _spec(tmp_path / "src")
    _built_elsewhere(spec, directory)
    lib_path, _ = _cached(directory)
    lib_path.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger=library.__name__):
        assert _answer(library.load(spec, COMPILER, directory)) == 42
    assert any("only this user can write" in r.getMessage() for r in caplog.records)
    assert not lib_path.stat().st_mode & 0o022


def test_a_group_writable_directory_is_closed_to_0700(tmp_path, caplog):
    directory = tmp_path / "kernels"
    directory.mkdir()
    directory.chmod(0o775)
    with caplog.at_level(logging.WARNING, logger=library.__name__):
        library.private_dir(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert any("was mode 775" in r.getMessage() for r in caplog.records)


def test_a_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    directory = tmp_path / "kernels"
    directory.mkdir(mode=0o700)
    monkeypatch.setattr(os, "getuid", lambda: directory.stat().st_uid + 1)
    with pytest.raises(PermissionError, match="belongs to uid"):
        library.load(_spec(tmp_path / "src"), COMPILER, directory)
    assert list(directory.iterdir()) == []  # nothing built or written there


def test_a_symlinked_directory_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "kernels").symlink_to(target)
    with pytest.raises(PermissionError, match="symlink"):
        library.private_dir(tmp_path / "kernels")


def test_the_key_covers_sources_headers_compiler_flags_and_context(tmp_path):
    spec = _spec(tmp_path / "src")
    header = tmp_path / "src" / "answer.h"
    header.write_text("/* v1 */\n")
    spec = replace(spec, headers=(header,))
    key = library.library_key(spec, "cc\ngcc 12")
    assert library.library_key(spec, "cc\ngcc 12") == key  # stable
    variants = [
        library.library_key(replace(spec, flags=(*spec.flags, "-O2")), "cc\ngcc 12"),
        library.library_key(replace(spec, context="avx512f"), "cc\ngcc 12"),
        library.library_key(spec, "cc\ngcc 13"),
        library.library_key(spec, "/opt/cc\ngcc 12"),
    ]
    header.write_text("/* v2 */\n")
    variants.append(library.library_key(spec, "cc\ngcc 12"))
    spec.sources[0].write_text("int specdec_answer(void) { return 43; }\n")
    variants.append(library.library_key(spec, "cc\ngcc 12"))
    assert len({key, *variants}) == 1 + len(variants)


def test_the_compiler_identity_is_its_path_and_version(tmp_path):
    fakes = []
    for version in ("1.0", "2.0"):
        fake = tmp_path / version / "cc"
        fake.parent.mkdir()
        fake.write_text(f"#!/bin/sh\necho 'fake cc {version}'\n")
        fake.chmod(0o755)
        fakes.append(library.compiler_identity(str(fake)))
    assert "fake cc 1.0" in fakes[0] and "fake cc 2.0" in fakes[1]
    spec = _spec(tmp_path / "src")
    assert library.library_key(spec, fakes[0]) != library.library_key(spec, fakes[1])


def test_the_kernels_key_changes_with_specdec_kernel_cflags(monkeypatch):
    monkeypatch.delenv("SPECDEC_KERNEL_CFLAGS", raising=False)
    plain = library.library_key(library.library_spec(), "cc\ngcc 12")
    monkeypatch.setenv("SPECDEC_KERNEL_CFLAGS", "-mno-avx512bf16")
    assert "-mno-avx512bf16" in library.library_spec().flags
    assert library.library_key(library.library_spec(), "cc\ngcc 12") != plain


def test_workers_building_at_once_compile_once_and_all_load_it(tmp_path):
    directory = tmp_path / "kernels"
    spec = _spec(tmp_path / "src")
    workers = [_load_elsewhere(spec, directory) for _ in range(4)]
    results = [worker.communicate(timeout=300) for worker in workers]
    assert [out.strip() for out, _ in results] == ["42"] * 4, [err for _, err in results]
    assert sum(err.count("compiled libanswer") for _, err in results) == 1
    lib_path, digest_path = _cached(directory)
    assert digest_path.read_text().strip() == _sha256(lib_path)
    assert sorted(p.name for p in directory.iterdir() if not p.name.endswith(".lock")) == sorted(
        [lib_path.name, digest_path.name]
    )


def test_kernels_never_load_from_a_refused_directory(tmp_path, monkeypatch):
    """Through `cpu`'s own entry point: a refused cache disables the kernels (torch's code paths), never raises."""
    directory = tmp_path / "kernels"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv("SPECDEC_KERNEL_DIR", str(directory))
    monkeypatch.setattr(os, "getuid", lambda: directory.stat().st_uid + 1)
    monkeypatch.setattr(library, "cpu_runs_kernels", lambda: True)  # reach the cache even on a CPU without the ISAs
    library.load_library.cache_clear()
    try:
        assert library.load_library() is None
    finally:
        library.load_library.cache_clear()


@needs_kernels
def test_kernels_that_cannot_allocate_their_scratch_raise_memory_error():
    """Sizes whose scratch (2^62 bytes) no machine can allocate: the kernel returns ENOMEM before touching the
    (small) tensors, and the call raises instead of writing through a NULL pointer."""
    lib = library.load_library()
    q, out = torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16), torch.empty(1, 1, 1, 16, dtype=torch.bfloat16)
    kv = torch.zeros(1, 1, 4, 16, dtype=torch.bfloat16)
    zeros = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(MemoryError, match="specdec_attention_bf16"):
        lib.specdec_attention_bf16(
            q.data_ptr(),
            kv.data_ptr(),
            kv.data_ptr(),
            zeros.data_ptr(),
            zeros.data_ptr(),
            out.data_ptr(),
            1,
            1,
            1,
            1,
            16,
            1 << 60,
            0.25,
            2,
        )
    if lib.specdec_has_int8():
        x, y = torch.zeros(1, 64, dtype=torch.bfloat16), torch.empty(1, 8, dtype=torch.bfloat16)
        w, sw, wsum = torch.zeros(8, 64, dtype=torch.int8), torch.ones(8), torch.zeros(8, dtype=torch.int32)
        with pytest.raises(MemoryError, match="specdec_gemm_w8a8"):
            lib.specdec_gemm_w8a8(
                x.data_ptr(), w.data_ptr(), sw.data_ptr(), wsum.data_ptr(), None, y.data_ptr(), 1 << 56, 8, 64, 1
            )
