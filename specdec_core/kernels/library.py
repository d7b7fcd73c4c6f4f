"""Compile C sources into a shared library once, cache it in a private directory, and load only verified bytes.

Threat: a cached library is code that every process loading it runs. Whoever can write the cache can run code
in every worker, so the cache must be private to this user (and to this machine: never a volume other pods
mount, see `environment.kernel_dir`) and a file in it is loaded only if it is the one built here.

What stays true:
- The directory is created mode 0700. An existing one must be a real directory (not a symlink) owned by this
  user, else it is refused (PermissionError); group or other permission bits on it are removed, with a warning.
- A library's file name carries a hash of everything its bytes depend on (`library_key`): sources and headers,
  the compiler (path and `--version`), the flags, and a caller's context (the CPU's features, with -march=native).
  A change to any of them builds a new library; nothing stale is reused.
- Each library has a sidecar recording the SHA-256 of the bytes built. Before loading, the file's bytes are read
  and hashed; a mismatch (tampered with, truncated, or not this user's file) is logged and the library rebuilt.
  The bytes loaded are the bytes hashed (see `_load_image`).
- Several processes on one host may build at once: they build in a private temp directory beside the cache,
  rename into place atomically, and serialise check-then-build on a per-library file lock, so a library and its
  sidecar always change together and one process compiles while the others wait and reuse its result.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from specdec_core import environment
from specdec_core.hardware import AVX2_FLAGS, AVX512_FLAGS, cpu_flags
from specdec_core.kernels import layers_quant

log = logging.getLogger(__name__)

_COMPILE_TIMEOUT_S = 600


@dataclass(frozen=True)
class LibrarySpec:
    """What to compile and everything the resulting bytes depend on."""

    name: str  # file stem, e.g. "libspecdec_cpu"
    sources: tuple[Path, ...]  # passed to the compiler
    headers: tuple[Path, ...] = ()  # included by the sources: hashed, not passed
    flags: tuple[str, ...] = ()  # compiler flags, before the sources
    libraries: tuple[str, ...] = ()  # linker arguments, after the output (e.g. "-lm")
    context: str = ""  # anything else the bytes depend on (e.g. the CPU features that -march=native reads)


def compiler_identity(compiler: str) -> str:
    """The compiler's path and its `--version` output: another compiler, or an upgraded one, is another build."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True, timeout=60)
    return f"{compiler}\n{version.stdout}"


def library_key(spec: LibrarySpec, compiler_id: str) -> str:
    """Hex digest of everything `spec`'s library is built from (`compiler_id`: from `compiler_identity`)."""
    digest = hashlib.sha256()

    def part(data: bytes) -> None:  # length-prefixed: no two different inputs hash as the same stream
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)

    for path in (*spec.sources, *spec.headers):
        part(path.name.encode())
        part(path.read_bytes())
    part(compiler_id.encode())
    for group in (spec.flags, spec.libraries):
        part(b"\0".join(arg.encode() for arg in group))
    part(spec.context.encode())
    return digest.hexdigest()[:32]


def private_dir(path: Path) -> Path:
    """Create `path` mode 0700, or check an existing one (see the module docstring); return it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with suppress(FileExistsError):
        os.mkdir(path, 0o700)
    # Checked and repaired through one descriptor opened without following links, so the directory inspected is the
    # one changed (a symlink swapped in meanwhile fails the open instead).
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise PermissionError(f"kernel cache {path} is not a directory of its own (a symlink?): {exc}") from exc
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid():
            raise PermissionError(f"kernel cache {path} belongs to uid {info.st_uid}, not to this user")
        mode = stat.S_IMODE(info.st_mode)
        if mode != 0o700:
            level = logging.WARNING if mode & 0o022 else logging.INFO  # writable by others: anything in it is suspect
            log.log(level, "kernel cache %s was mode %o: set to 0700", path, mode)
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def load(spec: LibrarySpec, compiler: str, directory: Path) -> ctypes.CDLL:
    """Load `spec`'s library from the cache in `directory`, building it first if it is missing or fails its check.

    Raises OSError (the directory refused, a file unreadable, the library unloadable) or
    subprocess.SubprocessError (the compiler failed).
    """
    directory = private_dir(directory)
    lib_path = directory / f"{spec.name}-{library_key(spec, compiler_identity(compiler))}.so"
    with _exclusive(lib_path.with_suffix(".lock")):
        image = _verified_image(lib_path)
        if image is None:
            image = _build(spec, compiler, lib_path)
    return _load_image(image, directory)


def _sidecar(lib_path: Path) -> Path:
    return lib_path.with_name(lib_path.name + ".sha256")


def _verified_image(lib_path: Path) -> bytes | None:
    """The cached library's bytes if they match their recorded SHA-256; None (logged) if missing or not."""
    try:
        recorded = _read_own_file(_sidecar(lib_path)).decode("ascii", "backslashreplace").strip()
        image = _read_own_file(lib_path)
    except FileNotFoundError:
        return None
    except PermissionError as exc:
        log.warning("not loading the cached %s: %s; rebuilding it", lib_path.name, exc)
        return None
    actual = hashlib.sha256(image).hexdigest()
    if actual != recorded:  # nothing secret here: a plain comparison
        log.warning(
            "cached %s does not match its recorded SHA-256 (tampered with or truncated: %d bytes, sha256 %s, "
            "recorded %s); not loading it, rebuilding",
            lib_path,
            len(image),
            actual,
            recorded[:64],
        )
        return None
    return image


