"""`specdec serve CONFIG.yaml`: deploy the application on Ray Serve and block until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("serve", help="serve the models of CONFIG.yaml on Ray Serve (gRPC)")
    parser.add_argument("config", help="YAML config: target, draft, grpc_port, ... (see deployments/configs/)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from deployments.launch import serving
    from deployments.serve_config import load_config

    config = load_config(args.config)
    stop = threading.Event()
    with serving(config):
        # After ray.init, which installs handlers of its own: stop by leaving the loop, so the cleanup runs.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(
            f"specdec: serving {config.target.model} (draft: {config.draft.method}) on gRPC port {config.grpc_port}",
            flush=True,
        )
        while not stop.is_set():
            stop.wait(1.0)
        print("specdec: shutting down", flush=True)
    return 0
