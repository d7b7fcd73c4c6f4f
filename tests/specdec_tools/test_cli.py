"""The `specdec` command: one tree holding every subcommand; a subcommand that fails to import is an error with
its traceback, never a command that quietly goes missing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from specdec_tools.cli import build_parser

SUBCOMMANDS = {"models", "serve", "generate", "bench", "soak", "chaos", "demo", "proposals", "distill"}
BENCH_MODES = {"offline", "stack", "serve", "sessions", "methods", "structured", "tp", "tracing", "peer", "gpu"}


def _choices(parser) -> set[str]:
    action = next(a for a in parser._actions if a.dest in ("command", "bench_mode"))
    return set(action.choices)


def test_every_subcommand_is_in_the_tree():
    parser = build_parser()
    assert _choices(parser) == SUBCOMMANDS
    bench = next(a for a in parser._actions if a.dest == "command").choices["bench"]
    assert _choices(bench) == BENCH_MODES


def test_an_import_error_in_a_subcommand_fails_loudly():
    script = textwrap.dedent(
        """
        import importlib.abc, sys

        class Broken(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "specdec_tools.soak":
                    raise ImportError("a real bug in specdec_tools.soak")
                return None

        sys.meta_path.insert(0, Broken())
        from specdec_tools.cli import main
        main(["--help"])
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "a real bug in specdec_tools.soak" in result.stderr
