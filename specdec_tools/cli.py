"""The `specdec` command: one argparse tree; each subcommand lives in a module of its own that exposes `register()`.

Every module is imported here unconditionally: an import error in any of them is an error with its traceback,
never a command that silently goes missing.
"""

from __future__ import annotations

import argparse
import logging
import sys

from specdec_core.errors import SpecdecError
from specdec_tools import bench, chaos, demo, distill, generate, models, proposals, serve, soak

SUBCOMMANDS = (models, serve, generate, bench, soak, chaos, demo, proposals, distill)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Speculative decoding, lossless.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except SpecdecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
