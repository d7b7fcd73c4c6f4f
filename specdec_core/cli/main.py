"""The `specdec` command: one argparse tree, each subcommand in its own module."""

from __future__ import annotations

import argparse
import logging
import sys

from specdec_core.errors import SpecdecError


def build_parser() -> argparse.ArgumentParser:
    from specdec_core.cli import bench_cmd, models_cmd

    parser = argparse.ArgumentParser(prog="specdec", description="Speculative decoding, lossless.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)
    models_cmd.register(sub)
    bench_cmd.register(sub)
    try:  # the serving commands need ray and grpc; the engine does not
        from deployments import cli as serving_cli
    except ImportError:
        serving_cli = None
    if serving_cli is not None:
        serving_cli.register(sub)
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
