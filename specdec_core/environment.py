"""Every environment variable the project reads, in one place, read at call time (tests and launchers set them).

The engine's own settings (where models and kernels are cached, the kernel switch), and the few that the service
and its clients take from the environment because a config file is the wrong place for them (a secret, the
cluster to join, OpenTelemetry's standard variables). Nothing else calls `os.environ.get`.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

AUTH_TOKEN = "SPECDEC_AUTH_TOKEN"


def specdec_home() -> Path:
    """`$SPECDEC_HOME`, else `~/.cache/specdec`: models are cached there (compiled kernels are not: `kernel_dir`)."""
    return Path(os.environ.get("SPECDEC_HOME") or Path.home() / ".cache" / "specdec").expanduser()


def kernel_dir() -> Path:
    """`$SPECDEC_KERNEL_DIR`, else `$XDG_CACHE_HOME/specdec/kernels`, else `~/.cache/specdec/kernels`: the private
    (0700) cache of the compiled CPU kernels.

    Never derived from `$SPECDEC_HOME`: in the Kubernetes manifests that is the models volume every pod mounts, and
    whoever can write a cached library runs code in every worker that loads it. Point it at storage private to the
    pod (its own disk or an emptyDir), never at a shared volume.
    """
    if explicit := os.environ.get("SPECDEC_KERNEL_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    cache = Path(xdg) if Path(xdg).is_absolute() else Path.home() / ".cache"  # the XDG spec ignores a relative one
    return cache / "specdec" / "kernels"


def pip_args() -> list[str]:
    """`$SPECDEC_PIP_ARGS`: extra arguments for every `pip download` of a model, e.g. `--no-index --find-links DIR`."""
    return shlex.split(os.environ.get("SPECDEC_PIP_ARGS", ""))


def cpu_kernels_disabled() -> bool:
    """`$SPECDEC_DISABLE_CPU_KERNELS` set to anything: models keep torch's code paths."""
    return bool(os.environ.get("SPECDEC_DISABLE_CPU_KERNELS"))


def draft_int8_rows_disabled() -> bool:
    """`SPECDEC_DISABLE_INT8_ROWS`: a 4-bit draft runs calls of several rows on its own kernel too, not fbgemm's
    int8 GEMM (`kernels/fbgemm_rows.py`): the two side by side in benchmarks, or a way around a faulty fbgemm."""
    return bool(os.environ.get("SPECDEC_DISABLE_INT8_ROWS"))


def huge_pages_disabled() -> bool:
    """`SPECDEC_DISABLE_HUGE_PAGES`: a CPU model's weights stay in the pages they were loaded into (`huge_pages.py`):
    the two side by side in benchmarks, or a host where collapsing them costs more than it saves."""
    return bool(os.environ.get("SPECDEC_DISABLE_HUGE_PAGES"))


def c_compiler() -> str:
    """`$CC`, else `cc`: compiles the CPU kernels."""
    return os.environ.get("CC", "cc")


def kernel_cflags() -> list[str]:
    """`$SPECDEC_KERNEL_CFLAGS`: appended to the kernels' compiler flags, e.g. -mno-avx512bf16 for the fp32 path."""
    return shlex.split(os.environ.get("SPECDEC_KERNEL_CFLAGS", ""))


def auth_token() -> str | None:
    """`$SPECDEC_AUTH_TOKEN`: the public API's bearer token (servers check it, clients send it); None when unset."""
    return os.environ.get(AUTH_TOKEN, "").strip() or None


def ray_address() -> str | None:
    """`$RAY_ADDRESS`: the Ray cluster to join; None starts a local one."""
    return os.environ.get("RAY_ADDRESS") or None


def otel_variables() -> dict[str, str]:
    """The OTEL_* variables of this process (OpenTelemetry's standard configuration)."""
    return {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
