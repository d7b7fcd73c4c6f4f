"""`specdec bench offline`."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="benchmarks")
    parser.set_defaults(func=lambda args: parser.print_help())
