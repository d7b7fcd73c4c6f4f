"""`make image-test`: the image serves, and a client outside the container gets answers over gRPC and HTTP.

Builds the tiny random-weight pair here (the project's own builder, no download) into a temporary directory, mounts
it read-only in a container of IMAGE with a tiny serve config (`threads: 1`), runs `specdec serve` there through a
login shell (as KubeRay runs its commands, so the image's PATH is the one pods see), publishes the gRPC and HTTP
ports on 127.0.0.1, then from this machine:

- HTTP: GET /v1/models until the application is up, then POST /v1/completions;
- gRPC: `specdec generate` against the published port.

First, in a throwaway container: the commands the manifests run are on that PATH, and the CPU kernels compile with
the image's gcc where this CPU can run them (AVX-512, or AVX2 with FMA). Exit status 0 when all of it works;
otherwise the container's log is printed.

    .venv/bin/python scripts/image_smoke.py --image specdec:dev
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

# What podman needs on these machines; --run-flags replaces it.
DEFAULT_RUN_FLAGS = "--runtime runc --ulimit nofile=20000:20000 --ulimit nproc=32768:32768"
MOUNT = "/smoke"  # the temporary directory, read-only, in the container
CONFIG = f"""\
auth: none
grpc_port: 9000
http_port: 8000
target:
  model: {MOUNT}/target
  dtype: float32
  num_cpus: 1
  threads: 1
draft:
  method: draft_model
  model: {MOUNT}/draft
  dtype: float32
  num_speculative_tokens: 3
  num_cpus: 1
  threads: 1
router:
  max_seq_len: 256
  default_max_tokens: 16
"""
# The manifests' commands and what they need, as KubeRay runs them (`bash -lc`); then the kernels, compiled.
IMAGE_CHECK = (
    "set -e; for c in ray specdec python3.11 gcc openssl wget; do printf '%s: ' $c; command -v $c; done; "
    "python3.11 -c 'from specdec_core.kernels import library; print(\"kernels:\", library.load_library())'"
)


class SmokeError(Exception):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def podman(*args: str, check: bool = True, capture: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["podman", *args], text=True, capture_output=capture)
    if check and result.returncode:
        raise SmokeError(f"podman {shlex.join(args)} exited {result.returncode}:\n{result.stderr or result.stdout}")
    return result


def http_json(url: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def check_image(image: str, run_flags: list[str]) -> None:
    if podman("image", "exists", image, check=False).returncode:
        raise SmokeError(f"no image {image} here: build it first (make image IMAGE={image})")
    result = podman("run", "--rm", *run_flags, image, "bash", "-lc", IMAGE_CHECK, check=False)
    print(result.stdout, end="")
    if result.returncode:
        raise SmokeError(f"the image lacks a command the manifests run, or python fails:\n{result.stderr}")
    flags = set(Path("/proc/cpuinfo").read_text().split())
    runs_kernels = {"avx512f", "avx512bw"} <= flags or {"avx2", "fma"} <= flags
    if runs_kernels and "kernels: None" in result.stdout:
        raise SmokeError(
            f"this CPU runs the CPU kernels (AVX-512 or AVX2) but they did not compile in the image:\n{result.stderr}"
        )


def wait_for_models(name: str, http: str, timeout: float) -> str:
    """The served model id, once /v1/models answers; fails early if the container has stopped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = podman("inspect", "--format", "{{.State.Running}}", name, check=False).stdout.strip()
        if state != "true":
            raise SmokeError(f"the container stopped before serving (running: {state or 'gone'})")
        try:
            return http_json(f"{http}/v1/models", timeout=5)["data"][0]["id"]
        except (urllib.error.URLError, ConnectionError, OSError, KeyError, IndexError, ValueError):
            time.sleep(2)
    raise SmokeError(f"no answer on {http}/v1/models within {timeout:.0f} s")


def smoke(image: str, run_flags: list[str], timeout: float) -> None:
    from specdec_core.models.tiny import build_tiny_pair

    check_image(image, run_flags)
    with tempfile.TemporaryDirectory(prefix="specdec-image-smoke-") as tmp:
        root = Path(tmp)
        build_tiny_pair(root)
        (root / "serve.yaml").write_text(CONFIG)
        # The container runs as `ray`, not as this machine's user, and the weights are written private (0600).
        for path in [root, *root.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        grpc_port, http_port = free_port(), free_port()
        name = f"specdec-smoke-{grpc_port}"
        podman(
            "run",
            "--detach",
            "--name",
            name,
            *run_flags,
            "--shm-size",
            "1g",
            "--publish",
            f"127.0.0.1:{grpc_port}:9000",
            "--publish",
            f"127.0.0.1:{http_port}:8000",
            "--volume",
            f"{root}:{MOUNT}:ro",
            image,
            "bash",
            "-lc",
            f"exec specdec serve {MOUNT}/serve.yaml",
        )
        try:
            started = time.monotonic()
            http = f"http://127.0.0.1:{http_port}"
            model = wait_for_models(name, http, timeout)
            print(
                f"serving {model} after {time.monotonic() - started:.0f} s "
                f"(gRPC 127.0.0.1:{grpc_port}, HTTP 127.0.0.1:{http_port})"
            )

            reply = http_json(
                f"{http}/v1/completions",
                {"model": model, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0},
            )
            if not reply.get("usage", {}).get("completion_tokens"):
                raise SmokeError(f"/v1/completions returned no tokens: {reply}")
            print(f"HTTP /v1/completions: {reply['choices'][0]['text']!r} ({reply['usage']})")

            generate = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "specdec_tools.cli",
                    "generate",
                    "--address",
                    f"127.0.0.1:{grpc_port}",
                    "--max-tokens",
                    "8",
                    "--timeout",
                    "60",
                    "def add(a, b):",
                ],
                text=True,
                capture_output=True,
            )
            if generate.returncode:
                raise SmokeError(f"specdec generate exited {generate.returncode}: {generate.stderr}")
            stats = generate.stderr.strip().splitlines()[-1:]  # `specdec generate` prints its numbers last
            print(f"gRPC specdec generate: {generate.stdout.strip()!r} {' '.join(stats)}")
        except Exception:
            logs = podman("logs", "--tail", "60", name, check=False)
            print(f"--- the container's log (last 60 lines) ---\n{logs.stdout}{logs.stderr}", file=sys.stderr)
            raise
        finally:
            podman("rm", "--force", "--time", "10", name, check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="specdec:dev")
    parser.add_argument("--run-flags", default=DEFAULT_RUN_FLAGS, help=f"for podman run (default: {DEFAULT_RUN_FLAGS})")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the application to come up")
    args = parser.parse_args()
    try:
        smoke(args.image, shlex.split(args.run_flags), args.timeout)
    except (SmokeError, OSError, ValueError) as exc:  # OSError: urllib's errors, a missing podman
        print(f"image smoke test FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"image smoke test passed: {args.image}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