def _read_own_file(path: Path) -> bytes:
    """A regular file's bytes, if this user owns it and only this user can write it (PermissionError if not)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise PermissionError(f"{path.name} cannot be opened as a plain file: {exc}") from exc
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise PermissionError(f"{path.name} is not a file only this user can write")
        return handle.read()


def _build(spec: LibrarySpec, compiler: str, lib_path: Path) -> bytes:
    """Compile `spec` and cache the library and its digest at `lib_path`; return the bytes built."""
    with tempfile.TemporaryDirectory(dir=lib_path.parent, prefix=".build-") as tmp:  # mode 0700, private
        out = Path(tmp) / lib_path.name
        command = [compiler, *spec.flags, *map(str, spec.sources), "-o", str(out), *spec.libraries]
        subprocess.run(command, check=True, capture_output=True, timeout=_COMPILE_TIMEOUT_S)
        os.chmod(out, 0o600)  # whatever the umask: the check before loading refuses a file others can write
        image = out.read_bytes()
        os.replace(out, lib_path)  # atomic: a reader never sees half a library
    _write_atomic(_sidecar(lib_path), hashlib.sha256(image).hexdigest() + "\n")
    log.info("compiled %s into %s", spec.name, lib_path)
    return image


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _load_image(image: bytes, directory: Path) -> ctypes.CDLL:
    """dlopen exactly `image`, the bytes that were hashed.

    Why a fresh copy rather than the cached path: between hashing a path and dlopen-ing it, the file there could
    be replaced (by a sibling process rebuilding it, or by anyone else who can write the directory), and dlopen
    would map the new bytes unchecked. The copy is a new file from mkstemp (O_EXCL, mode 0600, a random name)
    inside the 0700 directory, written from the bytes in memory: only this user can touch it in the moment before
    dlopen maps it. It is unlinked once mapped (the mapping keeps it alive, and its random name and live inode
    never match another library already loaded, so dlopen cannot hand back a stale handle).
    """
    fd, path = tempfile.mkstemp(dir=directory, prefix=".load-", suffix=".so")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(image)
        return ctypes.CDLL(path)
    finally:
        os.unlink(path)


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path` (released when the file closes, even if the process dies)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "r+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


# -- the project's kernels: their build, loading, and C signatures --------------------------------------------------

K_MULTIPLE = 32  # gemm.c's KV: in_features must be a multiple (checked against the library when it loads)
INT8_K_MULTIPLE = 64  # gemm_int8.c's KB
INT4_GROUP = 32  # gemm_int4.c's G: weights per scale
INT4_K_MULTIPLE = 64  # in_features: two groups a step
INT4_PANEL = 8  # gemm_int4.c's PANEL: output rows interleaved in one weight stream

SOURCES = [
    Path(__file__).with_name(name)
    for name in ("gemm.c", "gemm_int8.c", "gemm_int4.c", "attention_bf16.c", "elementwise_bf16.c", "layers_quant.c")
]
HEADERS = [Path(__file__).with_name(name) for name in ("bf16.h", "int8_rows.h")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


def cpu_runs_kernels() -> bool:
    """The kernels build for AVX-512 (F, BW) or, without it, for AVX2 with FMA."""
    flags = cpu_flags()
    return AVX512_FLAGS <= flags or AVX2_FLAGS <= flags


def library_spec() -> LibrarySpec:
    """The kernels' build: the sources, the flags (with `$SPECDEC_KERNEL_CFLAGS`) and this CPU's features, since
    -march=native builds for the compiling CPU and a library built on one may not run on another."""
    return LibrarySpec(
        name="libspecdec_cpu",
        sources=tuple(SOURCES),
        headers=tuple(HEADERS),
        flags=(*FLAGS, *environment.kernel_cflags()),
        libraries=("-lm",),
        context=" ".join(sorted(cpu_flags())),
    )


def kernel_compiler() -> str | None:
    """The C compiler the kernels are built with (`$CC`, else cc, else gcc); None where there is none."""
    return shutil.which(environment.c_compiler()) or shutil.which("gcc")


@lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """Compile (once per source, compiler and flags) and load the kernels; None when this machine cannot run them."""
    if environment.cpu_kernels_disabled() or not cpu_runs_kernels():
        return None
    compiler = kernel_compiler()
    if compiler is None:
        log.warning("no C compiler found: CPU bf16 kernels disabled (decoding works, slower)")
        return None
    try:
        lib = load(library_spec(), compiler, environment.kernel_dir())
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("CPU bf16 kernels unavailable (%s): using torch's matmul", exc)
        return None
    _declare(lib)
    if lib.specdec_k_multiple() != K_MULTIPLE:
        raise RuntimeError("gemm.c and library.py disagree on the K multiple")
    if lib.specdec_int4_k_multiple() != INT4_K_MULTIPLE:
        raise RuntimeError("gemm_int4.c and library.py disagree on the K multiple")
    if lib.specdec_int4_row_multiple() != INT4_PANEL or lib.specdec_block_rows() % INT4_PANEL:
        raise RuntimeError("gemm_int4.c's panels and library.py (or gemm.c's blocks of rows) disagree")
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """The C signatures. The kernels that allocate scratch memory return a status, checked on every call."""
    lib.specdec_gemm_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.specdec_gemm_w8a8.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.specdec_gemm_w4a8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.specdec_attention_bf16.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]
    layers_quant.declare(lib)
    for fn in (
        "specdec_gemm_bf16",
        "specdec_gemm_w8a8",
        "specdec_gemm_w4a8",
        "specdec_attention_bf16",
        "specdec_layers_quant",
    ):
        getattr(lib, fn).restype = ctypes.c_int
        getattr(lib, fn).errcheck = _check_status
    lib.specdec_rms_norm_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    lib.specdec_rope_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    lib.specdec_silu_mul_bf16.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.specdec_exp_f32.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64]
    lib.specdec_rows_span.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
    lib.specdec_rows_finish.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2
    for fn in (
        "specdec_rms_norm_bf16",
        "specdec_rope_bf16",
        "specdec_silu_mul_bf16",
        "specdec_exp_f32",
        "specdec_rows_span",
        "specdec_rows_finish",
    ):
        getattr(lib, fn).restype = None
    for fn in (
        "specdec_block_rows",
        "specdec_k_multiple",
        "specdec_has_vnni",
        "specdec_has_int8",
        "specdec_int4_k_multiple",
        "specdec_int4_row_multiple",
        "specdec_has_native_bf16",
        "specdec_has_avx512",
        "specdec_attention_max_head_dim",
    ):
        getattr(lib, fn).restype = ctypes.c_int


def _check_status(status: int, func: Any, args: tuple[Any, ...]) -> int:
    """ctypes errcheck: a kernel returns 0, or an errno value (ENOMEM: its scratch memory could not be allocated)."""
    if status == errno.ENOMEM:
        raise MemoryError(f"{func.__name__}: could not allocate its scratch memory")
    if status:
        raise RuntimeError(f"{func.__name__} failed: {os.strerror(status)}")
    return status


def kernel_info() -> dict[str, bool]:
    """Which kernels this machine runs (for benchmark reports: the same code is faster with native bf16)."""
    lib = load_library()
    return {
        "cpu_kernels": lib is not None,
        "avx512": bool(lib is not None and lib.specdec_has_avx512()),
        "native_bf16": bool(lib is not None and lib.specdec_has_native_bf16()),
        "vnni": bool(lib is not None and lib.specdec_has_vnni()),
        "int8": bool(lib is not None and lib.specdec_has_int8()),
    }
