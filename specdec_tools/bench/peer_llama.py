"""llama-server, the peer of `specdec bench peer`: its command lines, one server process at a time, and what the built
binary says of itself (version, speculation types).

Flags as `llama-server --help` lists them in llama.cpp as llama-cpp-python 0.3.36 vendors it (`--version`: 0.5.0-dev,
commit 0c1e570), built by benchmarks/peer/build_llamacpp.sh: `-m`, `-md`, `--spec-type` (none, draft-simple,
draft-eagle3, draft-mtp, draft-dflash, draft-dspark, ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod,
ngram-cache), `--spec-draft-n-max` (of the older `--draft-max` this help says "the argument has been removed"),
`-c`, `-t`, `-np`, `--port`. The n-gram types are read from the binary's own help (`ngram_types`), so a build that
adds or drops one is measured as it is.

`-c` is the whole KV pool: with `-np N` given, this build splits it among the slots (its log: `n_ctx_slot = 1024,
kv_unified = 'false'` for `-c 4096 -np 4`), so the command asks for CONTEXT_PER_SLOT x N and every slot holds as
long a sequence as at one.

The completions endpoint (`/v1/completions`) of this build returns no token ids; asked for `return_tokens` and
`verbose`, it puts its native answer, `tokens` included, under `__verbose` (`token_ids`).
"""

from __future__ import annotations

import logging
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CONTEXT_PER_SLOT = 4096
HEALTH_TIMEOUT_S = 600.0  # loading a model from a cold disk
STOP_TIMEOUT_S = 30.0
NO_DRAFT = "no draft"
DRAFT_SIMPLE = "draft-simple"
# What the completions endpoint needs to return the generated token ids (`token_ids`).
BODY_EXTRAS = {"return_tokens": True, "verbose": True}


@dataclass(frozen=True)
class LlamaSetup:
    """The binary, the models and the threads every server of a run is started with; the sweep tries each draft."""

    binary: Path
    target_gguf: Path
    draft_ggufs: tuple[Path, ...]
    threads: int


@dataclass(frozen=True)
class LlamaSpeculation:
    """One speculation setting of llama-server: none, a draft model drafting `draft_n_max`, or an n-gram type.
    `draft_label` names the draft file where the sweep tries more than one."""

    spec_type: str | None = None
    draft_n_max: int | None = None
    draft_gguf: Path | None = None
    draft_label: str | None = None

    @property
    def name(self) -> str:
        if self.spec_type is None:
            return NO_DRAFT
        name = self.spec_type
        if self.draft_n_max is not None:
            name += f" n-max {self.draft_n_max}"
        if self.draft_label:
            name += f" ({self.draft_label})"
        return name

    def flags(self) -> list[str]:
        if self.spec_type is None:
            return []
        flags = ["--spec-type", self.spec_type]
        if self.draft_gguf is not None:
            flags = ["-md", str(self.draft_gguf), *flags]
        if self.draft_n_max is not None:
            flags += ["--spec-draft-n-max", str(self.draft_n_max)]
        return flags


def draft_sweep(n_maxes: Sequence[int], drafts: Sequence[Path]) -> tuple[LlamaSpeculation, ...]:
    """draft-simple with each draft file at each n-max; with several files, each setting names its file's stem."""
    labelled = len(drafts) > 1
    return tuple(
        LlamaSpeculation(DRAFT_SIMPLE, n, draft, draft.stem if labelled else None) for draft in drafts for n in n_maxes
    )


def server_command(setup: LlamaSetup, speculation: LlamaSpeculation, port: int, parallel: int) -> list[str]:
    """The command line of a server with `parallel` slots (the concurrency measured on it)."""
    return [
        str(setup.binary),
        "-m",
        str(setup.target_gguf),
        "--port",
        str(port),
        "-c",
        str(CONTEXT_PER_SLOT * parallel),
        "-t",
        str(setup.threads),
        "-np",
        str(parallel),
        *speculation.flags(),
    ]


def spec_types(help_text: str) -> tuple[str, ...]:
    """The `--spec-type` values a binary's `--help` lists (its line reads `--spec-type a,b,c`)."""
    for line in help_text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "--spec-type":
            return tuple(v for v in words[1].split(",") if v)
    return ()


def ngram_types(help_text: str) -> tuple[str, ...]:
    return tuple(t for t in spec_types(help_text) if t.startswith("ngram"))


def binary_output(binary: Path, flag: str) -> str:
    """What `binary flag` prints (llama.cpp prints its help and version on stderr)."""
    done = subprocess.run([str(binary), flag], capture_output=True, text=True, timeout=60, check=False)
    return (done.stdout + done.stderr).strip()


def token_ids(response: dict[str, Any]) -> list[int] | None:
    """The generated ids of a completions answer asked for them with BODY_EXTRAS; None where it holds none."""
    tokens = (response.get("__verbose") or {}).get("tokens")
    return list(tokens) if isinstance(tokens, list) else None


@contextmanager
def llama_server(command: Sequence[str], port: int) -> Iterator[str]:
    """A server started from `command`, its base URL yielded once `/health` answers 200; stopped after the block.
    A server that exits or stays unhealthy is a RuntimeError quoting the end of its log."""
    with tempfile.TemporaryFile("w+") as log_file:
        process = subprocess.Popen(list(command), stdout=log_file, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(process, port, log_file)
            yield f"http://127.0.0.1:{port}"
        finally:
            _stop(process)


def _wait_healthy(process: subprocess.Popen, port: int, log_file: Any) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode}: {_tail(log_file)}")
        if healthy(f"http://127.0.0.1:{port}"):
            return
        time.sleep(0.5)
    raise RuntimeError(f"llama-server not healthy after {HEALTH_TIMEOUT_S:.0f} s: {_tail(log_file)}")


def healthy(base_url: str) -> bool:
    """Whether `base_url`/health answers 200 (not listening yet, or 503 while a model loads: False)."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("llama-server (pid %d) ignored SIGTERM; killing it", process.pid)
        process.kill()
        process.wait()


def _tail(log_file: Any, lines: int = 15) -> str:
    log_file.seek(0)
    return "\n".join(log_file.read().splitlines()[-lines:])
