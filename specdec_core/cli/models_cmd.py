"""`specdec models pull NAME` and `specdec models list`."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("models", help="fetch and list the named models")
    parser.set_defaults(func=lambda args: parser.print_help())
