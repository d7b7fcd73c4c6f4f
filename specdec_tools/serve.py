"""`specdec serve MODEL [flags]` or `specdec serve CONFIG.yaml`: deploy the application on Ray Serve and block until
Ctrl-C or SIGTERM. The flags and how they map onto the config: `specdec_tools.serve_flags`."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from typing import Any

from specdec_core.environment import AUTH_TOKEN
from specdec_tools import serve_flags


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "serve",
        help="serve MODEL (or the models of CONFIG.yaml) on Ray Serve: gRPC and an OpenAI-compatible HTTP API",
        description="Flags take vLLM's names; a YAML config (deployments/configs/) holds the rest.",
    )
    serve_flags.add_arguments(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    resolved = serve_flags.resolve(args)
    if args.print_config:
        print(serve_flags.printed(resolved), end="", flush=True)
        return 0
    from deployments.launch import serving

    config = resolved.config
    if resolved.api_key is not None:
        # Where the application reads the token from: this process's environment, passed on to the router.
        os.environ[AUTH_TOKEN] = resolved.api_key
    stop = threading.Event()
    with serving(config):
        # After ray.init, which installs handlers of its own: stop by leaving the loop, so the cleanup runs.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(
            f"specdec: serving {config.target.model} (draft: {config.draft.method}) on gRPC port {config.grpc_port}, "
            f"HTTP port {config.http_port}",
            flush=True,
        )
        if config.auth == "none":
            print("specdec: the API is open (auth: none): keep it to your own machine, or give --api-key", flush=True)
        while not stop.is_set():
            stop.wait(1.0)
        print("specdec: shutting down", flush=True)
    return 0
