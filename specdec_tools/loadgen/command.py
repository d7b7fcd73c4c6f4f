"""What the commands that send requests to a running server (`bench serve`, `bench sessions`) share: the server's
flags (`transport.connect`'s parameters), argparse types whose errors name the flag, and the run that ends in a
report."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from specdec_tools.loadgen.transport import PROTOCOLS, Unreachable
from specdec_tools.reports import write_report


def add_server_command(modes: Any, name: str, help: str, description: str) -> argparse.ArgumentParser:
    """The subcommand `name` of `modes`, with the server's flags: --address, --protocol, --timeout, --auth-token
    (where the server is, which API, and how each request goes)."""
    parser = modes.add_parser(
        name, help=help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--address",
        required=True,
        help="HOST:PORT of the server's gRPC endpoint, or of its HTTP API with --protocol openai",
    )
    parser.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="grpc",
        help="grpc: GenerateStream; openai: streamed /v1/chat/completions",
    )
    parser.add_argument("--timeout", type=positive(float), default=600.0, help="seconds per request")
    parser.add_argument("--auth-token", default=None, help="sent as `authorization: Bearer TOKEN`")
    return parser


def positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0 or (kind is float and math.isinf(value)):
            raise argparse.ArgumentTypeError(
                f"must be a positive {'integer' if kind is int else 'number'}, got {text!r}"
            )
        return value

    return parse


def non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return int(text)


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text!r}")
    return value


def run_to_report(work: Coroutine[Any, Any, dict[str, Any]], path: Path) -> dict[str, Any] | None:
    """Run a command's whole `work` and write the report it returns to `path`. None, with the error printed and
    no report written, when the server did not answer: the command then exits with code 1."""
    try:
        report = asyncio.run(work)
    except Unreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    write_report(report, path)
    return report
